"""Whole intervention weights (and a trainable head's) for the moments code reads or writes them outside a
forward (save, load).

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

A trainable base weight saved beside them (``lm_head``, a classifier's ``score``: ``include_model``) is
held whole the same way, passed as ``base``: ZeRO-3 gathers it with the interventions; FSDP2 and tensor
parallelism keep it as a ``DTensor`` shard, read whole by ``whole`` (an all-gather, on every rank) and
written by ``placed_like`` (each rank cuts its own shard from the whole value it read: no collective).

Otherwise (interventions over the threshold, a threshold of 0, before the first forward, a load, or a
sharded head) a rank that enters the gather alone would wait forever for the others. Before gathering,
each rank counts itself in on the process group's store; one that finds the others missing after
``ARRIVAL_TIMEOUT_S`` raises an error saying to call it on every rank (or which threshold keeps them
whole), instead of hanging the job.
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from ._optional import DEEPSPEED_INSTALL, OnFirstUse

# Optional (the deepspeed extra), and imported only where it partitioned the parameters (never by patch()).
deepspeed = OnFirstUse("deepspeed", DEEPSPEED_INSTALL)
zero_partitions = OnFirstUse("deepspeed.runtime.zero.partition_parameters", DEEPSPEED_INSTALL)
zero_utils = OnFirstUse("deepspeed.utils", DEEPSPEED_INSTALL)

#: Seconds a rank waits for the others at a gather of split weights before refusing.
ARRIVAL_TIMEOUT_S = 30.0


def is_main_process() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def partitioned(parameters) -> list[nn.Parameter]:
    """The parameters DeepSpeed ZeRO-3 has partitioned (they carry ``ds_id``)."""
    return [p for p in parameters if hasattr(p, "ds_id")]


def whole_here(parameter: nn.Parameter) -> bool:
    """Whether this rank holds all of ``parameter`` now: not partitioned by ZeRO-3, or gathered (a
    partitioned parameter's data is empty here until ZeRO gathers it)."""
    return parameter.numel() == getattr(parameter, "ds_numel", parameter.numel())


def held_whole(parameter: nn.Parameter) -> bool:
    """Whether this partitioned parameter is whole on every rank alike, with nothing to gather: ZeRO-3 keeps
    it whole from step to step (persistent, gathered after every step), or a ``GatheredParameters`` block
    around this one holds it (DeepSpeed refuses nested gathers of the same parameter)."""
    depth = getattr(parameter, zero_partitions.DS_Z3_GATHERED_PARAM_CONTEXT_DEPTH_ATTR, 0)
    kept = getattr(parameter, "ds_persist", False) or depth > 0
    return bool(kept) and whole_here(parameter)


def is_sharded(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a ``DTensor`` (FSDP2, tensor parallel): this rank holds its shard only."""
    return isinstance(tensor, DTensor)


def whole(parameter: torch.Tensor) -> torch.Tensor:
    """``parameter``'s whole value: a ``DTensor``'s shards all-gathered (a collective every rank enters);
    a ZeRO-3 partition must be inside ``gathered`` here."""
    return parameter.full_tensor() if is_sharded(parameter) else parameter


def placed_like(value: torch.Tensor, parameter: torch.Tensor) -> torch.Tensor:
    """``value``, a whole weight that every rank read alike, as ``parameter`` holds it: for a ``DTensor``,
    a ``DTensor`` of the same placements whose shard this rank cuts from ``value`` itself (no collective),
    so that ``load_state_dict`` copies it into the shard; anything else as it is."""
    if not is_sharded(parameter):
        return value
    return distribute_tensor(value.to(parameter.device), parameter.device_mesh, parameter.placements,
                             src_data_rank=None)


@contextlib.contextmanager
def gathered(model: nn.Module, *, modify: bool = False,
             base: dict[str, nn.Parameter] | None = None) -> Iterator[None]:
    """The interventions whole inside the block, and ``base``'s parameters (named as in the base model's
    state dict) too where ZeRO-3 partitions them; ``DTensor``s among them are read with ``whole``."""
    named = {f"interventions.{name}": parameter for name, parameter in model.interventions.named_parameters()}
    named.update(base or {})
    parameters = list(named.values())
    split = partitioned(parameters)
    # A read of a DTensor is an all-gather: every rank must come. A write is local (placed_like).
    sharded = [] if modify else [name for name, parameter in named.items() if is_sharded(parameter)]
    gather = split if modify or not all(held_whole(p) for p in split) else []
    if gather or sharded:
        largest = None if modify or sharded else max(p.ds_numel for p in gather)
        gathering = {id(p) for p in gather}
        split_names = [name for name, p in named.items() if id(p) in gathering or name in sharded]
        shown = [name for name in split_names if not name.startswith("interventions.")]
        if len(shown) < len(split_names):
            shown.insert(0, "the interventions")
        _wait_for_every_rank(shown, largest)
    if not gather:
        yield
        if modify:
            _update_optimizer_masters(parameters)
        return
    with deepspeed.zero.GatheredParameters(gather, modifier_rank=0 if modify else None):
        yield
        if modify:
            _update_optimizer_masters(parameters)


def _wait_for_every_rank(names: list[str], largest: int | None = None) -> None:
    """Return once every rank has reached its gather of the same number; raise if one stays away.
    ``names``: what is split, for the error; ``largest``: for a read of ZeRO-3 partitions alone, the
    largest one's elements (the error's way out).

    The count lives in the default process group's store (each rank numbers its own gathers there), so
    ranks that save and load in step agree on each key without any collective.
    """

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return

    store, rank, world = dist.distributed_c10d._get_default_store(), dist.get_rank(), dist.get_world_size()
    number = store.add(f"pyvene_dist/gather/rank{rank}", 1)
    key = f"pyvene_dist/gather/{number}"
    arrived, deadline = store.add(key, 1), time.monotonic() + ARRIVAL_TIMEOUT_S
    while arrived < world:
        if time.monotonic() > deadline:
            shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
            raise RuntimeError(
                f"rank {rank} waited {ARRIVAL_TIMEOUT_S:.0f} s for the other ranks to gather the weights split "
                f"over them ({shown}), and {world - arrived} of {world} never came: call "
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
    for parameter in managed:
        zero_utils.safe_set_full_fp32_param(parameter, parameter.data.detach().float().clone())
