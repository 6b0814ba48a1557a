"""FSDP2 by hand: ``fully_shard_model(reft_model)`` gives each decoder layer its own unit, then the whole.

    import pyvene_dist
    pyvene_dist.patch()
    from pyvene_dist.fully_shard import fully_shard_model
    fully_shard_model(reft_model)      # keyword arguments go to every fully_shard call (mesh, mp_policy, ...)

The interventions stay whole and their gradients are averaged over the group (see
``pyvene_dist.fixes.fsdp``); call ``patch()`` first, or they are sharded with the root.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed import fsdp  # fsdp.fully_shard read at each call: patch() wraps it there


def layer_classes(model: nn.Module) -> set[str]:
    """The class names HF marks as units not to split (``_no_split_modules``), found anywhere in ``model``."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    return names


def fully_shard_model(model: nn.Module, **fully_shard_kwargs: Any) -> nn.Module:
    classes = layer_classes(model)
    if not classes:
        raise ValueError(f"{type(model).__name__} holds no module with _no_split_modules: name the layers to shard")
    for module in list(model.modules()):
        if type(module).__name__ in classes:
            fsdp.fully_shard(module, **fully_shard_kwargs)
    fsdp.fully_shard(model, **fully_shard_kwargs)
    return model
