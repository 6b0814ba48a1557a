"""Copy-on-write for pyvene's intervening hooks: the in-place write goes to a copy where writing into the tensor
itself would break autograd.

pyvene's scatter writes into the hooked tensor itself. Under ``sdpa`` attention the input of ``o_proj`` is a view
of the attention's output, which the attention saved for its backward: backward then fails with ``one of the
variables needed for gradient computation has been modified by an inplace operation``. ``writing_to_copies`` hands
pyvene a copy to write into, and the module that copy, where a predicate says so: ``must_copy`` (the tensor aliases
a saved one, ``aliases_saved``, or autograd refuses writes into the view, ``forbids_writes``), or always (the
gradient checkpointing fix's pre-hooks, whose input is the checkpoint's). ``fixes.hooks`` says when each applies;
the fast path asks ``must_copy`` itself.
"""

from __future__ import annotations

import copy
import functools
from typing import Any, Callable

import torch
from torch._C._autograd import CreationMeta, _get_creation_meta
from torch.utils._python_dispatch import is_traceable_wrapper_subclass


Predicate = Callable[[torch.Tensor], bool]


def never(tensor: torch.Tensor) -> bool:
    return False


def writing_to_copies(callback, *, inputs: Predicate = never, outputs: Predicate = never):
    """pyvene's intervening hook ``callback``, its in-place write going to a copy of the tensor it
    intervenes on where ``inputs`` (a pre-hook's) or ``outputs`` (a forward hook's) says so; the module
    then receives, or returns, the copy. pyvene writes into the first positional input, else the first
    keyword one; into the output, the first item of an output tuple, or the first value of a dict."""

    @functools.wraps(callback)
    def hook(module, args, kwargs, *output):
        if output:
            (value,) = output
            copied = copy_first(value, outputs)
            if copied is value:
                return callback(module, args, kwargs, value)
            result = callback(module, args, kwargs, copied)  # a hook around pyvene's may return its own
            return copied if result is None else result  # (tensor parallel's: the slice of what it wrote)
        if args:
            copied_args, copied_kwargs = copy_first(args, inputs), kwargs
        else:
            copied_args, copied_kwargs = args, copy_first(kwargs, inputs)
        if copied_args is args and copied_kwargs is kwargs:
            return callback(module, args, kwargs)
        result = callback(module, copied_args, copied_kwargs)
        return (copied_args, copied_kwargs) if result is None else result

    return hook


def copy_first(value: Any, needs_copy: Predicate) -> Any:
    """``value`` itself, or a copy with its first tensor (see ``writing_to_copies``) cloned."""
    if isinstance(value, torch.Tensor):
        return value.clone() if needs_copy(value) else value
    if isinstance(value, tuple) and value and isinstance(value[0], torch.Tensor) and needs_copy(value[0]):
        return (value[0].clone(), *value[1:])
    if isinstance(value, dict) and value:
        first = next(iter(value))
        if isinstance(value[first], torch.Tensor) and needs_copy(value[first]):
            copied = copy.copy(value)
            copied[first] = value[first].clone()
            return copied
    return value


#: How many autograd nodes ``aliases_saved`` reads, nearest first: the producing operation and what sits between
#: it and the hook (views; DeepSpeed ZeRO-3 passes a module's inputs through an autograd Function of its own).
NODES_SEARCHED = 8


def must_copy(tensor: torch.Tensor) -> bool:
    """Whether an in-place write into ``tensor`` would break autograd, so that the hook writes into a copy:
    it is a view autograd refuses writes to (``forbids_writes``), or it aliases a saved tensor."""
    return forbids_writes(tensor) or aliases_saved(tensor)


def forbids_writes(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a view autograd refuses in-place writes to: one made inside a custom
    ``autograd.Function`` (flex attention's compiled function returns one, and o_proj's input is a view of
    it: 'A view was created in no_grad mode and is being modified inplace ... inside a custom Function'),
    one of several views a function returned (``split``), or one made in no-grad or inference mode. Whether
    it requires grad does not matter: writing an intervention's output, which does, into it is refused."""
    return tensor._is_view() and _get_creation_meta(tensor) != CreationMeta.DEFAULT


def aliases_saved(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` shares its storage with a tensor that an operation among the last ``NODES_SEARCHED``
    that made it saved for its backward, so that writing into it in place makes backward fail. Operations
    that ran on it since are not seen: pyvene's hooks run as the tensor is made (a forward hook) or as it
    enters the module (a pre-hook)."""
    root = tensor if tensor._base is None else tensor._base
    if root.grad_fn is None:  # nothing recorded a backward: nothing saved it
        return False
    storage = _data_pointer(root)
    pending, seen = [root.grad_fn], set()
    while pending and len(seen) < NODES_SEARCHED:
        node = pending.pop(0)
        if node is None or node in seen:
            continue
        seen.add(node)
        for raw, name in _saved_names(type(node)):
            try:
                if _packed_by_hooks(node, raw):
                    # Saved under someone's saved-tensor hooks (checkpointing, offloading): reading it would
                    # unpack it, recomputing the checkpointed layer in the forward (test_plan measured the
                    # checkpointed peak at 2.2 x). The region recomputes what it saved, hooks included.
                    continue
                saved = getattr(node, name)
            except RuntimeError:  # freed: a backward already ran through it, nothing is held any more
                continue
            for item in saved if isinstance(saved, (tuple, list)) else (saved,):
                if isinstance(item, torch.Tensor) and _data_pointer(item) == storage:
                    return True
        pending.extend(next_node for next_node, _ in node.next_functions)
    return False


def _data_pointer(tensor: torch.Tensor) -> int:
    """Where ``tensor``'s elements live. A wrapper subclass (tensor parallel's DTensor) has no storage of its
    own: its first inner tensor's (a DTensor's local shard), which an in-place write changes."""
    while is_traceable_wrapper_subclass(tensor):
        inner, _ = tensor.__tensor_flatten__()
        tensor = getattr(tensor, inner[0])
    return tensor.untyped_storage().data_ptr()


def _packed_by_hooks(node, raw_name: str) -> bool:
    raw = getattr(node, raw_name, None)  # the SavedTensor objects, read without unpacking
    return any(getattr(item, "unpack_hook", None) is not None
               for item in (raw if isinstance(raw, (tuple, list)) else (raw,)))


@functools.cache
def _saved_names(node_type: type) -> tuple[tuple[str, str], ...]:
    """(raw, unpacked) attribute names of what a node of ``node_type`` saved. A custom ``autograd.Function``
    saves through ``ctx.save_for_backward``: compiled functions (flex attention's, whose output a second
    intervened layer wrote in place: 'modified by an inplace operation ... CompiledFunctionBackward') and
    DeepSpeed's among them. Built-in nodes name each saved operand ``_saved_<name>``."""
    if issubclass(node_type, torch.autograd.function.BackwardCFunction):
        return (("_raw_saved_tensors", "saved_tensors"),)
    return tuple(("_raw" + name, name) for name in dir(node_type) if name.startswith("_saved_"))
