"""Whole intervention weights for the moments code reads or writes them outside a forward (save, load).

Under DDP, DataParallel and FSDP (which pyvene_dist keeps from sharding interventions) the weights are
already whole. Under DeepSpeed ZeRO-3 they are partitioned: ``gathered`` is
``deepspeed.zero.GatheredParameters`` over the interventions' parameters, a collective that every rank
must enter; nothing stays gathered after the block. With ``modify=True`` what is written inside is
kept: partitioned again on exit (from rank 0, which read the same file as every rank), and copied into
the optimizer's fp32 master weights, which ZeRO (every stage) keeps apart from the model's and would
otherwise write back over the loaded values at the next step.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from torch import nn


def is_main_process() -> bool:
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def partitioned(parameters) -> list[nn.Parameter]:
    """The parameters DeepSpeed ZeRO-3 has partitioned (they carry ``ds_id``)."""
    return [p for p in parameters if hasattr(p, "ds_id")]


@contextlib.contextmanager
def gathered(model: nn.Module, *, modify: bool = False) -> Iterator[None]:
    parameters = list(model.interventions.parameters())
    split = partitioned(parameters)
    if not split:
        yield
        if modify:
            _update_optimizer_masters(parameters)
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(split, modifier_rank=0 if modify else None):
        yield
        if modify:
            _update_optimizer_masters(parameters)


def _update_optimizer_masters(parameters: list[nn.Parameter]) -> None:
    managed = [p for p in parameters if p.requires_grad and (hasattr(p, "_hp_mapping") or hasattr(p, "_z3_optimizer"))]
    if not managed:
        return
    from deepspeed.utils import safe_set_full_fp32_param

    for parameter in managed:
        safe_set_full_fp32_param(parameter, parameter.data.detach().float().clone())
