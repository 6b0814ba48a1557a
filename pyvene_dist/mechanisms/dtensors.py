"""Whether a pyvene model's base model holds DTensor parameters (tensor parallel, FSDP2), found once per model.

``is_tensor_parallel`` walks the parameters at the first forward and keeps the answer in the model's state
(``TensorParallelState``); ``fixes.tensor_parallel`` and the fast path ask it at every forward, and FSDP2's
``fully_shard``, which makes the parameters DTensors later, has it forgotten (``forget_dtensor_parameters``).
"""

from __future__ import annotations

import sys

from torch import nn

from .._registry import MODELS


class TensorParallelState:
    """Whether the model's base model holds DTensor parameters (None: not looked yet)."""

    def __init__(self) -> None:
        self.dtensor_parameters: bool | None = None

    def close(self) -> None:
        self.dtensor_parameters = None


def is_tensor_parallel(intervenable) -> bool:
    """Whether ``intervenable``'s base model holds DTensor parameters, as found at its first forward and kept
    in its state (``TensorParallelState``): the walk over every parameter is not repeated per
    forward. This relies on the base model being parallelized (``from_pretrained(tp_plan=...)``,
    ``parallelize_module``) before its first intervened forward, as the strategies' docs have it; FSDP2's
    ``fully_shard`` of the pyvene model, which may follow a forward, forgets the fact (``fixes.fsdp``)."""
    if "torch.distributed.tensor" not in sys.modules:  # nothing can be a DTensor
        return False
    state = MODELS.of(intervenable, TensorParallelState)
    if state.dtensor_parameters is None:
        state.dtensor_parameters = has_dtensor_parameters(intervenable.model)
    return state.dtensor_parameters


def forget_dtensor_parameters(intervenable) -> None:
    """Look again at the next forward (``fully_shard`` made the parameters DTensors)."""
    state = MODELS.get(intervenable, TensorParallelState)
    if state is not None:
        state.dtensor_parameters = None


def has_dtensor_parameters(model: nn.Module) -> bool:
    if "torch.distributed.tensor" not in sys.modules:  # nothing can be a DTensor
        return False
    from torch.distributed.tensor import DTensor  # imported by whoever made one: never imported here first

    return any(isinstance(parameter, DTensor) for parameter in model.parameters())
