"""FSDP2 (fully_shard) over gloo shards the base model, keeps interventions whole, and matches one process."""

import pytest
import torch
import torch.distributed as dist

import helpers
from pyvene_dist.testing import ParityCase, assert_parity, differences, train

CASES = [
    pytest.param(ParityCase(model="llama"), id="llama-fp32"),
    pytest.param(ParityCase(model="gpt2", component="mlp_output"), id="gpt2-mlp-fp32"),
    pytest.param(ParityCase(model="llama", dtype="bfloat16", lr=1e-3), id="llama-bf16"),
]


@pytest.mark.world_size(1, 2)
@pytest.mark.parametrize("case", CASES)
def test_fsdp2_matches_one_process(case):
    helpers.patch()
    candidate = train(case, "fsdp2")
    if dist.get_rank() == 0:
        reference = train(case, "single")
        print(f"{case.model} {case.dtype}: {differences(reference, candidate)}; parameter bytes on rank 0: "
              f"{candidate.parameter_bytes} of {reference.parameter_bytes}")
        assert_parity(reference, candidate, case.tolerance)


@pytest.mark.world_size(2)
def test_base_is_sharded_and_interventions_stay_whole():
    from torch.distributed.tensor import DTensor

    from pyvene_dist.fully_shard import fully_shard_model

    helpers.patch()
    model = fully_shard_model(ParityCase().build())
    base = dict(model.model.named_parameters())
    assert base and all(isinstance(p, DTensor) for p in base.values())
    interventions = list(model.interventions.parameters())
    assert interventions and not any(isinstance(p, DTensor) for p in interventions)
    # The saved form pyreft reads outside any forward is a plain read on every rank.
    state = next(iter(model.interventions.values())).state_dict()
    assert state["rotate_layer"].shape == (32, 4)



@pytest.mark.world_size(1)
def test_excluding_consistency_leaves_its_check_out_under_fsdp_too():
    """fsdp runs consistency's check (the ranks' interventions compared) only where that fix is applied:
    ``exclude=["consistency"]`` left it running under FSDP."""
    import pyvene_dist
    from pyvene_dist.fully_shard import fully_shard_model
    from pyvene_dist.mechanisms import same_interventions

    described, intervention_rows = [], same_interventions.intervention_rows
    same_interventions.intervention_rows = lambda model: described.append(model) or intervention_rows(model)
    try:
        for exclude, checked in ((["consistency"], False), ([], True)):
            described.clear()
            with pyvene_dist.patched(exclude=exclude):
                fully_shard_model(ParityCase().build())
            assert bool(described) is checked, f"exclude={exclude}: the check described {len(described)} models"
    finally:
        same_interventions.intervention_rows = intervention_rows

@pytest.mark.world_size(1)
def test_unpatch_removes_the_interventions_gradient_averaging():
    """fully_shard, patched, hooks each trainable intervention parameter to average its gradient over the
    ranks; unpatch() removes those hooks with the rest."""
    import pyvene_dist
    from pyvene_dist.fully_shard import fully_shard_model

    helpers.patch()
    model = fully_shard_model(ParityCase().build())
    trainable = [p for p in model.interventions.parameters() if p.requires_grad]
    assert trainable and all(p._post_accumulate_grad_hooks for p in trainable)
    pyvene_dist.unpatch()
    assert not any(p._post_accumulate_grad_hooks for p in trainable)


@pytest.mark.world_size(2)
def test_fully_shard_without_pyvene_models_is_untouched():
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    helpers.patch()
    layer = torch.nn.Linear(4, 4)
    fully_shard(layer)
    assert all(isinstance(p, DTensor) for p in layer.parameters())


# ---------------------------------------------------------------------------------------------- GPU
@pytest.mark.world_size(2, backend="nccl")
@pytest.mark.parametrize("case", CASES[:2])
def test_fsdp1_by_hand_matches_one_gpu(case):
    helpers.patch()
    candidate = train(case, "fsdp1")
    if dist.get_rank() == 0:
        reference = train(case, "single")
        print(f"fsdp1 {case.model}: {differences(reference, candidate)}")
        assert_parity(reference, candidate, case.tolerance)


MEMORY_CASE = ParityCase(hidden_size=2048, num_layers=16, batch_size=8, seq_len=256, steps=2, lr=1e-3)


@pytest.mark.world_size(2, backend="nccl", timeout=600)
def test_fsdp2_holds_half_the_parameters_of_ddp():
    helpers.patch()
    records = {strategy: train(MEMORY_CASE, strategy) for strategy in ("ddp", "fsdp2")}
    if dist.get_rank() == 0:
        ddp, fsdp = records["ddp"], records["fsdp2"]
        print(f"0.6B Llama fp32 on 2 GPUs, rank 0: parameters DDP {ddp.parameter_bytes / 2**30:.2f} GiB, "
              f"FSDP2 {fsdp.parameter_bytes / 2**30:.2f} GiB; peak DDP {ddp.peak_memory_bytes / 2**30:.2f} GiB, "
              f"FSDP2 {fsdp.peak_memory_bytes / 2**30:.2f} GiB; losses {ddp.losses} vs {fsdp.losses}")
        assert fsdp.parameter_bytes < 0.55 * ddp.parameter_bytes
        assert_parity(ddp, fsdp, MEMORY_CASE.tolerance)
