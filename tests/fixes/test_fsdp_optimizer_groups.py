"""FSDP2 with a base that trains parameters of its own beside the interventions (``fixes.fsdp``): those become
DTensors while the interventions stay plain tensors, and a foreach or fused optimizer step over one param group
holding both fails (on CUDA, where foreach is torch's default, on the first step):
``RuntimeError: aten._foreach_mul_.Scalar got mixed torch.Tensor and DTensor`` (pytorch/pytorch#183207). Found on
one H200 by tests/fixes/test_fsdp_mixed_precision.py; the tests here force foreach, which is off by default on the CPU.
"""

import warnings

import pytest
import torch
import torch.distributed as dist

import helpers
from pyvene_dist.testing import ParityCase


def _kinds(params) -> set[bool]:
    from torch.distributed.tensor import DTensor

    return {isinstance(p, DTensor) for p in params}


def _sharded(case: ParityCase):
    from pyvene_dist.fully_shard import fully_shard_model

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = fully_shard_model(case.build())
    return model, [w for w in caught if issubclass(w.category, RuntimeWarning)]


@pytest.mark.world_size(1)
def test_sharding_a_trainable_head_warns_once_naming_it():
    """The wrap warns where the mix is made, naming the head, the failure and the ways out; ``fully_shard_model``
    calls ``fully_shard`` for every layer and then the model, and one warning comes."""
    helpers.patch()
    _, caught = _sharded(ParityCase())
    assert len(caught) == 1, [str(w.message) for w in caught]
    message = str(caught[0].message)
    for part in ("model.lm_head.weight", "aten._foreach_mul_.Scalar got mixed torch.Tensor and DTensor",
                 "pytorch/pytorch#183207", "a param group of their own", "foreach=False", "HF Trainer"):
        assert part in message, (part, message)
    assert caught[0].filename.endswith("pyvene_dist/fully_shard.py")  # where fully_shard is called


@pytest.mark.world_size(1)
def test_no_warning_when_only_the_interventions_train():
    helpers.patch()
    _, caught = _sharded(ParityCase(trainable_head=False))
    assert not caught, [str(w.message) for w in caught]


@pytest.mark.world_size(1)
def test_the_interventions_in_a_group_of_their_own_step_with_foreach():
    """The way out the warning gives: each group holds one kind, and foreach (CUDA's default) steps."""
    helpers.patch()
    case = ParityCase()
    model, _ = _sharded(case)
    interventions = set(model.interventions.parameters())
    others = [p for p in model.parameters() if p.requires_grad and p not in interventions]
    optimizer = torch.optim.AdamW([{"params": list(interventions)}, {"params": others}], lr=1e-2, foreach=True)
    before = [p.detach().clone() for p in interventions]
    helpers.train_step(model, optimizer, case)
    assert all(not torch.equal(p, b) for p, b in zip(interventions, before))


@pytest.mark.world_size(1)
def test_pyvene_dists_param_groups_keep_the_interventions_apart():
    """``pyvene_dist.optim.param_groups``, which the docs' FSDP2 recipe and the parity harness build their AdamW on,
    gave the sharded head and the plain interventions one group (the decayed one)."""
    from pyvene_dist.optim import param_groups

    helpers.patch()
    case = ParityCase()
    model, _ = _sharded(case)
    groups = param_groups(model, weight_decay=0.01)
    # decayed: the interventions' weights, and apart from them the head; not decayed: the interventions' biases
    # and rotations (the head has no bias)
    assert [len(_kinds(group["params"])) for group in groups if group["params"]] == [1, 1, 1]
    assert [group["weight_decay"] for group in groups] == [0.01, 0.01, 0.0]
    helpers.train_step(model, torch.optim.AdamW(groups, lr=1e-2, foreach=True), case)


@pytest.mark.world_size(1)
def test_hf_trainers_optimizer_never_runs_foreach_over_both_kinds(tmp_path):
    """HF Trainer's ``create_optimizer`` over a sharded pyvene model with a trainable head: transformers 5.24+ gives
    the DTensors and the plain tensors groups of their own, 5.17 turns foreach and fused off for a group that mixes
    them; either way no group runs foreach or fused over both, and a step runs with fused or foreach (forced here,
    CUDA's default) on every group that holds one kind."""
    import pyreft
    from transformers import TrainingArguments

    helpers.patch()
    case = ParityCase()
    model, _ = _sharded(case)
    args = TrainingArguments(output_dir=str(tmp_path / f"rank{dist.get_rank()}"), report_to=[], use_cpu=True)
    optimizer = pyreft.ReftTrainer(model=model, args=args).create_optimizer()
    trained = [p for group in optimizer.param_groups for p in group["params"]]
    assert _kinds(trained) == {True, False}  # the head sharded, the interventions plain
    for index, group in enumerate(optimizer.param_groups):
        if len(_kinds(group["params"])) > 1:
            assert group["foreach"] is False and not group["fused"], (index, group["foreach"], group["fused"])
        elif not group["fused"]:  # transformers 5.24's default is adamw_torch_fused: fused, as on CUDA
            group["foreach"] = True
    helpers.train_step(model, optimizer, case)


@pytest.mark.world_size(1)
def test_the_harness_which_builds_param_groups_is_not_warned():
    """The warning has its own class, so that code whose optimizer is ``param_groups``' (the parity harness, and so
    ``pyvene-dist check``) can filter it: a training run under FSDP2 with a trainable head prints none."""
    from pyvene_dist.optim import MixedParameterGroupsWarning
    from pyvene_dist.testing import train

    helpers.patch()
    _, caught = _sharded(ParityCase())
    assert [w.category for w in caught] == [MixedParameterGroupsWarning]
    with warnings.catch_warnings(record=True) as during_training:
        warnings.simplefilter("always")
        train(ParityCase(steps=1), "fsdp2")
    assert not [w for w in during_training if issubclass(w.category, MixedParameterGroupsWarning)]
