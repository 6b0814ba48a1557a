"""Optimizer parameter groups that never decay a parametrization's ``original``.

LoReFT keeps its rotation behind ``torch.nn.utils.parametrizations.orthogonal``. With a non-square
weight the parametrization is Householder: ``original`` stores the reflectors below its diagonal and
the *sign* of each column on the diagonal (read through ``.int()``, which has no gradient). Decoupled
weight decay shrinks that diagonal from -1 to -0.99..., ``.int()`` turns it into 0, and after one
``AdamW`` step the rotation is exactly zero: the intervention becomes the identity and its gradients
vanish. Decay of an ``original`` also never means decay of the weight it parametrizes.

``param_groups`` is for hand-written loops; HF Trainer gets the same split through
``pyvene_dist.fixes.weight_decay``. Where the base trains parameters of its own beside the interventions (a
classifier's head, LoRA adapters), each group is split into the interventions' and the others': FSDP2 shards the
others into DTensors and leaves the interventions plain tensors, and a foreach or fused optimizer step (torch's
default on CUDA) fails on a group that holds both (``RuntimeError: aten._foreach_mul_.Scalar got mixed torch.Tensor
and DTensor``, pytorch/pytorch#183207). The split is by module, not by tensor type, so groups built before sharding
(and handed to ``accelerator.prepare``, which swaps in the sharded parameters) hold one kind each too.
"""

from __future__ import annotations

import re
from typing import Iterator

from torch import nn
from torch.nn.utils import parametrize


class MixedParameterGroupsWarning(RuntimeWarning):
    """Given by ``fixes.fsdp`` where FSDP2 made trainable parameters DTensors beside a pyvene model's plain
    interventions. An optimizer over ``param_groups(model, ...)`` needs nothing more: where that is the optimizer,
    ``warnings.simplefilter("ignore", MixedParameterGroupsWarning)`` silences it (the parity harness does)."""


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
    """Groups of trainable parameters: decayed, and not (biases, norms, parametrization originals), each of them
    split into the interventions' and the others' where it holds both."""
    never_decay = parametrization_original_names(model)
    decay, no_decay = [], []
    for name, parameter in _trainable(model):
        if name in never_decay or any(pattern.search(name.lower()) for pattern in NO_DECAY_PATTERNS):
            no_decay.append(parameter)
        else:
            decay.append(parameter)
    # pyvene prints as it is imported, and `pyvene-dist check` imports this module (through the harness) before it
    # sends standard output elsewhere: pyvene is imported where a pyvene model already exists.
    from .mechanisms.wrapped_models import intervenable_models

    interventions = {id(p) for found in intervenable_models(model) for p in found.interventions.parameters()}
    return [*_interventions_apart(decay, interventions, weight_decay),
            *_interventions_apart(no_decay, interventions, 0.0)]


def _interventions_apart(parameters: list[nn.Parameter], interventions: set[int], weight_decay: float) -> list[dict]:
    """One group of ``parameters``, or two where the interventions' stand beside others (FSDP2 shards only those)."""
    own = [p for p in parameters if id(p) in interventions]
    others = [p for p in parameters if id(p) not in interventions]
    parts = (own, others) if own and others else (parameters,)
    return [{"params": part, "weight_decay": weight_decay} for part in parts]


def _trainable(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    return ((name, p) for name, p in nn.Module.named_parameters(model) if p.requires_grad)
