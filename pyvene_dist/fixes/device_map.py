"""Model parallel with ``device_map``: each intervention lives on the device of the module it hooks.

What users see today with a model split by ``device_map`` (``from_pretrained(device_map=...)``,
``accelerate.dispatch_model``):

- ``pyreft.get_reft_model`` calls ``set_device(model.device)``, which puts every intervention on the
  first device and moves the model there: on a two-GPU split ``RuntimeError: Expected all tensors to be
  on the same device, ... cuda:0 and cuda:1``; with CPU or disk offload ``RuntimeError: You can't move
  a model that has some modules offloaded to cpu or disk``.
- an interchange intervention on one device reading a source activation collected on another fails
  the same way.

The fix: ``BaseModel.set_device`` on a dispatched base model (one with ``hf_device_map``) places each
intervention on the execution device of the module it hooks (accelerate's ``AlignDevicesHook``, on
that module or its nearest ancestor; else the module's own weights) and leaves the model where
accelerate put it; an intervention whose device cannot be told is an error naming it. ``BaseModel.to``
on a dispatched base model goes through accelerate's own ``to`` (its warning, or its refusal for
offloaded models) instead of recursing past it, and leaves the interventions where they are. Source
activations move to the device of the representation they intervene on. The wrapper reports the base
model's ``hf_device_map``, ``is_parallelizable`` and ``model_parallel``, so HF Trainer sees a model
parallel model and does not wrap it in ``nn.DataParallel`` (``fixes.wrapper_attributes``).

Run on the CPU with CPU and disk offload, and on 2 x H200 split by layers.
"""

from __future__ import annotations

import torch
from pyvene.models.intervenable_base import BaseModel, IntervenableModel
from torch import nn

from .._records import Fix, Site


def dispatched(model: nn.Module) -> bool:
    return getattr(model, "hf_device_map", None) is not None


def placements(intervenable) -> dict[str, torch.device]:
    """Where each intervention must live: the execution device of the module it hooks."""
    names = {id(module): name for name, module in intervenable.model.named_modules(remove_duplicate=False)}
    placed = {}
    for key, register in intervenable.intervention_hooks.items():
        module = register.__self__
        path = names.get(id(module))
        placed[key] = _execution_device(intervenable.model, path) if path is not None else None
        if placed[key] is None:
            raise ValueError(
                f"cannot tell which device intervention {key} belongs on: its module "
                f"{path or type(module).__name__} has no accelerate execution device and no weights off the meta device"
            )
    return placed


def _wrap_set_device(wrapped, instance, args, kwargs):
    if not dispatched(instance.model):
        return wrapped(*args, **kwargs)
    for key, device in placements(instance).items():
        instance.interventions[key].to(device)
    return None


def _to(self, *args, **kwargs):
    if not dispatched(self.model):
        return nn.Module.to(self, *args, **kwargs)
    self.model.to(*args, **kwargs)  # accelerate's guarded to: warns, or refuses for offloaded models
    return self


def _wrap_reconcile(wrapped, instance, args, kwargs):
    activations = wrapped(*args, **kwargs)
    intervening = args[1] if len(args) > 1 else kwargs["intervening_activations"]
    if isinstance(activations, torch.Tensor) and activations.device != intervening.device:
        return activations.to(intervening.device)
    return activations


def _execution_device(root: nn.Module, path: str) -> torch.device | None:
    parts = path.split(".") if path else []
    for depth in range(len(parts), -1, -1):
        module = root.get_submodule(".".join(parts[:depth]))
        device = _hook_execution_device(getattr(module, "_hf_hook", None))
        if device is not None:
            return device
    module = root.get_submodule(path)
    for tensor in (*module.parameters(), *module.buffers()):
        if tensor.device.type != "meta":
            return tensor.device
    return None


def _hook_execution_device(hook) -> torch.device | None:
    if hook is None:
        return None
    for inner in getattr(hook, "hooks", None) or [hook]:  # accelerate's SequentialHook holds several
        device = getattr(inner, "execution_device", None)
        if device is not None:
            return torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    return None


FIX = Fix(
    __name__,
    sites=(
        Site((BaseModel, "set_device"), _wrap_set_device),
        Site((BaseModel, "to"), _to, kind="add"),
        Site((IntervenableModel, "_reconcile_stateful_cached_activations"), _wrap_reconcile),
    ),
    requires=("wrapper_attributes",),  # HF Trainer sees a split model through the wrapper's hf_device_map
    upstream=("pyvene",),
)
