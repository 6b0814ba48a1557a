"""HF Trainer under an initialised process group: DDP parity at components beside the suite's (its DDP settings for
ReFT models are fixes/test_hf_trainer.py's)."""

import pytest
import torch.distributed as dist

import helpers
from pyvene_dist.testing import ParityCase, assert_parity, train


LINKED_AND_MIXED = [
    pytest.param(ParityCase(layers=(0, 1, 1), component="mlp_output"), id="three-at-mlp-output"),
    pytest.param(ParityCase(layers=(1,), component="attention_output", positions=4), id="attention-output"),
]


@pytest.mark.world_size(2)
@pytest.mark.parametrize("case", LINKED_AND_MIXED)
def test_ddp_parity_at_other_components(case):
    helpers.patch()
    candidate = train(case, "ddp")
    if dist.get_rank() == 0:
        assert_parity(train(case, "single"), candidate, case.tolerance)
