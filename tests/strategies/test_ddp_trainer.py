"""HF Trainer under an initialised process group: DDP settings chosen for ReFT models."""

import pytest
import torch.distributed as dist

import helpers
from pyvene_dist.testing import ParityCase, assert_parity, train


@pytest.mark.world_size(2)
def test_ddp_does_not_search_for_unused_parameters(tmp_path):
    import pyreft
    from transformers import TrainingArguments

    helpers.patch()
    model = ParityCase().build()
    args = TrainingArguments(output_dir=str(tmp_path / f"rank{dist.get_rank()}"), report_to=[], use_cpu=True)
    trainer = pyreft.ReftTrainer(model=model, args=args)
    assert trainer.accelerator.ddp_handler.find_unused_parameters is False
    assert args.ddp_find_unused_parameters is None  # the user's arguments are left as they were


@pytest.mark.world_size(2)
def test_an_explicit_setting_wins(tmp_path):
    import pyreft
    from transformers import TrainingArguments

    helpers.patch()
    args = TrainingArguments(output_dir=str(tmp_path / f"rank{dist.get_rank()}"), report_to=[], use_cpu=True,
                             ddp_find_unused_parameters=True)
    trainer = pyreft.ReftTrainer(model=ParityCase().build(), args=args)
    assert trainer.accelerator.ddp_handler.find_unused_parameters is True


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
