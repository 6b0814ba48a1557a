"""Locations become device tensors once per forward, and pyreft's trainers hand theirs over as tensors.

pyvene takes ``unit_locations`` as nested lists and turns them into index tensors inside every hook,
twice per intervention (gather, then scatter), each a copy from pageable host memory that makes the
host wait for the GPU. pyreft's trainers make it worse: ``compute_loss`` turns the collated
``intervention_locations`` tensor, already on the GPU, back into lists with ``.tolist()``, a
device-to-host copy that stalls every training step. None of it changes a result; all of it stops the
host from running ahead of the GPU, so every microsecond of Python in pyvene's hooks becomes GPU idle time.

The fix, for stateless models in pyvene's parallel mode (ReFT's):

- ``BaseModel._broadcast_unit_locations``: after pyvene broadcasts the locations, each intervention's
  nested lists become one int64 tensor on the model's device, copied from pinned memory without
  blocking; tensors (pyreft's) pass through. ``patches.devices`` then indexes with them as they are.
  Ragged lists (which pyvene would reject later) are left for pyvene to report.
- pyreft's trainers pass their collated tensor through unchanged (``patches.trainer``, item 6).

Results are bit-identical: the same indices reach the same ``torch.gather`` and index writes.
Checked on pyvene 0.1.8 and pyreft 0.1.0 with torch 2.11 and 2.13.
"""

from __future__ import annotations

import torch

from .._registry import Fix, Site
from .devices import as_index

FIX = Fix(
    __name__,
    sites=(Site("pyvene.models.intervenable_base:BaseModel._broadcast_unit_locations",
                "_wrap_broadcast_unit_locations"),),
    requires=("devices",),  # its tensor locations are indexed by the devices fix's gather/scatter
    upstream=("pyvene",),
    checked={"pyvene": "==0.1.8"},
)


def _wrap_broadcast_unit_locations(wrapped, instance, args, kwargs):
    broadcast = wrapped(*args, **kwargs)
    if instance.mode != "parallel" or not instance.is_model_stateless:
        return broadcast
    device = instance.get_device()
    if device.type == "meta":
        return broadcast
    units = [instance.representations[key].unit for key in instance.sorted_keys]
    return {key: tuple(_on_device(part, units, device) for part in pair) for key, pair in broadcast.items()}


def _on_device(part, units: list[str], device: torch.device):
    """One side (sources or base) of broadcast locations: per intervention, lists as device tensors."""
    if part is None or isinstance(part, torch.Tensor) or len(part) != len(units):
        return part
    return [
        _pair_on_device(locations, device) if "." in unit else _tensor_or_as_is(locations, device)
        for locations, unit in zip(part, units)
    ]


def _pair_on_device(locations, device: torch.device):
    if not isinstance(locations, (tuple, list)) or len(locations) != 2:
        return locations
    return tuple(_tensor_or_as_is(level, device) for level in locations)


def _tensor_or_as_is(locations, device: torch.device):
    if not isinstance(locations, list) or not locations or not isinstance(locations[0], list):
        return locations  # None, a tensor already, or a form pyvene treats itself
    try:
        return as_index(locations, device)
    except (TypeError, ValueError):  # ragged or not integers: pyvene's own error follows
        return locations
