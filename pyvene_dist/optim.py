"""Optimizer parameter groups that never decay a parametrization's ``original``.

LoReFT keeps its rotation behind ``torch.nn.utils.parametrizations.orthogonal``. With a non-square
weight the parametrization is Householder: ``original`` stores the reflectors below its diagonal and
the *sign* of each column on the diagonal (read through ``.int()``, which has no gradient). Decoupled
weight decay shrinks that diagonal from -1 to -0.99..., ``.int()`` turns it into 0, and after one
``AdamW`` step the rotation is exactly zero: the intervention becomes the identity and its gradients
vanish. Decay of an ``original`` also never means decay of the weight it parametrizes.

``param_groups`` is for hand-written loops; HF Trainer gets the same split through
``pyvene_dist.fixes.weight_decay``.
"""

from __future__ import annotations

import re
from typing import Iterator

from torch import nn
from torch.nn.utils import parametrize

#: The name patterns HF Trainer (transformers 5.x, ``Trainer.get_decay_parameter_names``) keeps out of decay.
NO_DECAY_PATTERNS = tuple(
    re.compile(pattern) for pattern in (r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)")
)


def parametrization_original_names(model: nn.Module) -> set[str]:
    """Qualified names of every parametrization's ``original`` (``original0``, ``original1``, ...)."""
    names = set()
    for module_name, module in model.named_modules():
        if not parametrize.is_parametrized(module):
            continue
        for tensor_name, parametrizations in module.parametrizations.items():
            prefix = f"{module_name}.parametrizations.{tensor_name}".lstrip(".")
            names.update(f"{prefix}.{name}" for name, _ in parametrizations.named_parameters(recurse=False))
    return names


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two groups of trainable parameters: decayed, and not (biases, norms, parametrization originals)."""
    never_decay = parametrization_original_names(model)
    decay, no_decay = [], []
    for name, parameter in _trainable(model):
        if name in never_decay or any(pattern.search(name.lower()) for pattern in NO_DECAY_PATTERNS):
            no_decay.append(parameter)
        else:
            decay.append(parameter)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def _trainable(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    return ((name, p) for name, p in nn.Module.named_parameters(model) if p.requires_grad)
