"""Split ``IntervenableModel.forward``'s arguments along their batch axis, as ``torch.chunk`` splits the input.

``nn.DataParallel`` splits every tensor on dim 0 and copies everything else whole. pyvene's location
and subspace arguments put the *intervention* axis first (``[interventions][batch][units]``, which
pyreft builds with ``permute(1, 0, 2)``), and arrive as nested lists or tensors, so each replica got
either all the locations of the batch or those of the wrong interventions (a user saw ``[4, 8, 1]``
on 2 GPUs and ``[4, 12, 1]`` on 3 where each replica needed ``[4, 4, 1]``).

This module knows each argument's layout and splits it by batch:

``base``, each of ``sources``, ``labels``
    a tensor ``[batch, ...]`` or a dict of them (non-tensor values are copied).
``unit_locations``
    ``{key: value}`` with key ``"sources->base"``, ``"base"``, or serial ``"source_i->source_j"``. A value
    pyvene broadcasts itself (an ``int``, a pair of ``int``/``None``, a flat list of ints) is copied:
    pyvene expands it with each replica's own batch size. Otherwise it is ``(sources_side, base_side)``
    (``base_side`` alone for ``"base"``); a side is ``None`` or one entry per intervention; an entry is
    ``None``, a ``[batch][units]`` list or tensor, or for a nested unit such as ``"h.pos"`` a pair of them.
    A side may also be one tensor ``[interventions, batch, units]``.
``subspaces``
    an ``int`` or flat list (broadcast, copied), or one entry per intervention: ``None`` or
    ``[batch][subspace indices]``; or a tensor ``[interventions, batch, ...]``.
``source_representations``
    a tensor ``[batch, ...]``, or a list or dict of them.

Anything else is copied, except ``intervention_additional_kwargs`` holding tensors, which cannot be
split without knowing what they mean: that is an error, as is every batch size that differs from the
input's, naming the argument and both sizes. Never a silent wrong split.
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from typing import Any, Sequence

import torch

Pieces = list  # one item per chunk


def chunk_sizes(batch_size: int, chunks: int) -> list[int]:
    """The sizes ``torch.chunk(x, chunks)`` gives a batch of ``batch_size``: possibly fewer than ``chunks``."""
    if batch_size < 1 or chunks < 1:
        raise ValueError(f"cannot split a batch of {batch_size} into {chunks} chunks")
    size = -(-batch_size // chunks)
    return [min(size, batch_size - start) for start in range(0, batch_size, size)]


def batch_size_of(base: Any) -> int:
    """pyvene's own rule: the first dimension of ``base`` or of its first value."""
    first = base if isinstance(base, torch.Tensor) else next(iter(base.values()), None) if isinstance(base, Mapping) else None
    if not isinstance(first, torch.Tensor) or first.dim() == 0:
        raise ValueError(f"cannot tell the batch size of base: expected a tensor or a dict of tensors, got {base!r}")
    return first.shape[0]


def split_forward_arguments(model, arguments: dict[str, Any], sizes: Sequence[int]) -> list[dict[str, Any]]:
    """One dict of ``forward`` arguments per chunk; ``arguments`` are ``forward``'s, by name."""
    batch = sum(sizes)
    splitter = _Splitter(model, batch, list(sizes))
    per_chunk: list[dict[str, Any]] = [{} for _ in sizes]
    for name, value in arguments.items():
        split = _SPLITS.get(name, _Splitter.copy)
        for piece, chunk in zip(split(splitter, value, name), per_chunk):
            chunk[name] = piece
    return per_chunk


class _Splitter:
    def __init__(self, model, batch: int, sizes: list[int]):
        self.model = model
        self.batch = batch
        self.sizes = sizes

    # -- generic pieces ---------------------------------------------------------------------------
    def copy(self, value: Any, name: str) -> Pieces:
        return [value for _ in self.sizes]

    def per_example(self, value: Any, name: str) -> Pieces:
        """A tensor, list or tuple with the batch on its first axis."""
        length = value.shape[0] if isinstance(value, torch.Tensor) and value.dim() else _length(value)
        if length is None:
            raise ValueError(f"{name} cannot be split by batch: expected a tensor or list with one entry per "
                             f"example, got {type(value).__name__}")
        if length != self.batch:
            raise ValueError(f"{name} has batch size {length} but the base input has {self.batch}")
        if isinstance(value, torch.Tensor):
            return list(torch.split(value, self.sizes))
        starts = _starts(self.sizes)
        return [type(value)(value[start : start + size]) for start, size in zip(starts, self.sizes)]

    def tensors_per_example(self, value: Any, name: str) -> Pieces:
        """A tensor ``[batch, ...]`` or a dict of them (other values copied)."""
        if value is None:
            return self.copy(value, name)
        if isinstance(value, torch.Tensor):
            return self.per_example(value, name)
        if isinstance(value, Mapping):
            return _transpose_dict({
                key: self.per_example(item, f"{name}[{key!r}]") if isinstance(item, torch.Tensor)
                else self.copy(item, name)
                for key, item in value.items()
            }, len(self.sizes))
        raise ValueError(f"{name} cannot be split by batch: expected a tensor or a dict of tensors, "
                         f"got {type(value).__name__}")

    # -- pyvene's arguments -----------------------------------------------------------------------
    def sources(self, value: Any, name: str) -> Pieces:
        if value is None:
            return self.copy(value, name)
        if not isinstance(value, list):
            value = [value]  # pyvene accepts a single source
        return _transpose_list([self.tensors_per_example(source, f"{name}[{i}]") for i, source in enumerate(value)],
                               len(self.sizes))

    def unit_locations(self, value: Any, name: str) -> Pieces:
        if value is None:
            return self.copy(value, name)
        if not isinstance(value, dict):
            raise ValueError(f"{name} cannot be split by batch: expected a dict such as "
                             f"{{'sources->base': (None, locations)}}, got {type(value).__name__}")
        pieces = {}
        for key, item in value.items():
            where = f"{name}[{key!r}]"
            if _is_broadcast_location(item):
                pieces[key] = self.copy(item, where)
            elif "->" in key:
                if not (isinstance(item, (list, tuple)) and len(item) == 2):
                    raise ValueError(f"{where} cannot be split by batch: expected (source locations, base "
                                     f"locations), got {_what_it_is(item)}")
                units = self._units(key)
                sides = [self._side(side, units, f"{where}[{i}]") for i, side in enumerate(item)]
                pieces[key] = [type(item)(pair) if isinstance(item, tuple) else list(pair) for pair in zip(*sides)]
            else:
                pieces[key] = self._side(item, self._units(key), where)
        return _transpose_dict(pieces, len(self.sizes))

    def subspaces(self, value: Any, name: str) -> Pieces:
        if value is None or isinstance(value, int) or (isinstance(value, list) and value and isinstance(value[0], int)):
            return self.copy(value, name)
        return self._side(value, [None] * _intervention_count(value), name)

    def source_representations(self, value: Any, name: str) -> Pieces:
        if value is None:
            return self.copy(value, name)
        if isinstance(value, torch.Tensor):
            return self.per_example(value, name)
        if isinstance(value, dict):
            return _transpose_dict({key: self.per_example(item, f"{name}[{key!r}]") for key, item in value.items()},
                                   len(self.sizes))
        if isinstance(value, list):
            return _transpose_list([self.per_example(item, f"{name}[{i}]") for i, item in enumerate(value)],
                                   len(self.sizes))
        raise ValueError(f"{name} cannot be split by batch: expected a tensor, or a list or dict of tensors, "
                         f"got {type(value).__name__}")

    def additional_kwargs(self, value: Any, name: str) -> Pieces:
        if isinstance(value, dict) and any(isinstance(item, torch.Tensor) for item in value.values()):
            raise ValueError(f"{name} holds tensors, which cannot be split by batch without knowing their layout; "
                             "pass per-example data through base or source_representations")
        return self.copy(value, name)

    # -- helpers ----------------------------------------------------------------------------------
    def _side(self, side: Any, units: list[str | None], where: str) -> Pieces:
        """One side of a location pair (or subspaces): one entry per intervention."""
        if side is None:
            return self.copy(side, where)
        if isinstance(side, torch.Tensor):
            if side.dim() < 2 or side.shape[1] != self.batch:
                raise ValueError(f"{where} has shape {tuple(side.shape)}; expected [interventions, batch "
                                 f"{self.batch}, ...]")
            return list(torch.split(side, self.sizes, dim=1))
        if not isinstance(side, (list, tuple)):
            raise ValueError(f"{where} cannot be split by batch: expected one entry per intervention, "
                             f"got {_what_it_is(side)}")
        if units and len(side) != len(units):
            raise ValueError(f"{where} has {len(side)} entries; expected one per intervention ({len(units)})")
        entries = [self._entry(entry, units[i] if units else None, f"{where}[{i}]") for i, entry in enumerate(side)]
        return [type(side)(chunk) for chunk in zip(*entries)] if entries else self.copy(side, where)

    def _entry(self, entry: Any, unit: str | None, where: str) -> Pieces:
        if entry is None:
            return self.copy(entry, where)
        if unit is not None and "." in unit:
            if not (isinstance(entry, (list, tuple)) and len(entry) == 2):
                raise ValueError(f"{where} is for unit {unit!r}: expected a pair of per-example locations, "
                                 f"got {_what_it_is(entry)}")
            levels = [self.per_example(level, f"{where}[{i}]") for i, level in enumerate(entry)]
            return [type(entry)(pair) for pair in zip(*levels)]
        return self.per_example(entry, where)

    def _units(self, key: str) -> list[str]:
        """The unit of each intervention that ``unit_locations[key]`` addresses, in order."""
        representations = self.model.representations
        if key in ("sources->base", "base"):
            keys = self.model.sorted_keys
        else:  # serial: "source_i->..." addresses group i
            group = int(key.split("->")[0].split("_")[1])
            keys = self.model._intervention_group.get(group, [])
        return [representations[k].unit for k in keys]


_SPLITS = types.MappingProxyType({
    "base": _Splitter.tensors_per_example,
    "labels": _Splitter.tensors_per_example,
    "sources": _Splitter.sources,
    "unit_locations": _Splitter.unit_locations,
    "subspaces": _Splitter.subspaces,
    "source_representations": _Splitter.source_representations,
    "intervention_additional_kwargs": _Splitter.additional_kwargs,
})


def _is_broadcast_location(value: Any) -> bool:
    """The forms ``IntervenableModel._broadcast_unit_locations`` expands with the batch size itself."""
    if isinstance(value, int):
        return True
    if isinstance(value, (list, tuple)) and len(value) == 2 and all(v is None or isinstance(v, int) for v in value):
        return any(isinstance(v, int) for v in value)
    return isinstance(value, list) and bool(value) and all(isinstance(v, int) for v in value)


def _intervention_count(value: Any) -> int:
    return value.shape[0] if isinstance(value, torch.Tensor) else len(value)


def _length(value: Any) -> int | None:
    return len(value) if isinstance(value, (list, tuple)) else None


def _starts(sizes: Sequence[int]) -> list[int]:
    starts, position = [], 0
    for size in sizes:
        starts.append(position)
        position += size
    return starts


def _transpose_dict(pieces: dict[str, Pieces], chunks: int) -> Pieces:
    return [{key: value[i] for key, value in pieces.items()} for i in range(chunks)]


def _transpose_list(pieces: list[Pieces], chunks: int) -> Pieces:
    return [[value[i] for value in pieces] for i in range(chunks)]


def _what_it_is(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return f"{type(value).__name__} {value!r}"[:120]
