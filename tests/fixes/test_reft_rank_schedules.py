"""``reft_rank_schedules``: pyreft's trainers refuse, on every rank at ``train``, ranks whose arguments schedule HF
Trainer's collectives differently or whose training data differ in length. Here the other rank is simulated;
pyreft's example on two real ranks (``logging_steps=1`` on rank 0 only) is tests/upstream/test_pyreft_flows.py's."""

import pytest
import torch.distributed as dist
from transformers import TrainingArguments

from pyvene_dist.testing.models import import_pyreft


def as_rank_0_of_2(monkeypatch, **rank_1):
    """A process group of 2 ranks as this process sees it, rank 1's schedule being this one's with ``rank_1``."""
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)

    def all_gather_object(gathered, value, group=None):
        gathered[:] = [value, {**value, **rank_1}]

    monkeypatch.setattr(dist, "all_gather_object", all_gather_object)


def trainer(tmp_path):
    pyreft = import_pyreft()
    trainer = object.__new__(pyreft.ReftTrainer)  # train checks before it reads anything else
    trainer.args = TrainingArguments(output_dir=str(tmp_path), logging_steps=1, report_to=[], use_cpu=True)
    trainer.model, trainer.train_dataset = None, list(range(8))
    return trainer


def test_ranks_logging_at_different_steps_are_refused(patched, monkeypatch, tmp_path):
    """Rank 0 gathered the loss and the FLOs at every step, rank 1 did not: the run hung at the first checkpoint."""
    reft_trainer = trainer(tmp_path)
    as_rank_0_of_2(monkeypatch, logging_steps=500)
    with pytest.raises(ValueError, match=r"ReftTrainer\.train: the ranks' TrainingArguments differ: logging_steps is 1 "
                                         r"on rank 0, 500 on rank 1\. .*pass --logging_steps 1"):
        reft_trainer.train()


def test_ranks_with_different_data_are_refused(patched, monkeypatch, tmp_path):
    """They ran different numbers of steps and failed at the end: gloo's ``Received data size doesn't match``."""
    reft_trainer = trainer(tmp_path)
    as_rank_0_of_2(monkeypatch, **{"len(train_dataset)": 6})
    with pytest.raises(ValueError, match=r"the ranks' training data differ: len\(train_dataset\) is 8 on rank 0, "
                                         r"6 on rank 1\."):
        reft_trainer.train()
