"""LoReFT's weights in its parent's state dict.

``LoreftIntervention.state_dict`` returns pyreft's compact form (``weight``, ``bias``, and the rotation as
``rotate_layer``) even when a parent module asks for its part of a state dict: the parent ignores the returned
dict, so ``reft_model.state_dict()`` silently lacks every LoReFT weight (HF Trainer, accelerate and FSDP
checkpoints included). When nested, it now gives ``nn.Module``'s entries; called on its own (as pyvene's
``save_intervention`` does) it keeps pyreft's file format, the rotation read without calling its parametrization
as a module where the rotation is whole here: ZeRO-3's module hooks run on that call, and on rank 0 alone
(``if rank == 0: reft_model.save(...)``) they left the ranks out of step, so the next collective hung.

Wraps ``pyreft.interventions.LoreftIntervention.state_dict``.
"""

from __future__ import annotations

import collections

import torch
from torch import nn

from ..._records import Fix, Site
from ...gather import whole_here


def _wrap_loreft_state_dict(wrapped, instance, args, kwargs):
    if args or kwargs:  # a parent module collecting its state: nn.Module's entries, into its destination
        return nn.Module.state_dict(instance, *args, **kwargs)
    if not whole_here(instance.rotate_layer.parametrizations.weight.original):
        return wrapped()  # partitioned here (ZeRO-3): pyreft's read, whose module call gathers the rotation
    state = collections.OrderedDict(instance.learned_source.state_dict())
    state["rotate_layer"] = rotation_without_hooks(instance.rotate_layer).data
    return state


def rotation_without_hooks(layer: nn.Module) -> torch.Tensor:
    """A parametrized layer's ``weight``, computed by each parametrization's own ``forward`` instead of a
    call of the module: a read fires no module hooks. ZeRO-3's hooks fetch and release parameters and
    count the calls, which every rank must make alike; a save on rank 0 alone would otherwise leave the
    ranks out of step, and their next collective would hang."""
    weights = layer.parametrizations.weight
    value = weights.original
    for parametrization in weights:
        value = type(parametrization).forward(parametrization, value)
    return value


FIX = Fix(
    __name__,
    sites=(Site("pyreft.interventions:LoreftIntervention.state_dict", _wrap_loreft_state_dict),),
    upstream=("pyreft",),
)
