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

    from pyvene_dist.fsdp import fully_shard_model

    helpers.patch()
    model = fully_shard_model(ParityCase().build())
    base = dict(model.model.named_parameters())
    assert base and all(isinstance(p, DTensor) for p in base.values())
    interventions = list(model.interventions.parameters())
    assert interventions and not any(isinstance(p, DTensor) for p in interventions)
    # The saved form pyreft reads outside any forward is a plain read on every rank.
    state = next(iter(model.interventions.values())).state_dict()
    assert state["rotate_layer"].shape == (32, 4)


@pytest.mark.world_size(2)
def test_fully_shard_without_pyvene_models_is_untouched():
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    helpers.patch()
    layer = torch.nn.Linear(4, 4)
    fully_shard(layer)
    assert all(isinstance(p, DTensor) for p in layer.parameters())
