"""Locations as an index tensor on the device of the tensor they index, copied without blocking the host."""

from __future__ import annotations

import torch


def as_index(locations, device: torch.device) -> torch.Tensor:
    """``locations`` (nested lists of ints, or a tensor) as an int64 tensor on ``device``; a tensor
    already there is returned as it is, one elsewhere is copied without blocking the host."""
    if isinstance(locations, torch.Tensor):
        if locations.dtype != torch.long:
            locations = locations.long()
        return locations.to(device, non_blocking=True)
    index = torch.tensor(locations, dtype=torch.long)
    if device.type == "cuda":
        index = index.pin_memory()  # a copy from pinned memory is queued, not waited for
    return index.to(device, non_blocking=True)
