"""DDP over gloo at world sizes 1 and 2 gives the losses, gradients and weights of one process."""

import pytest
import torch.distributed as dist

import helpers
from pyvene_dist.testing import ParityCase, assert_parity, differences, train

CASES = [
    pytest.param(ParityCase(model="llama"), id="llama-fp32"),
    pytest.param(ParityCase(model="gpt2"), id="gpt2-fp32"),
    pytest.param(ParityCase(model="llama", dtype="bfloat16", lr=1e-3), id="llama-bf16"),
    pytest.param(ParityCase(model="llama", layers=(0, 1, 1), component="mlp_output", positions=3), id="llama-mlp-3x"),
]


@pytest.mark.world_size(1, 2)
@pytest.mark.parametrize("case", CASES)
def test_ddp_matches_one_process(case):
    helpers.patch()
    candidate = train(case, "ddp")
    if dist.get_rank() == 0:
        reference = train(case, "single")
        print(f"{case.model} {case.dtype}: {differences(reference, candidate)}")
        assert_parity(reference, candidate, case.tolerance)
