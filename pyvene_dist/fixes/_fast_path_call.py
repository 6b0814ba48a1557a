"""The fast path's per-call half (``fixes.fast_path``): the plan a model's calls run on (``Plan``, its ``Step``s),
one call's locations as index tensors (``Call``), and the hook each step registers once, which intervenes with
them while a call runs. Nothing here imports ``fast_path``: it builds plans and calls these."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..mechanisms.copy_on_write import copy_first, must_copy
from ..mechanisms.dtype_checks import check_intervention_dtypes
from ._fast_path_operations import operations


@dataclasses.dataclass(eq=False)
class Step:
    """One intervention of the plan, in the order pyvene registers its hooks."""

    number: int  # its place in that order (pyvene's per-hook counters of a generate)
    index: int  # its place in ``sorted_keys``: the locations' intervention axis
    intervention: Any


@dataclasses.dataclass(eq=False)
class Plan:
    """Kept in the model's state (``fast_path.FastPathState``) while its interventions are the same."""

    interventions: list  # the model's interventions when built: the plan stands while they are the same
    refusal: str | None  # why the model takes the general path (then nothing else is set)
    steps: list = dataclasses.field(default_factory=list)
    handles: list = dataclasses.field(default_factory=list)
    config_has_use_cache: bool = False
    call: Call | None = None
    compiled: tuple | None = None  # (compile config, the plan's compiled decoding step): ``compiled_decoding``
    #: (hook, shape, dtype, device, saved-tensor hooks on) -> whether the hooked output aliases a saved tensor
    aliasing: dict = dataclasses.field(default_factory=dict)
    batch_indices: dict = dataclasses.field(default_factory=dict)  # (batch, device) -> arange(batch)[:, None]
    #: pyreft's forward functions -> whether each is the one ``operations`` was written from (read once)
    pyreft_forms: dict = dataclasses.field(default_factory=dict)

    def remove(self) -> None:
        handles, self.handles = self.handles, []
        for handle in handles:
            handle.remove()


@dataclasses.dataclass(eq=False)
class Call:
    """One forward's (or one generate's) locations, set on the plan while the base model runs."""

    positions: list  # per intervention (``sorted_keys`` order): int64 [batch, positions]
    use_fast: bool  # pyvene's flag: the write takes row 0 of the positions for the whole batch
    #: per intervention, on the hooked output's device: the gather's index (the positions expanded over the
    #: last dimension), the positions of the write, the batch index, and the intervention's operations
    #: (``_fast_path_operations.operations``) or None; made at the hook's first use.
    indices: list
    generating: bool = False
    on_prompt: bool = False
    #: per hook, in a generate: whether it has run (on the prompt's forward). pyvene counts each hook's calls
    #: and asks only whether the count is 0; a flag that stays True keeps a compiled decoding step's guards
    #: the same at every token (a count changed them, and every token compiled again).
    seen: list | None = None


# --- one call's locations ------------------------------------------------------------------------------------

def _call(model, base, unit_locations) -> Call | None:
    """The call's index tensors, or None where its locations take the general path (a form pyvene broadcasts
    otherwise, source locations, locations that do not fit: the general path says what is wrong)."""
    if type(unit_locations) is not dict or len(unit_locations) != 1 or type(base) is not dict or not base:
        return None
    (key, value), = unit_locations.items()
    broadcast = True
    if key == "sources->base" and isinstance(value, (tuple, list)) and len(value) == 2 and value[0] is None:
        side = value[1]
        broadcast = isinstance(side, int)
    elif key != "base":
        return None
    else:
        side = value
    # pyvene's _broadcast_unit_locations, the base side of each form it expands (it sets use_fast for them)
    if isinstance(side, int):
        rows = [[side]]
    elif key == "base" and isinstance(side, (list, tuple)) and len(side) == 2 and isinstance(side[1], int) \
            and (side[0] is None or isinstance(side[0], int)):
        rows = [[side[1]]]
    elif key == "base" and isinstance(side, list) and side and all(isinstance(v, int) for v in side):
        rows = [side]
    else:
        rows, broadcast = None, False
    first = next(iter(base.values()))
    if not isinstance(first, torch.Tensor) or first.dim() < 1:
        return None
    check_intervention_dtypes(model, base)  # a pyreft layer in another dtype than the model: named, not a matmul's
    batch = first.shape[0]
    ids = base.get("input_ids", base.get("inputs_embeds"))
    length = ids.shape[1] if isinstance(ids, torch.Tensor) and ids.dim() >= 2 else None
    count = len(model.sorted_keys)
    if broadcast:
        locations = torch.tensor(rows, dtype=torch.long).expand(count, batch, -1)
    else:
        locations = _as_tensor(side, count)
        if locations is None:
            return None
    if locations.dim() != 3 or locations.shape[0] != count or locations.shape[1] not in (1, batch) \
            or locations.shape[2] == 0:
        return None
    if locations.device.type == "cpu" and length is not None and not torch.compiler.is_compiling():
        low, high = torch.aminmax(locations)
        if low < 0 or high >= length:  # the general path names the entry and the position
            return None
    if locations.shape[1] != batch:  # one row for the whole batch (fixes.locations' repeat_one_row)
        locations = locations.expand(-1, batch, -1)
    if broadcast:
        model.use_fast = True  # as pyvene's broadcast sets it, for this call and every later one
    locations = locations.to(first.device, non_blocking=True)
    return Call(positions=locations.unbind(0), use_fast=model.use_fast, indices=[None] * count)


def _as_tensor(side, count: int) -> torch.Tensor | None:
    """The base side's locations, ``[interventions, batch, positions]``: a tensor as given (int64), or lists
    of equal length made one; None for anything else (ragged, missing entries)."""
    if isinstance(side, torch.Tensor):
        if side.is_floating_point():  # float positions: the general path refuses them (fixes.locations)
            return None
        return side if side.dtype == torch.long else side.long()
    if not isinstance(side, (list, tuple)) or len(side) != count:
        return None
    try:
        found = torch.tensor(side)
        return None if found.is_floating_point() else found.long()  # 7.5 is refused on the general path
    except (TypeError, ValueError, RuntimeError):  # ragged, None entries, or one tensor per intervention
        pass
    if not all(isinstance(entry, torch.Tensor) for entry in side) or len({entry.shape for entry in side}) != 1:
        return None
    return torch.stack(side).long()


# --- the hook ------------------------------------------------------------------------------------------------

def _hook(plan: Plan, step: Step):
    number, index, intervention = step.number, step.index, step.intervention

    def apply_intervention(module, args, kwargs, output):
        call = plan.call
        if call is None:
            return None
        if call.generating:  # pyvene's hook_callback: skip the prompt, or all but the prompt
            is_prompt = not call.seen[number]
            if is_prompt:
                call.seen[number] = True
            if call.on_prompt ^ is_prompt:
                return None
        value = output[0] if isinstance(output, tuple) else output
        if torch.compiler.is_compiling():
            # traced (a compiled decoding step): the indices are made in the graph, where they cost nothing,
            # and kept nowhere: a tensor the graph made and Python kept would be read by the next step as an
            # input (a guard that changes once more), and under CUDA graphs after the replay that overwrote it
            indices = _indices(plan, call, index, value, intervention, keep=False)
        else:
            indices = call.indices[index]
            if indices is None or indices[0].device != value.device or indices[0].shape[-1] != value.shape[-1]:
                indices = call.indices[index] = _indices(plan, call, index, value, intervention)
        gathered, written, batch_index, as_operations = indices
        # pyvene gathers from a copy: gather saves its input for backward, which the write below changes
        selected = torch.gather(value.clone() if value.requires_grad else value, 1, gathered)
        intervened = intervention(selected, None, None) if as_operations is None else as_operations(selected)
        if (value.requires_grad or intervened.requires_grad) and _must_copy(plan, number, value):
            output = copy_first(output, _always)
            value = output[0] if isinstance(output, tuple) else output
            value[batch_index, written] = intervened
            return output
        value[batch_index, written] = intervened
        return None

    return apply_intervention


def _indices(plan: Plan, call: Call, index: int, value: torch.Tensor, intervention, keep: bool = True) -> tuple:
    """The hook's operands for one call; ``keep=False`` (traced): nothing is cached on the plan."""
    positions = call.positions[index]
    if positions.device != value.device:  # a layer on another device than the input's (device_map)
        positions = positions.to(value.device, non_blocking=True)
    batch = positions.shape[0]
    batch_index = plan.batch_indices.get((batch, value.device)) if keep else None
    if batch_index is None:
        batch_index = torch.arange(batch, device=value.device)[:, None]
        if keep:
            plan.batch_indices[batch, value.device] = batch_index
    written = positions[0] if call.use_fast else positions  # scatter_neurons' `pos` branch
    as_operations = operations(intervention, plan.pyreft_forms)
    return positions[..., None].expand(-1, -1, value.shape[-1]), written, batch_index, as_operations


def _must_copy(plan: Plan, number: int, value: torch.Tensor) -> bool:
    """``copy_on_write.must_copy``, asked once per hook and kind of output: whether a tensor aliases a saved one, or
    is a view autograd refuses writes to, follows from the operations that made it, fixed by the module, the
    shape, dtype and device (which pick the kernel) and whether saved-tensor hooks are on
    (``aliases_saved`` skips what they packed)."""
    if torch.compiler.is_compiling():  # a compiled graph is functional: an in-place write changes nothing
        return False  # it saved
    key = (number, value.shape, value.dtype, value.device, value.grad_fn is None,
           torch._C._autograd._top_saved_tensors_default_hooks(False) is not None)
    found = plan.aliasing.get(key)
    if found is None:
        found = plan.aliasing[key] = must_copy(value)
    return found


def _always(tensor: torch.Tensor) -> bool:
    return True
