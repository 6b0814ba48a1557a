"""LoReFT loads into its existing parameters, exactly, on any device.

``LoreftIntervention.load_state_dict`` builds a new rotation layer, so an optimizer (or DDP, FSDP, DeepSpeed) keeps
updating the old parameters. It now copies into the existing ones: the rotation through the parametrization's
``right_inverse``, in float32 where it was saved in half precision (torch's QR has no bf16 kernel on the CPU: a
folder saved under DeepSpeed's bf16 mode failed to load there with ``NotImplementedError: "geqrf_cpu" not
implemented for 'BFloat16'``), and exactly: the reloaded weight is the saved rotation bit for bit
(``load_rotation``); the rest in place.

Replaces ``pyreft.interventions.LoreftIntervention.load_state_dict``.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils.parametrizations import _Orthogonal

from ..._records import Fix, Site
from ...mechanisms.arguments import bound

#: Dtypes in which torch's QR (``geqrf``, behind the orthogonal map's ``right_inverse``) runs on every device.
_QR_DTYPES = (torch.float32, torch.float64)


def _wrap_loreft_load_state_dict(wrapped, instance, args, kwargs):
    state = bound(wrapped, args, kwargs).arguments["state_dict"]
    if "rotate_layer" not in state:  # nn.Module's own form
        return nn.Module.load_state_dict(instance, *args, **kwargs)
    source = {key: value for key, value in state.items() if key != "rotate_layer"}
    instance.learned_source.load_state_dict(source)
    load_rotation(instance.rotate_layer, state["rotate_layer"])
    return None


@torch.no_grad()
def load_rotation(layer: nn.Module, rotation: torch.Tensor) -> None:
    """Give a layer whose ``weight`` is parametrized the saved ``rotation`` as that weight, written into the
    existing parameter (so optimizers and wrappers keep it), exactly.

    The value goes back through each parametrization's ``right_inverse``, as assigning ``layer.weight`` does. For
    the orthogonal map that is a QR decomposition, which has no half-precision kernel on the CPU: a rotation saved
    in bf16 (DeepSpeed's bf16 mode casts it) failed to load there with ``NotImplementedError: "geqrf_cpu" not
    implemented for 'BFloat16'``. It runs in float32 here, and the raw matrix it gives is copied into the
    parameter in the parameter's own dtype. The orthogonal map (with torch's default trivialization) completes the
    rotation into a square orthogonal ``base`` buffer by QR, whose first columns equal the rotation only to
    rounding; they are set to the saved values (as pyreft's own ``load_state_dict`` does), so that the layer's
    weight is the saved rotation bit for bit."""
    weights = layer.parametrizations.weight
    original = weights.original
    value = rotation.to(original.device)
    value = value if value.dtype in _QR_DTYPES else value.float()
    saved = value
    for parametrization in reversed(weights):
        value = parametrization.right_inverse(value)
    original.copy_(value)
    if len(weights) == 1 and isinstance(weights[0], _Orthogonal) and getattr(weights[0], "base", None) is not None:
        tall = saved if saved.size(-2) >= saved.size(-1) else saved.mT
        weights[0].base[..., :tall.size(-1)] = tall.to(weights[0].base.dtype)


FIX = Fix(
    __name__,
    sites=(Site("pyreft.interventions:LoreftIntervention.load_state_dict", _wrap_loreft_load_state_dict,
                kind="replace"),),
    upstream=("pyreft",),
)
