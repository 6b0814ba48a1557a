"""The fast path's per-call half (``fixes.fast_path``): one call's locations as index tensors (``Call``), and the
hook each step of a plan registers once, which intervenes with them while a call runs."""

from __future__ import annotations

import dataclasses
import sys
import types
from typing import TYPE_CHECKING

import torch

from .locations import check_intervention_dtypes

if TYPE_CHECKING:
    from .fast_path import Plan, Step


@dataclasses.dataclass(eq=False)
class Call:
    """One forward's (or one generate's) locations, set on the plan while the base model runs."""

    positions: list  # per intervention (``sorted_keys`` order): int64 [batch, positions]
    use_fast: bool  # pyvene's flag: the write takes row 0 of the positions for the whole batch
    #: per intervention, on the hooked output's device: the gather's index (the positions expanded over the
    #: last dimension), the positions of the write, the batch index, and the intervention's operations
    #: (``_operations``) or None; made at the hook's first use.
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
        gathered, written, batch_index, operations = indices
        # pyvene gathers from a copy: gather saves its input for backward, which the write below changes
        selected = torch.gather(value.clone() if value.requires_grad else value, 1, gathered)
        intervened = intervention(selected, None, None) if operations is None else operations(selected)
        if (value.requires_grad or intervened.requires_grad) and _must_copy(plan, number, value):
            from .hooks import _copy_first

            output = _copy_first(output, _always)
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
    operations = _operations(intervention)
    return positions[..., None].expand(-1, -1, value.shape[-1]), written, batch_index, operations


# --- pyreft's interventions as the operations they run -----------------------------------------------------

def _operations(intervention):
    """The forward of LoReFT (pyreft's default intervention) or DiReFT as the torch operations it runs, in
    its order, on its own parameters: the same outputs and gradients, bit for bit, without the module calls
    it makes (five for LoReFT) and LoReFT's second read of its parametrized rotation. That is about 45 of
    the 66 Python calls a LoReFT application costs, and in every-token generation 4 applications make most
    of what a token costs over the bare model's (``benchmarks/calls.py``).

    None, and the module is called, wherever the call could do something else: another type or a subclass
    (FSDP2's ``fully_shard`` makes one), a forward that is not pyreft 0.1.0's, one set on an instance, a
    hook on any of its modules (DeepSpeed ZeRO-3 gathers parameters in one) or a global one, an in-place
    dropout, a jit trace (module calls record scopes: ``Module._call_impl`` calls ``_slow_forward`` where
    ``torch._C._is_tracing()``, the test asked here; torch 2.15 asks it, 2.11-2.14 asked ``_get_tracing_state()``,
    which agrees with it there) or a compiled graph (where module calls cost nothing at run time)."""
    reft = sys.modules.get("pyreft.interventions")
    kind = type(intervention)
    form = _FORMS.get(kind.__name__)
    if reft is None or form is None or kind is not getattr(reft, kind.__name__) or torch.compiler.is_compiling() \
            or torch._C._is_tracing() or _global_hooks() \
            or not _written_from(kind.forward, f"{kind.__name__}.forward"):
        return None
    rotate, source, act, dropout = (intervention.rotate_layer, intervention.learned_source, intervention.act_fn,
                                    intervention.dropout)
    if type(source) is not torch.nn.Linear or type(dropout) is not torch.nn.Dropout or dropout.inplace \
            or not all(_plain(module) for module in (intervention, rotate, source, dropout)) \
            or isinstance(act, torch.nn.Module) and not _plain(act):  # a function (torch.relu) is called as is
        return None
    from transformers.activations import LinearActivation

    activation = None if type(act) is LinearActivation else act  # pyreft's default act_fn returns its input
    return form(reft, rotate, source, activation, dropout)


def _loreft(reft, rotate, source, act, dropout):
    """LoreftIntervention.forward, LowRankRotateLayer.forward, Linear.forward, Dropout.forward."""
    if type(rotate).forward is not reft.LowRankRotateLayer.forward \
            or not _written_from(reft.LowRankRotateLayer.forward, "LowRankRotateLayer.forward"):
        return None

    def loreft(base):
        weight = rotate.weight  # one read: the fast path's parametrize.cached() returns the same tensor twice
        rotated_base = torch.matmul(base.to(weight.dtype), weight)
        learned = torch.nn.functional.linear(base, source.weight, source.bias)
        output = base + torch.matmul((learned if act is None else act(learned)) - rotated_base, weight.T)
        return torch.dropout(output.to(base.dtype), dropout.p, dropout.training)  # F.dropout's operation

    return loreft


def _direft(reft, rotate, source, act, dropout):
    """DireftIntervention.forward (its rotation's weight is read, its module not called), Linear.forward,
    Dropout.forward."""
    def direft(base):
        cast_base = base.to(source.weight.dtype)
        learned = torch.nn.functional.linear(cast_base, source.weight, source.bias)
        weight = rotate.weight
        output = base + torch.matmul((learned if act is None else act(learned)).to(weight.dtype), weight.T)
        return torch.dropout(output.to(base.dtype), dropout.p, dropout.training)

    return direft


_FORMS = {"LoreftIntervention": _loreft, "DireftIntervention": _direft}


#: The sources (``_records.fingerprint``) of pyreft 0.1.0's forwards that ``_operations`` runs the operations of.
WRITTEN_FROM = {"LoreftIntervention.forward": "e9e62508e54a2da7", "LowRankRotateLayer.forward": "de17864e332a5964",
                "DireftIntervention.forward": "7b42ef83fe824f81"}
_same_source: dict = {}  # function -> whether it is a plain function with the source of its WRITTEN_FROM


def _written_from(function, name: str) -> bool:
    """Whether ``function`` is still pyreft's own: a plain function (not wrapped, as a tracer or a user's
    patch may) whose source is the one ``_operations`` was written from."""
    if type(function) is not types.FunctionType:  # first: a wrapt proxy hashes and compares as what it wraps
        return False
    same = _same_source.get(function)
    if same is None:
        from .._records import fingerprint

        try:
            same = fingerprint(function) == WRITTEN_FROM[name]
        except (TypeError, OSError):  # no source to read
            same = False
        _same_source[function] = same
    return same


def _plain(module: torch.nn.Module) -> bool:
    """Whether calling ``module`` runs its class's ``forward`` and nothing else (``Module._call_impl``'s own
    test, with a ``forward`` set on the instance)."""
    return not (module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks or "forward" in module.__dict__)


def _global_hooks() -> bool:
    from torch.nn.modules import module

    return bool(module._global_forward_hooks or module._global_forward_pre_hooks or module._global_backward_hooks
                or module._global_backward_pre_hooks)


def _must_copy(plan: Plan, number: int, value: torch.Tensor) -> bool:
    """``hooks.must_copy``, asked once per hook and kind of output: whether a tensor aliases a saved one, or
    is a view autograd refuses writes to, follows from the operations that made it, fixed by the module, the
    shape, dtype and device (which pick the kernel) and whether saved-tensor hooks are on
    (``aliases_saved`` skips what they packed)."""
    if torch.compiler.is_compiling():  # a compiled graph is functional: an in-place write changes nothing
        return False  # it saved
    key = (number, value.shape, value.dtype, value.device, value.grad_fn is None,
           torch._C._autograd._top_saved_tensors_default_hooks(False) is not None)
    found = plan.aliasing.get(key)
    if found is None:
        from .hooks import must_copy

        found = plan.aliasing[key] = must_copy(value)
    return found


def _always(tensor: torch.Tensor) -> bool:
    return True
