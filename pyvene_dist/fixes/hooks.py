"""Remove only pyvene's own hooks, never anyone else's; keep the intervening ones when backward needs them.

``IntervenableModel._cleanup_states`` runs at the start and end of every ``forward`` and ``generate``
and calls ``remove_forward_hooks(self.model)``, which pops *every* forward and pre-forward hook of
every module of the base model. DeepSpeed ZeRO-3 and FSDP2 gather and free parameters in such hooks;
profilers and users keep theirs there too. After one pyvene forward they are silently gone.

The fix records the handles pyvene's hook factories (``_intervention_getter``,
``_intervention_setter``) return in the model's state (``HookState.handles``), and
``_remove_forward_hooks`` removes exactly those. The state is found from the model object, so
``nn.DataParallel`` replicas (shallow copies) keep their own; ``unpatch()`` removes what is left.

``setters_kept_alive(model)`` is for ``fixes.gradient_checkpointing``: inside it, the handles of the hooks that
*apply* interventions are handed to the caller instead of to pyvene, which would remove them when its
forward returns, before backward recomputes checkpointed layers; the caller may also replace the hooks
themselves as they are registered (``wrap_hook``).

The hooks that apply interventions also write into a copy where pyvene's in-place write would change a
tensor autograd saved. pyvene's scatter writes into the hooked tensor itself. Under ``sdpa`` attention
the input of ``o_proj`` (``attention_value_output``, ``head_attention_value_output``) is a view of
the attention's output: ``transpose(1, 2).contiguous()`` copies nothing, as the CPU and CUDA kernels
lay the output out as ``[batch, positions, heads, head size]``, and the attention saved that output
for its backward. With an intervention at an earlier layer (so that the attention records its
backward) training fails in backward with ``one of the variables needed for gradient computation has
been modified by an inplace operation: [torch.FloatTensor [4, 4, 16, 16]], which is output 0 of
ScaledDotProductFlashAttentionForCpu``. The hook then hands pyvene a copy to write into and the module
that copy (``writing_to_copies``), which changes neither outputs nor gradients. Whether the tensor aliases
a saved one is read from the few autograd nodes that made it (``aliases_saved``: the sdpa node behind the
views, also behind the autograd Function DeepSpeed ZeRO-3 puts around a module's inputs, and flex
attention's compiled function, which keeps what it saved in ``saved_tensors``). The hook copies too where
autograd refuses writes into the view it is handed (``forbids_writes``: under flex attention on a GPU,
o_proj's input is a view of the compiled function's output). A tensor that aliases nothing saved (eager
attention's copy, a linear layer's output) is written in place as before: no copy; the check costs some
15-25 us per intervention and forward on a CPU.

An intervention at ``attention_weight`` (GPT-2's attention probabilities, the input of the module
``attn.attn_dropout``) is refused where the model never calls that module, which stock pyvene silently
left without an intervention (the matrix found it: training then failed with ``element 0 of tensors
does not require grad``, inference was silently the base model's). ``sdpa``, flash and flex attention
never compute the probabilities, and transformers 5's eager attention drops them out with
``nn.functional.dropout``: the module runs only in ``reorder_and_upcast_attn=True``'s path.

Checked on pyvene 0.1.8 with torch 2.11 and 2.13.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
from typing import Any, Callable, Iterator

import torch
from torch._C._autograd import CreationMeta, _get_creation_meta

from .._records import Fix, Site
from .._registry import REGISTRY

_BASE = "pyvene.models.intervenable_base"
FIX = Fix(
    __name__,
    sites=(
        Site(f"{_BASE}:IntervenableModel._intervention_getter", "_wrap_hook_factory"),
        Site(f"{_BASE}:IntervenableModel._intervention_setter", "_wrap_setter_factory"),
        Site(f"{_BASE}:IntervenableModel._remove_forward_hooks", "_wrap_remove_forward_hooks", kind="replace"),
    ),
    state="HookState",
    upstream=("pyvene",),
)


@dataclasses.dataclass
class Kept:
    """Intervening hooks a forward registered, and the source activations they read, for backward."""

    handles: list = dataclasses.field(default_factory=list)
    activations: dict = dataclasses.field(default_factory=dict)
    #: Applied to each intervening hook when it is registered (its replacement is what the module calls).
    wrap_hook: Callable | None = None

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        self.activations = {}


@dataclasses.dataclass(eq=False)
class HookState:
    """A model's hooks that pyvene registered (removed by pyvene's ``_remove_forward_hooks``, and at close), and
    while a checkpointing training forward runs, its intervening hooks."""

    handles: list = dataclasses.field(default_factory=list)
    kept: Kept | None = None

    def close(self) -> None:
        handles, self.handles = self.handles, []
        for handle in handles:
            handle.remove()
        if self.kept is not None:
            self.kept.remove()
        self.kept = None


@contextlib.contextmanager
def setters_kept_alive(model, wrap_hook: Callable | None = None) -> Iterator[Kept]:
    kept = Kept(wrap_hook=wrap_hook)
    state = REGISTRY.models.of(model, HookState)
    state.kept = kept
    try:
        yield kept
    except BaseException:
        kept.remove()
        raise
    finally:
        state.kept = None


def keeping(model) -> Kept | None:
    state = REGISTRY.models.get(model, HookState)
    return None if state is None else state.kept


def _wrap_hook_factory(wrapped, instance, args, kwargs):
    handler_list = wrapped(*args, **kwargs)
    REGISTRY.models.of(instance, HookState).handles.extend(handler_list.handlers)
    return handler_list


#: GPT-2's attention probabilities: computed by its module under eager attention only (see the docstring).
ATTENTION_PROBABILITIES = "attention_weight"


def _wrap_setter_factory(wrapped, instance, args, kwargs):
    _refuse_components_never_computed(instance, args[0] if args else kwargs["keys"])
    handler_list = wrapped(*args, **kwargs)
    kept = keeping(instance)
    for handle in handler_list.handlers:
        hooks = handle.hooks_dict_ref()
        if hooks is not None and handle.id in hooks:
            hook = writing_to_copies(hooks[handle.id], inputs=must_copy, outputs=must_copy)
            hooks[handle.id] = kept.wrap_hook(hook) if kept is not None and kept.wrap_hook is not None else hook
    if kept is None:
        REGISTRY.models.of(instance, HookState).handles.extend(handler_list.handlers)
        return handler_list
    kept.handles.extend(handler_list.handlers)
    return type(handler_list)([])  # what pyvene removes when its forward returns: nothing


def _refuse_components_never_computed(model, keys) -> None:
    for key in keys:
        if model.representations[key].component == ATTENTION_PROBABILITIES:
            why = _why_attention_probabilities_are_not_computed(getattr(model.model, "config", None))
            if why:
                raise ValueError(f"intervention {key!r} is at component {ATTENTION_PROBABILITIES!r}, which this "
                                 f"model never computes, so it would never apply: {why}")


def _why_attention_probabilities_are_not_computed(config) -> str | None:
    attention = getattr(config, "_attn_implementation", None) or "eager"
    if attention != "eager":
        return (f"the model's attn_implementation is {attention!r}, expected 'eager' (load the model with "
                "attn_implementation='eager')")
    import transformers

    if int(transformers.__version__.split(".")[0]) >= 5 and not getattr(config, "reorder_and_upcast_attn", False):
        return (f"transformers {transformers.__version__}'s eager attention applies dropout as a function and "
                "calls attn.attn_dropout only with config.reorder_and_upcast_attn=True, found False")
    return None


Predicate = Callable[[torch.Tensor], bool]


def _never(tensor: torch.Tensor) -> bool:
    return False


def writing_to_copies(callback, *, inputs: Predicate = _never, outputs: Predicate = _never):
    """pyvene's intervening hook ``callback``, its in-place write going to a copy of the tensor it
    intervenes on where ``inputs`` (a pre-hook's) or ``outputs`` (a forward hook's) says so; the module
    then receives, or returns, the copy. pyvene writes into the first positional input, else the first
    keyword one; into the output, the first item of an output tuple, or the first value of a dict."""

    @functools.wraps(callback)
    def hook(module, args, kwargs, *output):
        if output:
            (value,) = output
            copied = _copy_first(value, outputs)
            if copied is value:
                return callback(module, args, kwargs, value)
            result = callback(module, args, kwargs, copied)  # a hook around pyvene's may return its own
            return copied if result is None else result  # (tensor parallel's: the slice of what it wrote)
        if args:
            copied_args, copied_kwargs = _copy_first(args, inputs), kwargs
        else:
            copied_args, copied_kwargs = args, _copy_first(kwargs, inputs)
        if copied_args is args and copied_kwargs is kwargs:
            return callback(module, args, kwargs)
        result = callback(module, copied_args, copied_kwargs)
        return (copied_args, copied_kwargs) if result is None else result

    return hook


def _copy_first(value: Any, needs_copy: Predicate) -> Any:
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
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

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


def _wrap_remove_forward_hooks(wrapped, instance, args, kwargs):
    state = REGISTRY.models.get(instance, HookState)
    if state is None:
        return
    handles, state.handles = state.handles, []
    for handle in handles:
        handle.remove()
