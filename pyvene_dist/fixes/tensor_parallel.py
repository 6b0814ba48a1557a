"""Interventions on a tensor-parallel model see the whole representation they were defined on.

Tensor parallel (``from_pretrained(..., tp_plan="auto")``, or torch's ``parallelize_module`` with
``ColwiseParallel``/``RowwiseParallel``) splits each layer's projections over the ranks of a TP group.
What a pyvene hook meets then depends on where it sits:

- ``block_*``, ``attention_input``/``attention_output``, ``mlp_input``/``mlp_output``: the residual
  stream, whole and identical on every rank (the row-wise ``o_proj``/``down_proj`` all-reduce their
  partial sums). But the attention and MLP outputs come out of DTensor's ``to_local``, a view made
  inside a custom autograd function, and pyvene writes interventions into them in place:
  ``RuntimeError: A view was created in no_grad mode and is being modified inplace with grad mode
  enabled``. The fix hands pyvene a copy and returns it as the module's output (no communication).
- ``query_output``/``key_output``/``value_output`` and their ``head_*`` forms (outputs of column-wise
  ``q/k/v_proj``), ``attention_value_output``/``head_attention_value_output`` (the input of row-wise
  ``o_proj``) and ``mlp_activation`` (column-wise ``gate_proj``): each rank holds a slice of the last
  dimension (its heads, its columns), as a plain tensor (transformers, torch's ``use_local_output``)
  or a ``DTensor``. pyvene's gather and scatter assume the whole width and fail or index the wrong
  units (``head_*`` numbers heads of the whole model). The fix all-gathers the slices into the whole
  tensor, lets pyvene intervene on it, and hands the module back this rank's slice.

Why gather instead of intervening on the local slice: a LoReFT rotation mixes every dimension of the
representation, and head and neuron indices name the whole model's; only the whole is exact for every
intervention. The gather is autograd-aware and keeps the intervention's gradients whole on every rank
with no extra reduction: forward all-gathers the slices (``Shard(-1)`` to ``Replicate``), and going back
to the slice is a local split whose backward all-gathers the slices' gradients, so every rank's
intervention sees the whole upstream gradient and computes the same parameter gradient as one process.
The cost is one all-gather of the hooked activation forward and one of its gradient backward, per
intervened hook; the residual-stream components cost a copy.

Interventions stay plain, replicated tensors; their gradients are left to the data-parallel wrapper
(DDP, FSDP2 over the ``dp`` mesh dimensions), never reduced over the TP group.

Wraps ``IntervenableModel._wait_for_forward_with_parallel_intervention`` and
``..._serial_intervention``, where pyvene registers its hooks: for a model with DTensor parameters, the
hook registrars it uses (``intervention_hooks``) are swapped, for that call only, for ones that put
the TP-aware hook around pyvene's. Whether the model has DTensor parameters is found once, at its first
forward, and kept in its state (``_is_tensor_parallel``). Run on the CPU (gloo).
"""

from __future__ import annotations

from typing import Callable

import torch
from pyvene.models.intervenable_base import IntervenableModel
from pyvene.models.modeling_utils import get_dimension_by_component
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard  # imported with fixes.fsdp's fully_shard

from .._records import Fix, Site
from ..mechanisms.dtensors import TensorParallelState, is_tensor_parallel



def _wrap_wait_for_forward(wrapped, instance, args, kwargs):
    if not is_tensor_parallel(instance):
        return wrapped(*args, **kwargs)
    registrars = instance.intervention_hooks
    instance.intervention_hooks = {
        key: _TensorParallelRegistrar(register, _full_width(instance, key, register), instance.model)
        if callable(register)
        else register
        for key, register in registrars.items()
    }
    try:
        return wrapped(*args, **kwargs)
    finally:
        instance.intervention_hooks = registrars


class _TensorParallelRegistrar:
    """Stands for ``module.register_forward_hook`` (or ``..._pre_hook``): registers the TP-aware hook."""

    def __init__(self, register: Callable, width: int | None, model: nn.Module):
        self.register, self.width, self.model = register, width, model
        self.module = register.__self__
        self.is_input = register.__name__ == "register_forward_pre_hook"

    def __call__(self, hook, **kwargs):
        on = _on_input if self.is_input else _on_output
        return self.register(on(hook, self.module, self.width, self.model), **kwargs)


def _full_width(intervenable, key: str, register: Callable) -> int | None:
    """The last dimension of the whole tensor the hook sees (None: not known, then never gathered)."""
    module = getattr(register, "__self__", None)
    if isinstance(module, nn.Linear):
        return module.in_features if register.__name__ == "register_forward_pre_hook" else module.out_features
    try:
        return int(get_dimension_by_component(
            intervenable.model_type, intervenable.model_config, intervenable.representations[key].component
        ))
    except (AssertionError, KeyError, ValueError, TypeError, AttributeError):
        return None


def _on_output(hook, module: nn.Module, width: int | None, model: nn.Module):
    def tensor_parallel_hook(mod, args, kwargs, output):
        first = output[0] if isinstance(output, tuple) else output
        if not isinstance(first, torch.Tensor):
            return hook(mod, args, kwargs, output)
        whole, back = to_whole(first, module, width, model)
        replaced = (whole,) + tuple(output[1:]) if isinstance(output, tuple) else whole
        result = hook(mod, args, kwargs, replaced)
        if result is not None:
            replaced = result
        first = replaced[0] if isinstance(replaced, tuple) else replaced
        return (back(first),) + tuple(replaced[1:]) if isinstance(replaced, tuple) else back(first)

    return tensor_parallel_hook


def _on_input(hook, module: nn.Module, width: int | None, model: nn.Module):
    def tensor_parallel_pre_hook(mod, args, kwargs):
        if args:
            whole, back = to_whole(args[0], module, width, model) if isinstance(args[0], torch.Tensor) else (None, None)
            if whole is None:
                return hook(mod, args, kwargs)
            args = (whole,) + tuple(args[1:])
        elif kwargs:
            name = next(iter(kwargs))
            if not isinstance(kwargs[name], torch.Tensor):
                return hook(mod, args, kwargs)
            whole, back = to_whole(kwargs[name], module, width, model)
            kwargs = {**kwargs, name: whole}
        else:
            return hook(mod, args, kwargs)
        result = hook(mod, args, kwargs)
        if result is not None:
            args, kwargs = result
        if args:
            return (back(args[0]),) + tuple(args[1:]), kwargs
        name = next(iter(kwargs))
        return args, {**kwargs, name: back(kwargs[name])}

    return tensor_parallel_pre_hook


def to_whole(tensor: torch.Tensor, module: nn.Module, width: int | None, model: nn.Module):
    """``tensor`` whole and plain, safe to write into, and the function that turns it back into what the
    module expects (this rank's slice, the DTensor layout it came in, or the whole tensor itself)."""
    if isinstance(tensor, DTensor):
        mesh, placements = tensor.device_mesh, tensor.placements
        whole = tensor.redistribute(mesh, [Replicate()] * mesh.ndim).to_local().clone()

        def back_to_layout(changed: torch.Tensor) -> torch.Tensor:
            return DTensor.from_local(changed, mesh, [Replicate()] * mesh.ndim, run_check=False).redistribute(
                mesh, placements
            )

        return whole, back_to_layout
    if width is None or tensor.shape[-1] == width:
        return tensor.clone(), _same
    if tensor.shape[-1] > width:
        raise ValueError(
            f"{type(module).__name__} gave a tensor of width {tensor.shape[-1]} to an intervention defined on "
            f"width {width}"
        )
    mesh = tensor_parallel_mesh(module, model)
    shape = (*tensor.shape[:-1], width)
    stride = torch.empty(shape, device="meta").stride()
    sliced = DTensor.from_local(tensor, mesh, [Shard(tensor.dim() - 1)], run_check=False, shape=shape, stride=stride)
    whole = sliced.redistribute(mesh, [Replicate()]).to_local().clone()

    def back_to_slice(changed: torch.Tensor) -> torch.Tensor:
        replicated = DTensor.from_local(changed, mesh, [Replicate()], run_check=False)
        return replicated.redistribute(mesh, [Shard(changed.dim() - 1)]).to_local()

    return whole, back_to_slice


def _same(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def tensor_parallel_mesh(module: nn.Module, model: nn.Module):
    """The one-dimensional TP mesh ``module``'s tensors are sliced over: that of its own weight, else of the
    first tensor-parallel linear layer of ``model`` (a mesh dimension named ``tp``, or a 1-D mesh)."""
    for owner in (module, model):
        for inner in owner.modules():
            weight = getattr(inner, "weight", None)
            if isinstance(inner, nn.Linear) and isinstance(weight, DTensor):
                mesh, names = weight.device_mesh, weight.device_mesh.mesh_dim_names or ()
                if "tp" in names:
                    return mesh["tp"] if mesh.ndim > 1 else mesh
                if mesh.ndim == 1 and isinstance(weight.placements[0], Shard):
                    return mesh
    raise ValueError(
        f"{type(module).__name__} holds a slice of its tensor but no tensor-parallel mesh was found: "
        "expected a linear layer with DTensor weights on a 1-D mesh or a mesh with a dimension named 'tp'"
    )


FIX = Fix(
    __name__,
    sites=(
        Site((IntervenableModel, "_wait_for_forward_with_parallel_intervention"), _wrap_wait_for_forward),
        Site((IntervenableModel, "_wait_for_forward_with_serial_intervention"), _wrap_wait_for_forward),
    ),
    state=TensorParallelState,
)
