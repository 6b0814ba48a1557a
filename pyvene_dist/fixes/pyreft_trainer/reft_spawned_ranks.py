"""pyreft's trainers take the ranks from the process group where the script started its ranks itself.

A script that starts its ranks itself (``mp.spawn``, as an early version of pyreft's multi-GPU example did) and
joins the process group with ``init_process_group(rank=..., world_size=...)`` leaves ``RANK``, ``LOCAL_RANK`` and
``WORLD_SIZE`` unset. HF's ``TrainingArguments`` read those (through accelerate), so every rank took itself for the
only process: each saved every checkpoint into the same folder (``RuntimeError: Parent directory
OUT/checkpoint-2 does not exist`` in 3 of 4 runs) and trained on the whole data set. pyreft's trainers take the
ranks from the process group where the variables are missing (the local rank from the ranks' host names), set them,
and have the arguments find their devices again, with one warning, before ``Trainer.__init__`` builds its
accelerator (``ReftTrainer.create_accelerator_and_postprocess``, added). A plain HF Trainer still needs them set.

pyreft is patched when (and if) it is imported.
"""

from __future__ import annotations

import logging
import os
import socket

import torch.distributed as dist

from ..._optional import pyreft_trainers
from ..._records import Fix, Site
from ...mechanisms.trainer_steps import PYREFT

#: What torchrun sets in each rank's environment, and HF's TrainingArguments (through accelerate) read.
RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")


def _create_accelerator_for_each_rank(self, *args, **kwargs):
    """``Trainer.create_accelerator_and_postprocess``, once the ranks are taken from the process group."""
    _take_ranks_from_the_process_group(self.args)
    return super(pyreft_trainers.ReftTrainer, self).create_accelerator_and_postprocess(*args, **kwargs)


def _take_ranks_from_the_process_group(arguments) -> None:
    """Where a process group of several ranks exists but ``RANK``/``LOCAL_RANK``/``WORLD_SIZE`` are unset (ranks
    started with ``mp.spawn``), set them from the group and have ``arguments`` find their devices again: HF's
    arguments read the variables, and without them every rank is process 0 of 1. A collective (the ranks'
    host names, for the local rank), on every rank: each makes its trainer."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1 \
            or all(name in os.environ for name in RANK_VARIABLES[:3]):
        return
    hosts = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, socket.gethostname())
    rank = dist.get_rank()
    found = {"RANK": rank, "LOCAL_RANK": hosts[:rank].count(hosts[rank]), "WORLD_SIZE": len(hosts),
             "LOCAL_WORLD_SIZE": hosts.count(hosts[rank])}
    missing = [name for name in RANK_VARIABLES if name not in os.environ]
    for name in missing:
        os.environ[name] = str(found[name])
    # a cached_property, found as one process: found again now, before the accelerator is built (finding them
    # resets accelerate's state, the Accelerator's included)
    arguments.__dict__.pop("_setup_devices", None)
    if arguments.device is not None and arguments.world_size != len(hosts):  # a release that caches it elsewhere
        raise RuntimeError(
            f"rank {rank}: the process group has {len(hosts)} ranks but these TrainingArguments see "
            f"{arguments.world_size} process(es): {'/'.join(missing)} were not set when they were made (ranks "
            "started with mp.spawn?), and every rank would act as the main process. Set RANK, LOCAL_RANK and "
            "WORLD_SIZE in each rank's environment before making the TrainingArguments, or start the ranks with "
            "torchrun")
    logging.getLogger("pyvene_dist").warning(
        "rank %d: the process group has %d ranks but %s %s not set (ranks started with mp.spawn?); HF Trainer read "
        "this process as the only one, so every rank saved as the main process. Set them from the group: %s",
        rank, len(hosts), "/".join(missing), "was" if len(missing) == 1 else "were",
        ", ".join(f"{name}={found[name]}" for name in missing))


FIX = Fix(
    __name__,
    sites=(Site(f"{PYREFT}:ReftTrainer.create_accelerator_and_postprocess", _create_accelerator_for_each_rank,
                kind="add"),),
    upstream=("pyreft",),
    # called by Trainer.__init__ before anything reads the arguments' devices
    relies_on=("transformers.trainer:Trainer.create_accelerator_and_postprocess",),
)
