"""``reft_spawned_ranks``: pyreft's trainers take the ranks from the process group where ranks started with
``mp.spawn`` left ``RANK``, ``LOCAL_RANK`` and ``WORLD_SIZE`` unset. Here the group is simulated, and HF's
accelerator building stood in for, so that nothing here joins a real group."""

import os
from types import SimpleNamespace

import pytest
import torch.distributed as dist
from transformers import Trainer

from pyvene_dist.testing.models import import_pyreft

VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")


class BuildsNoAccelerator(Trainer):
    """Stands for ``Trainer``'s ``create_accelerator_and_postprocess``: keeps the rank variables it was called with."""

    def create_accelerator_and_postprocess(self):
        self.seen = {name: os.environ.get(name) for name in VARIABLES}


def as_rank_1_of_2_spawned(monkeypatch):
    for name in VARIABLES:  # unset, and unset again afterwards whatever the fix set
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    monkeypatch.setattr(dist, "all_gather_object", lambda gathered, value, group=None: gathered.__setitem__(
        slice(None), [value, value]))  # both ranks on this host


def spawned_trainer(world_size: int):
    pyreft = import_pyreft()
    trainer_class = type("SpawnedTrainer", (pyreft.ReftTrainer, BuildsNoAccelerator), {})
    trainer = object.__new__(trainer_class)
    # the arguments as they find their devices again: of 2 processes once the variables are set
    trainer.args = SimpleNamespace(device="cpu", world_size=world_size)
    return trainer


def test_ranks_are_taken_from_the_process_group_before_the_accelerator_is_built(patched, monkeypatch, caplog):
    """Every rank took itself for the only process: each saved every checkpoint into the same folder."""
    as_rank_1_of_2_spawned(monkeypatch)
    trainer = spawned_trainer(world_size=2)
    trainer.create_accelerator_and_postprocess()
    assert trainer.seen == {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    assert "rank 1: the process group has 2 ranks but RANK/LOCAL_RANK/WORLD_SIZE/LOCAL_WORLD_SIZE were not set" \
        in caplog.text


def test_arguments_that_keep_one_process_are_refused(patched, monkeypatch):
    as_rank_1_of_2_spawned(monkeypatch)
    with pytest.raises(RuntimeError, match=r"rank 1: the process group has 2 ranks but these TrainingArguments see 1 "
                                           r"process\(es\)"):
        spawned_trainer(world_size=1).create_accelerator_and_postprocess()
