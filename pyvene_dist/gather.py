"""Whole intervention weights for the moments code reads them outside a forward (saving, loading).

Under DDP, DataParallel and FSDP (which pyvene_dist keeps from sharding interventions) the weights are
already whole and ``gathered`` does nothing. Under DeepSpeed ZeRO-3 they are partitioned: ``gathered``
is ``deepspeed.zero.GatheredParameters`` over the interventions' parameters, a collective that every
rank must enter; with ``modify=True`` what rank 0 writes is partitioned again on exit. Nothing stays
gathered after the block.
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
    parameters = partitioned(model.interventions.parameters())
    if not parameters:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(parameters, modifier_rank=0 if modify else None):
        yield
