"""Whole intervention weights for the moments code reads or writes them outside a forward (save, load).

Under DDP, DataParallel and FSDP (which pyvene_dist keeps from sharding interventions) the weights are
already whole. Under DeepSpeed ZeRO-3 they are partitioned: ``gathered`` is
``deepspeed.zero.GatheredParameters`` over the interventions' parameters, a collective that every rank
must enter; nothing stays gathered after the block. With ``modify=True`` what is written inside is
kept: partitioned again on exit (from rank 0, which read the same file as every rank), and copied into
the optimizer's fp32 master weights, which ZeRO (every stage) keeps apart from the model's and would
otherwise write back over the loaded values at the next step.

A read needs no gather when this rank already holds every intervention whole: ZeRO-3 keeps the
parameters of at most ``stage3_param_persistence_threshold`` elements ("persistent": DeepSpeed's default
100,000, HF's ``"auto"`` 10 x hidden size) gathered on every rank from their first forward on, and
gathers them again after each step. Saving from rank 0 alone (``if rank == 0: save_intervention(...)``,
the pattern of pyreft's multi-GPU example) then works, with no collective.

Otherwise (interventions over the threshold, a threshold of 0, before the first forward, or a load) a
rank that enters the gather alone would wait forever for the others. Before gathering, each rank counts
itself in on the process group's store; one that finds the others missing after ``ARRIVAL_TIMEOUT_S``
raises an error saying to call it on every rank (or which threshold keeps them whole), instead of
hanging the job.
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterator

from torch import nn


#: Seconds a rank waits for the others at a gather of partitioned interventions before refusing.
ARRIVAL_TIMEOUT_S = 30.0


def is_main_process() -> bool:
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def partitioned(parameters) -> list[nn.Parameter]:
    """The parameters DeepSpeed ZeRO-3 has partitioned (they carry ``ds_id``)."""
    return [p for p in parameters if hasattr(p, "ds_id")]


def whole_here(parameter: nn.Parameter) -> bool:
    """Whether this rank holds all of ``parameter`` now: not partitioned by ZeRO-3, or gathered (a
    partitioned parameter's data is empty here until ZeRO gathers it)."""
    return parameter.numel() == getattr(parameter, "ds_numel", parameter.numel())


def held_whole(parameter: nn.Parameter) -> bool:
    """Whether ZeRO-3 keeps this partitioned parameter whole on this rank from step to step: persistent
    (gathered after every step) and gathered now."""
    return bool(getattr(parameter, "ds_persist", False)) and whole_here(parameter)


@contextlib.contextmanager
def gathered(model: nn.Module, *, modify: bool = False) -> Iterator[None]:
    parameters = list(model.interventions.parameters())
    split = partitioned(parameters)
    if not split:
        yield
        if modify:
            _update_optimizer_masters(parameters)
        return
    if not modify and all(held_whole(p) for p in split):
        yield  # ZeRO keeps them whole here (persistent and gathered): nothing to collect
        return
    import deepspeed

    _wait_for_every_rank(None if modify else max(p.ds_numel for p in split))
    with deepspeed.zero.GatheredParameters(split, modifier_rank=0 if modify else None):
        yield
        if modify:
            _update_optimizer_masters(parameters)


def _wait_for_every_rank(largest: int | None = None) -> None:
    """Return once every rank has reached its gather of the same number; raise if one stays away.
    ``largest``: for a read, the largest intervention parameter's elements (the error's way out).

    The count lives in the default process group's store (each rank numbers its own gathers there), so
    ranks that save and load in step agree on each key without any collective.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    from torch.distributed.distributed_c10d import _get_default_store

    store, rank, world = _get_default_store(), dist.get_rank(), dist.get_world_size()
    number = store.add(f"pyvene_dist/gather/rank{rank}", 1)
    key = f"pyvene_dist/gather/{number}"
    arrived, deadline = store.add(key, 1), time.monotonic() + ARRIVAL_TIMEOUT_S
    while arrived < world:
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"rank {rank} waited {ARRIVAL_TIMEOUT_S:.0f} s for the other ranks to gather the interventions "
                f"(ZeRO-3 partitions them), and {world - arrived} of {world} never came: call "
                "save_intervention / load_intervention (and ReftModel.save) on every rank, not only on rank 0; "
                "rank 0 alone writes the files"
                + ("" if largest is None else
                   f"; or, to save from rank 0 alone after training, let ZeRO-3 keep them whole on every rank: "
                   f"\"stage3_param_persistence_threshold\" of at least {largest} in the DeepSpeed config "
                   "(they are then gathered from the first forward on)")
            )
        time.sleep(0.01)
        arrived = store.add(key, 0)


def _update_optimizer_masters(parameters: list[nn.Parameter]) -> None:
    managed = [p for p in parameters if p.requires_grad and (hasattr(p, "_hp_mapping") or hasattr(p, "_z3_optimizer"))]
    if not managed:
        return
    from deepspeed.utils import safe_set_full_fp32_param

    for parameter in managed:
        safe_set_full_fp32_param(parameter, parameter.data.detach().float().clone())
