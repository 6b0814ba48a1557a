"""What the patches need to know about a model they are handed."""

from __future__ import annotations


def holds_intervenable_model(model) -> bool:
    """Whether ``model`` is, or wraps (DataParallel, DDP, accelerate, DeepSpeed), a pyvene model."""
    from pyvene.models.intervenable_base import BaseModel

    return model is not None and any(isinstance(module, BaseModel) for module in model.modules())


def unwrap_intervenable_model(model):
    """The pyvene model inside ``model`` (itself, or the one DataParallel/DDP/accelerate/DeepSpeed wrap)."""
    from pyvene.models.intervenable_base import BaseModel

    for module in model.modules():
        if isinstance(module, BaseModel):
            return module
    raise ValueError(f"{type(model).__name__} holds no pyvene IntervenableModel")
