"""HF Trainer with a pyvene model (``fixes.hf_trainer``): pyreft's columns are kept, and DDP does not search for
unused parameters unless told to."""

import pytest
import torch.distributed as dist

import helpers
from pyvene_dist.testing import ParityCase


def test_pyrefts_columns_are_kept_and_the_others_dropped(patched, tmp_path):
    """With ``remove_unused_columns=True`` (HF Trainer's default) the kept columns were those named in
    ``IntervenableModel.forward``'s signature, none of pyreft's: ``compute_loss`` then failed with
    ``KeyError: 'input_ids'``."""
    import datasets
    import pyreft
    from transformers import TrainingArguments

    dataset = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3]], "labels": [[-100, 2, 3]],
                                          "intervention_locations": [[[0]]], "note": ["not a model input"]})
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    trainer = pyreft.ReftTrainer(model=ParityCase().build(), args=args)
    kept = trainer._remove_unused_columns(dataset).column_names
    assert sorted(kept) == ["input_ids", "intervention_locations", "labels"]


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
