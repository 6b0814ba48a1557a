"""What a strategy needs of the machine: given a world size and the GPU count, None when it can run, else why not."""

from __future__ import annotations

import importlib.util
from importlib.metadata import version
from typing import Callable

from packaging.version import Version

from .models import VOCAB_SIZE

#: Given a world size and the machine's GPU count: None when the machine can run it, else why not.
Requirement = Callable[[int, int], "str | None"]


def any_machine(world_size: int, gpus: int) -> str | None:
    return None  # world sizes are checked against the machine by the caller (pyvene-dist check's validate)


def gpu_per_rank(world_size: int, gpus: int) -> str | None:
    return None if gpus >= world_size else f"needs {world_size} GPUs, found {gpus}"


def two_gpus(world_size: int, gpus: int) -> str | None:
    return None if gpus >= 2 else f"needs 2 GPUs, found {gpus}"


def two_dimensional(world_size: int, gpus: int) -> str | None:
    if world_size >= 4 and world_size % 2 == 0:
        return None
    return f"needs a 2-D mesh (data x 2): an even world size of 4 or more, got {world_size}"


def installed(package: str, then: Requirement = any_machine) -> Requirement:
    def needs(world_size: int, gpus: int) -> str | None:
        return f"{package} not installed" if importlib.util.find_spec(package) is None else then(world_size, gpus)

    return needs


#: The first transformers whose ``from_pretrained(tp_plan=...)`` shards a layer whose gathered output the world
#: size does not divide (5.17-5.20 raised "The output size of `lm_head` (97) must be divisible by the tensor
#: parallel size (2) when gathering a colwise output").
UNEVEN_TP_PLAN = "5.21"


def tp_plan_splits_the_vocabulary(world_size: int, gpus: int) -> str | None:
    """``tp``'s model (``from_pretrained(tp_plan="auto")`` of the tiny model, ``models.VOCAB_SIZE`` tokens) on a
    transformers older than ``UNEVEN_TP_PLAN``: its ``lm_head`` must split evenly over the ranks."""
    found = version("transformers")
    if VOCAB_SIZE % world_size == 0 or Version(found) >= Version(UNEVEN_TP_PLAN):
        return None
    return (f"transformers {found}'s tp_plan needs the vocabulary ({VOCAB_SIZE}) divisible by the world size "
            f"({world_size}); {UNEVEN_TP_PLAN} and newer shard it unevenly")
