"""An intervention computes in its own dtype where the hidden states it meets hold another one.

Used by ``fixes.fsdp`` (FSDP2's mixed-precision policy computes the sharded base in ``param_dtype`` and leaves
the interventions, which it does not shard, in theirs: accelerate's FSDP2 with ``--bf16`` casts them to float32
master weights) and by ``fixes.checkpoints`` (such float32 interventions reloaded onto a bf16 base to serve).
pyreft's interventions call their layers on the hidden states as given, so a float32 ``Linear`` met bf16 states:
``RuntimeError: mat1 and mat2 must have the same dtype, but got BFloat16 and Float``.

``compute_in_own_dtype(model, hidden_dtype)``: each intervention of ``model`` whose floating-point
parameters hold one dtype other than ``hidden_dtype`` gets two forward hooks: its floating-point inputs are cast to
its dtype (the one its weights hold at each call), its output back to ``hidden_dtype``. Its parameters, and so its gradients and optimizer state, are
untouched. An intervention whose parameters mix dtypes (pyreft's LoReFT built with ``dtype=torch.bfloat16`` keeps
its rotation in float32 and casts for itself) is left alone. The hooks' handles are the intervention's own runtime
state (``CastState``, kept by the registry for the intervention, not for a model: ``ReftModel.load`` hands its
interventions to a new ``ReftModel``), which removes them when it closes: when the intervention is collected, and
at ``unpatch()``.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from .._registry import MODELS


@dataclasses.dataclass(eq=False)
class CastState:
    """An intervention's two cast hooks, while it has them."""

    handles: tuple = ()

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = ()


def compute_in_own_dtype(model: nn.Module, hidden_dtype: torch.dtype) -> list[nn.Module]:
    """Hook every intervention of ``model`` that needs it (see the module docstring); the ones hooked now."""
    hooked = []
    for intervention in {id(m): m for m in model.interventions.values()}.values():
        if floating_dtype(intervention) in (None, hidden_dtype):
            continue
        state = MODELS.of(intervention, CastState)
        if state.handles:  # hooked already (by the other fix, or an earlier call)
            continue
        state.handles = (intervention.register_forward_pre_hook(_InputCast(), with_kwargs=True),
                         intervention.register_forward_hook(_OutputCast(hidden_dtype)))
        hooked.append(intervention)
    return hooked


def floating_dtype(module: nn.Module) -> torch.dtype | None:
    """The one dtype of ``module``'s floating-point parameters; None where they mix dtypes, or there are none."""
    dtypes = {p.dtype for p in module.parameters() if p.is_floating_point()}
    return next(iter(dtypes)) if len(dtypes) == 1 else None


class _InputCast:
    """To the one dtype the intervention's weights hold at the call (read then: DeepSpeed, say, may cast them
    later to the hidden states' dtype, and then nothing is cast)."""

    def __call__(self, module, args, kwargs):
        dtype = floating_dtype(module)
        return None if dtype is None else (cast(args, dtype), cast(kwargs, dtype))


class _OutputCast:
    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def __call__(self, module, args, output):
        return cast(output, self.dtype)


def cast(value, dtype: torch.dtype):
    """``value`` with every floating-point tensor in it (inside tuples, lists and dicts too) cast to ``dtype``."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() and value.dtype != dtype else value
    if isinstance(value, (tuple, list)):
        items = [cast(item, dtype) for item in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, dict):
        return {key: cast(item, dtype) for key, item in value.items()}
    return value
