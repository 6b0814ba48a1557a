"""Where an intervention's positions live when the sequence is split over ranks (position mapping only).

Context parallel (torch's ``context_parallel``, accelerate's ``cp_size``) and sequence parallel
(DeepSpeed Ulysses/ALST, accelerate's ``sp_size``) give each rank a slice of every sequence, so a
position pyreft names (``unit_locations``) lives on one rank's slice. This module maps global positions
to a rank's local ones; it does not make either strategy work with pyvene (neither runs on CPU gloo here,
see docs/strategies/tensor_parallel.md), and nothing in ``patch()`` uses it.

Layouts:
- ``"contiguous"``: rank ``r`` holds positions ``[r * L / W, (r + 1) * L / W)`` (Ulysses, ALST).
- ``"load_balanced"``: the sequence is cut into ``2 W`` chunks and rank ``r`` holds chunks ``r`` and
  ``2 W - 1 - r``, in that order (torch's context parallel for causal attention, which evens out the work).
"""

from __future__ import annotations

import torch

LAYOUTS = ("contiguous", "load_balanced")


def local_positions(locations: torch.Tensor, seq_len: int, world_size: int, rank: int,
                    layout: str = "contiguous") -> tuple[torch.Tensor, torch.Tensor]:
    """``locations`` (global positions, any shape) as indices into ``rank``'s slice, and the mask of those
    that live there (the other entries of the first result are 0 and must not be used)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r} is not one of {LAYOUTS}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of size {world_size}")
    chunks = world_size if layout == "contiguous" else 2 * world_size
    if seq_len % chunks:
        raise ValueError(f"seq_len {seq_len} does not split into {chunks} equal chunks ({layout}, world {world_size})")
    locations = torch.as_tensor(locations, dtype=torch.long)
    if locations.numel() and not (0 <= int(locations.min()) and int(locations.max()) < seq_len):
        raise ValueError(f"locations must lie in [0, {seq_len}), found {int(locations.min())}..{int(locations.max())}")
    size = seq_len // chunks
    chunk, offset = locations // size, locations % size
    if layout == "contiguous":
        mask = chunk == rank
        local = offset
    else:
        first, second = rank, chunks - 1 - rank
        mask = (chunk == first) | (chunk == second)
        local = torch.where(chunk == first, offset, size + offset)
    return torch.where(mask, local, torch.zeros_like(local)), mask


def shard_sequence(tensor: torch.Tensor, world_size: int, rank: int, layout: str = "contiguous",
                   dim: int = 1) -> torch.Tensor:
    """``rank``'s slice of ``tensor`` along ``dim`` in ``layout`` (what the strategy hands that rank)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r} is not one of {LAYOUTS}")
    if layout == "contiguous":
        return tensor.chunk(world_size, dim)[rank]
    pieces = tensor.chunk(2 * world_size, dim)
    return torch.cat([pieces[rank], pieces[2 * world_size - 1 - rank]], dim)
