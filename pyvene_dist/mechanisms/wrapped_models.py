"""What the patches need to know about a model they are handed."""

from __future__ import annotations

from pyvene.models.intervenable_base import BaseModel


def intervenable_models(model) -> list:
    """The pyvene models in ``model``: itself, or those DataParallel/DDP/FSDP/accelerate/DeepSpeed wrap."""
    return [] if model is None else [module for module in model.modules() if isinstance(module, BaseModel)]


def is_replica(module) -> bool:
    """Whether ``module`` is a DataParallel replica (torch's ``replicate`` marks them ``_is_replica``)."""
    return getattr(module, "_is_replica", False)


def holds_intervenable_model(model) -> bool:
    return bool(intervenable_models(model))


def unwrap_intervenable_model(model):
    """The (first) pyvene model inside ``model``."""
    found = intervenable_models(model)
    if not found:
        raise ValueError(f"{type(model).__name__} holds no pyvene IntervenableModel")
    return found[0]
