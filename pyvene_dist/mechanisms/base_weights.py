"""A base weight trained beside the interventions (a head: pyreft's GLUE example with ``--allow_cls_grad``, a
reward model's ``score``), which ``include_model`` writes to ``pytorch_model.bin``, whole.

It was written as this rank holds it: under ZeRO-3 the empty partition, under FSDP2 a ``DTensor`` shard, and one
device failed to load it (``RuntimeError: Error(s) in loading state_dict for LlamaForCausalLM: size mismatch for
lm_head.weight: copying a param with shape torch.Size([0]) from checkpoint``, or ``aten.copy_.default got mixed
torch.Tensor and DTensor``); a whole saved weight did not load into a partitioned or sharded model either. The
saves (``intervention_files``, ``saved_dtypes``) gather each whole once (ZeRO-3: with the interventions; a
``DTensor``: all-gathered), every rank taking part, and rank 0 writes it; a load copies the whole value into the
gathered partition (ZeRO's fp32 master weights too) or cuts each rank's shard from it.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from ..gather import placed_like, whole
from .saved_files import MODEL_FILE, read_saved


def trainable_base_weights(model: nn.Module) -> dict[str, nn.Parameter]:
    """The base model's trainable parameters (a head trained beside the interventions), by their names in
    its state dict: what ``include_model`` saves."""
    return {name: parameter for name, parameter in model.model.named_parameters() if parameter.requires_grad}


def whole_copies(weights: dict[str, nn.Parameter]) -> dict[str, torch.Tensor]:
    """CPU copies of ``weights``, each whole (inside ``gathered``; a ``DTensor``'s all-gather is a
    collective, which every rank enters, one weight at a time)."""
    return {name: whole(parameter).detach().cpu().clone() for name, parameter in weights.items()}


def read_model_file(directory: str) -> dict[str, torch.Tensor]:
    return read_saved(os.path.join(directory, MODEL_FILE))


def loaded_base_weights(model: nn.Module, saved: dict) -> dict[str, nn.Parameter]:
    """The base model's parameters that ``saved`` holds a value for: those to hold whole while loading."""
    return {name: parameter for name, parameter in model.model.named_parameters() if name in saved}


def load_base_weights(model: nn.Module, saved: dict, parameters: dict[str, nn.Parameter]) -> None:
    """Load whole saved base weights into ``model``'s base as pyvene does (``strict=False``), inside
    ``gathered(..., base=parameters)``: a ZeRO-3 partition is whole there; each ``DTensor`` shard takes
    its own part of the whole value."""
    state = {name: placed_like(value, parameters[name]) if name in parameters else value
             for name, value in saved.items()}
    model.model.load_state_dict(state, strict=False)
