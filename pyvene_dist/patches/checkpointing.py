"""Interventions survive gradient checkpointing's recomputation, at every component, reentrant or not.

pyvene removes its hooks when ``forward`` returns; backward then recomputes checkpointed layers without
them. Interventions inside a checkpointed region (``mlp_output``, ``attention_output``, ``mlp_input``,
per-head components; with transformers 4.x, which checkpoints a layer's ``__call__``, ``block_output``
too) then fail: non-reentrant checkpointing with ``CheckpointError: torch.utils.checkpoint: A different
number of tensors was saved during the original forward and recomputation``, reentrant with
``RuntimeError: element 0 of tensors does not require grad and does not have a grad_fn`` (upstream
pyvene issue #231; this follows the approach of pyvene PR #242).

In a forward that will be differentiated (grad enabled, model in training mode) of a model that
checkpoints (HF's ``gradient_checkpointing`` flag on any module, as ``activation_checkpointing_enable``
and transformers 4.x's ``gradient_checkpointing_enable`` set it, or torch's ``CheckpointWrapper`` as
FSDP and accelerate apply it), the hooks that apply interventions stay registered until that
forward's backward has finished: a grad hook on the outputs
(``torch.autograd.graph.register_multi_grad_hook``) queues their removal at the end of that backward
(``Variable._execution_engine.queue_callback``). Their closures hold the locations and subspaces, so
the recomputation applies exactly what the forward applied; source activations the intervention read
are put back for the backward. Hooks a forward left for a backward that never came are removed at the
next forward. Evaluation, ``torch.no_grad`` and failing forwards keep pyvene's immediate cleanup.

In such a forward, an input component's hook (a pre-hook) writes into a copy of the module's input,
which the module then receives, instead of into the input itself: where a layer's ``__call__`` is
checkpointed (transformers 4.x and 5.x up to at least 5.17) that hook runs inside the checkpoint, and
its in-place write would land on the checkpoint's own input (see ``on_a_copy_of_the_input``). Outputs
and gradients are unchanged; the tensor the previous layer returned keeps its values.

Limit: run each training forward's backward before the next training forward of the same model (as
HF Trainer, accelerate and every plain loop do, gradient accumulation included).

Checked on pyvene 0.1.8 with torch 2.11 and 2.13, transformers 5.17 and 5.24.
"""

from __future__ import annotations

import functools
import weakref

import torch

from . import hooks

SITES = (
    "pyvene.models.intervenable_base:IntervenableModel.forward",
    "pyvene.models.intervenable_base:IntervenableModel._output_validation",
)
_pending: "weakref.WeakKeyDictionary[object, hooks.Kept]" = weakref.WeakKeyDictionary()


def patch(registry) -> None:
    from pyvene.models.intervenable_base import IntervenableModel

    registry.wrap(IntervenableModel, "forward", _wrap_forward)
    registry.wrap(IntervenableModel, "_output_validation", _wrap_output_validation)


def _wrap_forward(wrapped, instance, args, kwargs):
    _release(instance)
    if not (torch.is_grad_enabled() and instance.training and checkpointing(instance.model)):
        return wrapped(*args, **kwargs)
    with hooks.setters_kept_alive(instance, wrap_hook=on_a_copy_of_the_input) as kept:
        output = wrapped(*args, **kwargs)
    differentiable = [t for t in _tensors(output) if t.requires_grad]
    if not (kept.handles and differentiable):
        kept.remove()
        return output
    _pending[instance] = kept

    def backward_started(grads) -> None:
        if kept.activations:
            instance.activations = kept.activations  # what the recomputed interventions read their sources from
        torch.autograd.Variable._execution_engine.queue_callback(lambda: _release(instance, kept))

    torch.autograd.graph.register_multi_grad_hook(differentiable, backward_started, mode="any")
    return output


def on_a_copy_of_the_input(callback):
    """pyvene's intervening hook ``callback`` with, when it runs as a pre-hook, its in-place write going to
    a copy of the module's input, which the module then receives instead.

    Where a layer's ``__call__`` is checkpointed (transformers 4.x, and 5.x up to at least 5.17), the
    pre-hook of ``block_input`` runs inside the checkpoint and would write into the checkpoint's input:
    the very tensor the recomputation starts from again (non-reentrant: ``modified by an inplace
    operation``), or a detached leaf (reentrant: ``a leaf Variable that requires grad is being used in
    an in-place operation``). A copy changes neither outputs nor gradients; the tensor the caller passed
    in is left as it was. Forward hooks (output components) are called unchanged."""

    @functools.wraps(callback)
    def hook(module, args, kwargs, *output):
        if output:
            return callback(module, args, kwargs, *output)
        if args:  # pyvene intervenes on the first positional input, else on the first keyword one
            args = (_copy(args[0]), *args[1:])
        elif kwargs:
            first = next(iter(kwargs))
            kwargs = {**kwargs, first: _copy(kwargs[first])}
        callback(module, args, kwargs)
        return args, kwargs

    return hook


def _copy(value):
    return value.clone() if isinstance(value, torch.Tensor) else value


def checkpointing(model) -> bool:
    """Whether some layer of ``model`` recomputes its forward during backward: a transformers layer with
    ``gradient_checkpointing`` set, or torch's ``CheckpointWrapper``.

    It runs at every training forward, over every module: an explicit stack over ``_modules`` and the
    instance's own ``__dict__`` cost a fifth of ``model.modules()`` (a generator per level of nesting)
    with ``getattr`` (``nn.Module.__getattr__``'s search for each module lacking the attribute)."""
    stack = [model]
    while stack:
        module = stack.pop()
        if module is None:  # a child slot registered empty
            continue
        flag = module.__dict__.get("gradient_checkpointing", _UNSET)
        if flag is _UNSET:
            flag = getattr(type(module), "gradient_checkpointing", False)
        if flag is True or type(module).__name__ == "CheckpointWrapper":
            return True
        stack.extend(module._modules.values())
    return False


_UNSET = object()


def _wrap_output_validation(wrapped, instance, args, kwargs):
    kept = hooks.keeping(instance)
    if kept is not None:  # the last moment pyvene's source activations exist: cleanup clears them next
        kept.activations = dict(instance.activations)
    return wrapped(*args, **kwargs)


def _release(instance, kept: hooks.Kept | None = None) -> None:
    pending = _pending.get(instance)
    if pending is not None and (kept is None or pending is kept):
        del _pending[instance]
        pending.remove()
        instance.activations = {}


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
