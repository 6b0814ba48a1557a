"""Locations become device tensors once per forward, and pyreft's trainers hand theirs over as tensors.

pyvene takes ``unit_locations`` as nested lists and turns them into index tensors inside every hook,
twice per intervention (gather, then scatter), each a copy from pageable host memory that makes the
host wait for the GPU. pyreft's trainers make it worse: ``compute_loss`` turns the collated
``intervention_locations`` tensor, already on the GPU, back into lists with ``.tolist()``, a
device-to-host copy that stalls every training step. None of it changes a result; all of it stops the
host from running ahead of the GPU, so every microsecond of Python in pyvene's hooks becomes GPU idle time.

The fix, for stateless models in pyvene's parallel mode (ReFT's):

- ``BaseModel._input_validation``, which pyvene calls right after broadcasting the locations (in
  ``forward`` and ``generate``): once they are checked (below), each intervention's nested lists become
  one int64 tensor on the model's device, copied from pinned memory without blocking; tensors (pyreft's)
  pass through. ``fixes.devices`` then indexes with them as they are.
  Ragged lists (which pyvene would reject later) are left for pyvene to report.
- pyreft's trainers pass their collated tensor through unchanged (``fixes.pyreft_trainer``, item 4).

Results are bit-identical: the same indices reach the same ``torch.gather`` and index writes.

One row of locations for the whole batch applies to every example, as pyvene already does for a single
``int`` (``{"base": 3}``). pyvene's own unit test ``test_local_load_positive`` passes one row for a batch
of 10: stock pyvene then intervened on example 0 alone, silently (the row reached its index arithmetic
as it was). The row is repeated for every example, on either side, for ``pos`` units and for each
level of nested ones (``h.pos``), in lists (the same row object) and tensors (``expand``, no copy).

Locations that do not fit the batch otherwise are refused before anything runs, while they are still on
the host. pyvene checks none of it: 5 rows for a batch of 4, locations for 1 of 2 interventions, or
position 8 in a sequence of 8 fail deep inside with ``RuntimeError: Size does not match at dimension
0``, ``IndexError: list index out of range`` or ``RuntimeError: index 8 is out of bounds``, and 2 rows
for a batch of 4 give wrong outputs for examples 2 and 3. Now: one entry per intervention, one row per
example (or one for them all), each row a list of integer positions (a float ``7.5`` ran as position 7, and a
flat ``[7, 7]`` for two interventions failed with ``object of type 'int' has no len()``), positions of ``pos``
units inside the base sequence, and for ``subspaces`` one entry per intervention and one row per example; the
error names the entry, e.g.
``unit_locations['sources->base'][1][0] has 2 rows but the batch has 4 examples``, as a
``LocationError``: a ``ValueError``, and an ``IndexError`` as pyvene's own failure for locations given to
1 of 2 interventions was (its ``test_with_subspace_negative`` catches that). Only lengths and
shapes are read, and values only where they are on the host (lists, CPU tensors): nothing waits for
the GPU. Locations already on the GPU (pyreft's collated tensor) have their shape checked, not their values.

pyreft's interventions take ``dtype=`` and default to ``torch.bfloat16``; on a float32 model outside autocast
LoReFT's ``learned_source`` failed with ``mat1 and mat2 must have the same dtype``. The same check refuses it
first, naming the intervention, the layer, both dtypes and the three ways out (``check_intervention_dtypes``),
once per model and dtype.
"""

from __future__ import annotations

import numbers

import torch
from pyvene.models.intervenable_base import BaseModel

from .._records import Fix, Site
from ..mechanisms.dtype_checks import check_intervention_dtypes
from ..mechanisms.indices import as_index


class LocationError(ValueError, IndexError):
    """Locations that do not fit the model or the batch: a ``ValueError``, and an ``IndexError`` as pyvene's
    own error for some of them was, so that code catching pyvene's error catches this one."""


def _wrap_input_validation(wrapped, instance, args, kwargs):
    base, _, unit_locations, _, subspaces = _validation_arguments(*args, **kwargs)
    if instance.mode != "parallel" or not instance.is_model_stateless:
        return wrapped(*args, **kwargs)
    repeat_one_row(instance, base, unit_locations)
    check_unit_locations(instance, base, unit_locations)
    check_subspaces(instance, base, subspaces)
    check_intervention_dtypes(instance, base)
    result = wrapped(*args, **kwargs)
    if unit_locations:
        _put_on_device(instance, unit_locations)
    return result


def _validation_arguments(base, sources, unit_locations, activations_sources, subspaces):
    return base, sources, unit_locations, activations_sources, subspaces


def repeat_one_row(model, base, broadcast: dict) -> None:
    """Give every example the locations of a side given as one row for the whole batch.

    ``broadcast`` is the dict pyvene's ``_broadcast_unit_locations`` just built, which ``forward`` goes on
    to use; its values are replaced, never the caller's lists or tensors changed."""
    batch, _ = _batch_and_length(base)
    if not broadcast or batch is None or batch == 1:
        return
    units = [model.representations[key].unit for key in model.sorted_keys]
    for key, pair in broadcast.items():
        if isinstance(pair, (tuple, list)):
            broadcast[key] = type(pair)(_side_for_every_example(part, units, batch) for part in pair)


def _side_for_every_example(part, units: list[str], batch: int):
    """One side: a tensor ``[interventions, rows, units]``, or one entry per intervention (a count that
    differs is left for ``check_unit_locations`` to refuse)."""
    if isinstance(part, torch.Tensor):
        if part.dim() < 2 or part.shape[1] != 1:
            return part
        return part.expand(part.shape[0], batch, *part.shape[2:])
    if not isinstance(part, (tuple, list)) or len(part) != len(units):
        return part
    return [
        locations if locations is None or unit == "t"
        else type(locations)(_rows_for_every_example(level, batch) for level in locations) if _is_nested(locations, unit)
        else _rows_for_every_example(locations, batch)
        for locations, unit in zip(part, units)
    ]


def _is_nested(locations, unit: str) -> bool:
    """A nested unit's ``(heads, positions)`` pair, each level with its own rows."""
    return "." in unit and isinstance(locations, (tuple, list)) and len(locations) == 2


def _rows_for_every_example(rows, batch: int):
    if _leading_length(rows) != 1:
        return rows
    if isinstance(rows, torch.Tensor):
        return rows.expand(batch, *rows.shape[1:])
    return [rows[0]] * batch


def check_unit_locations(model, base, unit_locations) -> None:
    """Check ``unit_locations`` against the batch (after ``repeat_one_row``): raises ``LocationError`` naming
    the entry that does not fit."""
    if not unit_locations:
        return
    batch, length = _batch_and_length(base)
    units = [model.representations[key].unit for key in model.sorted_keys]
    for key, pair in unit_locations.items():
        if not isinstance(pair, (tuple, list)):
            continue
        for side, part in enumerate(pair):
            if part is None:
                continue
            where = f"unit_locations[{key!r}][{side}]"
            _check_count(where, part, len(units))
            for index, (locations, unit) in enumerate(zip(part, units)):
                if locations is None or unit == "t":
                    continue
                name = f"{where}[{index}]"
                if _is_nested(locations, unit):
                    for level, levelled in enumerate(locations):
                        _check_row_form(f"{name}[{level}]", levelled)
                        _check_rows(f"{name}[{level}]", levelled, batch, shared_row=True)
                    _check_positions(f"{name}[1]", locations[1], length if side == 1 else None)
                else:
                    _check_row_form(name, locations)
                    _check_rows(name, locations, batch, shared_row=True)
                    if unit == "pos":
                        _check_positions(name, locations, length if side == 1 else None)


def check_subspaces(model, base, subspaces) -> None:
    if not isinstance(subspaces, (list, torch.Tensor)):
        return
    count = len(model.sorted_keys)
    batch, _ = _batch_and_length(base)
    _check_count("subspaces", subspaces, count)
    for index, rows in enumerate(subspaces):
        if rows is not None:
            _check_rows(f"subspaces[{index}]", rows, batch)


def _batch_and_length(base) -> tuple[int | None, int | None]:
    tensor = base.get("input_ids", base.get("inputs_embeds")) if isinstance(base, dict) else base
    if not isinstance(tensor, torch.Tensor) or tensor.dim() < 2:
        return None, None
    return tensor.shape[0], tensor.shape[1]


def _leading_length(value) -> int | None:
    """The length of ``value``'s first axis: a list's or tuple's length, a tensor's first size (None otherwise)."""
    if isinstance(value, torch.Tensor):
        return value.shape[0] if value.dim() else None
    return len(value) if isinstance(value, (list, tuple)) else None


def _check_count(where: str, part, expected: int) -> None:
    found = _leading_length(part)
    if found is not None and found != expected:
        raise LocationError(f"{where} has {found} entr{'y' if found == 1 else 'ies'} but the model has {expected} "
                            "interventions: give one entry per intervention (None to leave one out)")


def _check_row_form(where: str, rows) -> None:
    """Rows of integer positions: a list (or tensor) of rows, each a list of integers. Only what is on the host
    is read: a tensor's dtype, a list's items."""
    if isinstance(rows, torch.Tensor):
        if rows.is_floating_point() or rows.is_complex():
            raise LocationError(f"{where} is a tensor of {rows.dtype}; positions are integers: give a torch.long "
                                "tensor")
        return
    if isinstance(rows, numbers.Number):
        raise LocationError(f"{where} is {rows!r}, expected rows of positions: one list per example, such as "
                            f"[[{rows!r}]] * batch_size, or one row for them all, [[{rows!r}]]")
    if not isinstance(rows, (list, tuple)):
        return
    for number, row in enumerate(rows):
        if isinstance(row, numbers.Number):
            raise LocationError(f"{where}[{number}] is {row!r}, expected a list of positions such as [{row!r}]: "
                                "one list per example")
        if isinstance(row, (list, tuple)):
            for position in row:
                if isinstance(position, numbers.Real) and not isinstance(position, numbers.Integral):
                    raise LocationError(f"{where}[{number}] holds position {position!r}; positions are integers "
                                        f"(pyvene would take {int(position)})")


def _check_rows(where: str, rows, batch: int | None, *, shared_row: bool = False) -> None:
    """``shared_row``: one row for the whole batch was accepted (and repeated) before this check."""
    if batch is None:
        return
    found = _leading_length(rows)
    if found is not None and found != batch:
        raise LocationError(f"{where} has {found} row{'s' * (found != 1)} but the batch has {batch} examples: "
                            f"give one row per example{', or one row for them all' * shared_row}")


def _check_positions(where: str, rows, length: int | None) -> None:
    """Positions of the base sequence, checked where they are on the host; a GPU tensor is left alone."""
    if length is None:
        return
    if isinstance(rows, torch.Tensor):
        if rows.device.type != "cpu" or not rows.numel():
            return
        low, high = int(rows.min()), int(rows.max())
    elif isinstance(rows, (list, tuple)):
        flat = [p for row in rows if isinstance(row, (list, tuple)) for p in row if isinstance(p, int)]
        if not flat:
            return
        low, high = min(flat), max(flat)
    else:
        return
    if low < 0 or high >= length:
        bad = high if high >= length else low
        raise LocationError(f"{where} holds position {bad} but the sequence has {length} positions (0 to {length - 1})")


def _put_on_device(model, broadcast: dict) -> None:
    """Replace the lists in ``broadcast`` (the dict pyvene's ``_broadcast_unit_locations`` just built, which
    ``forward`` goes on to use) with device tensors."""
    device = model.get_device()
    if device.type == "meta":
        return
    units = [model.representations[key].unit for key in model.sorted_keys]
    for key, pair in broadcast.items():
        if isinstance(pair, tuple):
            broadcast[key] = tuple(_on_device(part, units, device) for part in pair)


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


FIX = Fix(
    __name__,
    sites=(Site((BaseModel, "_input_validation"), _wrap_input_validation),),
    requires=("devices",),  # its tensor locations are indexed by the devices fix's gather/scatter
    upstream=("pyvene",),
)
