"""pyreft's trainers refuse ranks whose arguments schedule HF Trainer's collectives differently, or whose data differ.

pyreft's ``examples/alpaca/train_multigpu.py`` sets ``logging_steps = 1`` on rank 0 only. HF Trainer gathers across
ranks when it logs (the loss, the FLOs) and saves (the FLOs; pyreft's ``save_model`` then agrees whether to save, as
it may gather), so rank 0's collectives met other ones on rank 1: the run hung at the first checkpoint, or went on
with another collective's data (the issue saw ``RuntimeError: Parent directory .../checkpoint-2 does not exist`` in
2 of 3 runs). pyreft's trainers compare the arguments that schedule those collectives across ranks at ``train`` and
raise on every rank, naming each argument and each rank's value. The ranks' numbers of training examples are
compared with them: ranks that read different data files ran different numbers of steps, and failed at the end
with gloo's ``Received data size doesn't match expected size``.

pyreft is patched when (and if) it is imported.
"""

from __future__ import annotations

import torch.distributed as dist

from ..._records import Fix
from ...mechanisms.trainer_steps import CHECK_TRAIN, step_sites

#: The ``TrainingArguments`` that decide at which steps HF Trainer runs a collective: logging gathers the loss
#: and the FLOs, saving the FLOs (and ``save_model`` may gather), evaluating gathers predictions, each step may
#: gather the label count; the step count and accumulation decide how many of each there are.
SCHEDULE_ARGUMENTS = (
    "logging_strategy", "logging_steps", "logging_first_step", "save_strategy", "save_steps", "eval_strategy",
    "eval_steps", "max_steps", "num_train_epochs", "gradient_accumulation_steps", "average_tokens_across_devices",
)
EXAMPLES = "len(train_dataset)"


def _refuse_schedules_that_differ_between_ranks(trainer) -> None:
    """Raise on every rank if the ranks' arguments schedule HF Trainer's collectives differently, or their
    training data differ in length (a collective, on every rank: each trains)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    schedule = {name: getattr(getattr(trainer.args, name, None), "value", getattr(trainer.args, name, None))
                for name in SCHEDULE_ARGUMENTS}  # an enum's value: "steps", not IntervalStrategy.STEPS
    schedule[EXAMPLES] = _length(trainer.train_dataset)
    schedules = [None] * dist.get_world_size()
    dist.all_gather_object(schedules, schedule)
    if any(other[EXAMPLES] != schedule[EXAMPLES] for other in schedules):
        counts = ", ".join(f"{other[EXAMPLES]} on rank {rank}" for rank, other in enumerate(schedules))
        raise ValueError(
            f"{type(trainer).__name__}.train: the ranks' training data differ: {EXAMPLES} is {counts}. Each rank "
            "trains on its share of one data set, and ranks with different data run different numbers of steps "
            "(the run ends in a collective of another size). Give every rank the same data (the same file, read "
            "the same way).")
    differing = [name for name in SCHEDULE_ARGUMENTS if any(other[name] != schedule[name] for other in schedules)]
    if differing:
        values = "; ".join(f"{name} is " + ", ".join(f"{other[name]!r} on rank {rank}"
                                                     for rank, other in enumerate(schedules))
                           for name in differing)
        raise ValueError(
            f"{type(trainer).__name__}.train: the ranks' TrainingArguments differ: {values}. HF Trainer gathers "
            "across ranks when it logs, saves and evaluates, so ranks on different schedules wait on each other's "
            "collectives (a hang, or another collective's data). Give every rank the same values (pyreft's "
            "examples/alpaca/train_multigpu.py sets logging_steps=1 on rank 0 only: pass --logging_steps 1).")


def _length(dataset) -> int | None:
    try:
        return len(dataset)
    except TypeError:  # an IterableDataset, or none
        return None


FIX = Fix(
    __name__,
    sites=step_sites(CHECK_TRAIN, __name__, _refuse_schedules_that_differ_between_ranks),
    upstream=("pyreft",),
    relies_on=("transformers.trainer:Trainer.train",),  # the collectives these arguments schedule in it
)
