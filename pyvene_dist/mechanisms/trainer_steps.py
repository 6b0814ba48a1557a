"""``ReftTrainer.__init__`` and ``ReftTrainer.train``, which pyreft's trainers do not define and several fixes of
the ``pyreft_trainer`` group act in: each fix that needs one adds it (the same function, added once) and adds its
step beside it, an attribute of ``ReftTrainer`` named with a stage's prefix and the fix's name. The added method runs HF Trainer's
and, around it, the steps it finds on the trainer's class, in name order within each stage. A fix left out of
``patch()`` adds no step, and ``unpatch()`` deletes the steps with the methods.

Where a step could act elsewhere it does: ``reft_spawned_ranks`` adds ``create_accelerator_and_postprocess``,
``reft_compute_loss`` wraps ``compute_loss``.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

from .._optional import pyreft_trainers
from .._records import Site

PYREFT = "pyreft.reft_trainer"
#: ``step(kwargs)``: may change the keywords ``Trainer.__init__`` is given (``reft_tokenizer_keyword``).
BEFORE_INIT = "_pyvene_dist_before_init_"
#: ``step()``, once ``Trainer.__init__`` has run (``reft_compute_loss``).
AFTER_INIT = "_pyvene_dist_after_init_"
#: ``step()``, before ``Trainer.train``: checks that raise before a step is taken (``reft_rank_schedules``,
#: ``reft_zero3_dtype``); on every rank alike, so that a collective among them meets its peers.
CHECK_TRAIN = "_pyvene_dist_check_train_"
#: ``step()`` returning a context manager entered around ``Trainer.train``, after the checks
#: (``reft_wrapped_checkpointing``).
AROUND_TRAIN = "_pyvene_dist_around_train_"


def step_name(stage: str, fix_module: str) -> str:
    """The attribute a fix adds to ``ReftTrainer`` for its step at ``stage``: ``stage`` and the fix's name."""
    return stage + fix_module.rsplit(".", 1)[-1]


def step_sites(stage: str, fix_module: str, step: Callable) -> tuple[Site, Site]:
    """A fix's two sites for its step at ``stage``: the method the stage belongs to (``ReftTrainer.__init__`` or
    ``.train``, added by whichever fix comes first), and ``step``, a function of the fix's module, beside it."""
    method, added = ("__init__", reft_trainer_init) if stage in (BEFORE_INIT, AFTER_INIT) else ("train", reft_trainer_train)
    return (Site(f"{PYREFT}:ReftTrainer.{method}", added, kind="add"),
            Site(f"{PYREFT}:ReftTrainer.{step_name(stage, fix_module)}", step, kind="add"))


def steps(trainer: Any, stage: str) -> list[Callable]:
    """The steps of ``stage`` that the trainer's class has, bound to ``trainer``, in name order."""
    return [getattr(trainer, name) for name in sorted(dir(type(trainer))) if name.startswith(stage)]


def reft_trainer_init(self, *args, **kwargs):
    """``Trainer.__init__``, between the steps of the fixes applied (``BEFORE_INIT``, ``AFTER_INIT``)."""
    for step in steps(self, BEFORE_INIT):
        step(kwargs)
    super(pyreft_trainers.ReftTrainer, self).__init__(*args, **kwargs)
    for step in steps(self, AFTER_INIT):
        step()


def reft_trainer_train(self, *args, **kwargs):
    """``Trainer.train``, after the checks of the fixes applied (``CHECK_TRAIN``) and inside their contexts
    (``AROUND_TRAIN``)."""
    for check in steps(self, CHECK_TRAIN):
        check()
    with contextlib.ExitStack() as contexts:
        for around in steps(self, AROUND_TRAIN):
            contexts.enter_context(around())
        return super(pyreft_trainers.ReftTrainer, self).train(*args, **kwargs)
