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



@pytest.mark.parametrize("rank", [0, 1])
def test_ranks_launched_on_cpu_without_use_cpu_train_as_one_world(patched, tmp_path, monkeypatch, caplog, rank):
    """torchrun (or deepspeed) on a machine with no GPU, without ``use_cpu``: HF's arguments joined the launcher's
    gloo group and took each rank for the only process, so each trained alone on all the data and wrote the same
    files. They now see the world, as ``use_cpu=True`` does. Here a rank of a launched world of 2 is simulated (the
    launcher's variables, a process group of 2 answered by stand-ins): tests/strategies/test_launchers.py runs the
    real torchrun and deepspeed lines without --use_cpu."""
    import pyreft
    import torch
    from accelerate.state import AcceleratorState
    from transformers import TrainingArguments

    if torch.cuda.is_available():
        pytest.skip("the case of a machine with no GPU")
    # the launcher's variables; OMP_NUM_THREADS as it is, or accelerate sets torch's threads for the whole process
    for name, value in {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": 2, "LOCAL_WORLD_SIZE": 2,
                        "OMP_NUM_THREADS": torch.get_num_threads()}.items():
        monkeypatch.setenv(name, str(value))
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: rank)
    try:
        args = TrainingArguments(output_dir=str(tmp_path), report_to=[])
        assert args.world_size == 1  # HF's reading, before the trainer
        trainer = pyreft.ReftTrainer(model=ParityCase().build(), args=args)
        seen = (trainer.args.world_size, trainer.args.process_index, trainer.accelerator.num_processes,
                trainer.is_world_process_zero())
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)  # accelerate's state of a world of 2, not here
    assert seen == (2, rank, 2, rank == 0)
    said = "2 processes were launched on a machine with no GPU, and TrainingArguments made without use_cpu"
    assert (said in caplog.text) == (rank == 0), caplog.text  # once, by rank 0
