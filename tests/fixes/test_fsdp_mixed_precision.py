"""FSDP2 with a bf16 mixed-precision policy trains the interventions (fixes.fsdp), as accelerate sets it up on GPUs.

``accelerate launch --config_file docs/configs/accelerate-fsdp2.yaml docs/examples/train_reft.py ... --bf16`` on one
H200 failed in the first forward: ``RuntimeError: mat1 and mat2 must have the same dtype, but got BFloat16 and
Float``. accelerate's FSDP2 (``fsdp2_prepare_model``) casts every trainable parameter, the interventions' too, to
float32 and shards with ``MixedPrecisionPolicy(param_dtype=bfloat16)``, without autocast; the interventions are
left out of sharding, so out of the policy. On the CPU accelerate applies FSDP in a GPU world only (the same line
trains DDP under autocast there); the tests below make accelerate's ``Accelerator`` take the FSDP2 plugin on the
CPU, as tests/scripts/train_with_trainer.py does for HF Trainer, and run its own preparation.
"""

import pytest
import torch

import helpers
from pyvene_dist.testing import ParityCase


def accelerate_fsdp2(mixed_precision: str):
    """accelerate's ``Accelerator`` with the FSDP2 plugin as ``accelerate-fsdp2.yaml`` gives it, on the CPU: its
    world type reads as ``MULTI_GPU`` while it is made (the device stays the CPU)."""
    from accelerate import Accelerator
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    PartialState(cpu=True)
    shared = PartialState._shared_state
    world_type, shared["distributed_type"] = shared["distributed_type"], DistributedType.MULTI_GPU
    try:
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                                reshard_after_forward=True, state_dict_type="FULL_STATE_DICT")
        return Accelerator(mixed_precision=mixed_precision, fsdp_plugin=plugin, cpu=True)
    finally:
        shared["distributed_type"] = world_type


def reset_accelerate():
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()


@pytest.mark.world_size(1, timeout=300)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_accelerate_fsdp2_bf16_trains_the_interventions(dtype):
    """A ReFT model in ``dtype`` (the script's ``--dtype``) prepared by accelerate's FSDP2 with
    ``mixed_precision="bf16"``: the interventions' weights are accelerate's float32 master weights, the hidden states
    bf16; a training step runs, its logits in bf16, and changes every intervention weight."""
    from torch.distributed.tensor import DTensor

    helpers.patch()
    case = ParityCase(dtype=dtype)
    model = case.build()
    accelerator = accelerate_fsdp2("bf16")
    try:
        # As on a GPU, where foreach is torch's default: one param group holding the sharded head's DTensors and
        # the plain interventions fails (pytorch/pytorch#183207), so each kind has its own, as fixes.fsdp's warning says
        interventions = list(model.interventions.parameters())
        others = [p for p in model.parameters() if p.requires_grad and all(p is not i for i in interventions)]
        optimizer = torch.optim.AdamW([{"params": interventions}, {"params": others}], lr=1e-2, foreach=True)
        model, optimizer = accelerator.prepare(model, optimizer)
        assert any(isinstance(p, DTensor) for p in model.model.parameters())  # FSDP2 sharded the base
        before = {name: p.detach().clone() for name, p in model.interventions.named_parameters()}
        assert before and all(p.dtype == torch.float32 for p in before.values())  # accelerate's upcast
        out = helpers.train_step(model, optimizer, case)
        assert out.logits.dtype == torch.bfloat16  # the policy's compute dtype
        for name, p in model.interventions.named_parameters():
            assert p.dtype == torch.float32 and not torch.equal(p, before[name]), name
    finally:
        reset_accelerate()


@pytest.mark.world_size(1)
def test_unpatch_removes_the_casts():
    """The casts are hooks on the interventions, kept in the model's state: ``unpatch()`` removes them."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    import pyvene_dist
    from pyvene_dist.fully_shard import fully_shard_model

    helpers.patch()
    model = fully_shard_model(ParityCase().build(), mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    interventions = list(model.interventions.values())
    assert all(i._forward_pre_hooks and i._forward_hooks for i in interventions)
    pyvene_dist.unpatch()
    assert not any(i._forward_pre_hooks or i._forward_hooks for i in interventions)
