"""``IntervenableModel.train(mode)`` and ``eval()`` switch the interventions too, and return the model.

pyvene 0.1.8 switches only the base model and returns ``None``: intervention dropout stays on during
evaluation, ``model.training`` never changes, and ``model = model.eval()`` leaves ``None``. HF Trainer
calls ``model.train()`` every step and ``model.eval()`` before evaluating.

The fix is ``nn.Module.train``: the wrapper, the base model and every intervention follow ``mode``.
"""

from __future__ import annotations

from pyvene.models.intervenable_base import IntervenableModel
from torch import nn

from .._records import Fix, Site


def _wrap_train(wrapped, instance, args, kwargs):
    return nn.Module.train(instance, *args, **kwargs)


def _wrap_eval(wrapped, instance, args, kwargs):
    return nn.Module.eval(instance)


FIX = Fix(
    __name__,
    sites=(
        Site((IntervenableModel, "train"), _wrap_train, kind="replace"),
        Site((IntervenableModel, "eval"), _wrap_eval, kind="replace"),
    ),
    upstream=("pyvene",),
)
