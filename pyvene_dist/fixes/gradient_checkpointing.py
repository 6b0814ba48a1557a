"""Interventions survive gradient checkpointing's recomputation, at every component, reentrant or not.

pyvene removes its hooks when ``forward`` returns; backward then recomputes checkpointed layers without
them. Interventions inside a checkpointed region (``mlp_output``, ``attention_output``, ``mlp_input``,
per-head components; with transformers 4.x, which checkpoints a layer's ``__call__``, ``block_output``
too) then fail: non-reentrant checkpointing with ``CheckpointError: torch.utils.checkpoint: A different
number of tensors was saved during the original forward and recomputation``, reentrant with
``RuntimeError: element 0 of tensors does not require grad and does not have a grad_fn`` (upstream
pyvene issue #231; this follows the approach of pyvene PR #242).

In a forward that will be differentiated (grad enabled, model in training mode) of a model that
checkpoints (transformers' ``gradient_checkpointing`` flag, as ``activation_checkpointing_enable`` and
``gradient_checkpointing_enable`` set it with a ``_gradient_checkpointing_func``, or torch's
``CheckpointWrapper`` as FSDP and accelerate apply it, with its ``checkpoint_fn``), the hooks that apply
interventions stay registered for the recomputation, and act only where that forward's interventions
belong:

- while the forward runs, its hooks act; for that time each checkpointing module's checkpoint function
  is one that checkpoints a *replay* of the layer: when backward recomputes the layer, the replay makes
  this forward the one whose hooks act (a ``ContextVar``), with the source activations it read. So each
  recomputation applies exactly the locations, subspaces and sources of the forward that recorded it,
  however many forwards ran before the backward;
- anywhere else the kept hooks do nothing: another pyvene forward (training, ``no_grad``, eval), the
  base model called directly (pyreft's DPO trainer runs its reference forward through ``model.model``),
  another forward's recomputation;
- they are removed when nothing can replay the forward any more: the replays hold a lease that torch's
  checkpoints keep with the graph (non-reentrant in its frames until backward frees them, reentrant on
  its node until the graph goes). After the backward that frees the graph, or with a graph dropped
  unused; a graph kept by ``retain_graph`` keeps them for its next backward. Until then they are
  pending in the model's state (``CheckpointingState.pending``), and ``unpatch()`` removes them.

In such a forward, an input component's hook (a pre-hook) writes into a copy of the module's input,
which the module then receives, instead of into the input itself: where a layer's ``__call__`` is
checkpointed (transformers 4.x and 5.x up to at least 5.17) that hook runs inside the checkpoint, and
its in-place write would land on the checkpoint's own input (see ``on_a_copy_of_the_input``). Outputs
and gradients are unchanged; the tensor the previous layer returned keeps its values.

Evaluation, ``torch.no_grad`` and failing forwards keep pyvene's immediate cleanup. A module flagged as
checkpointing without a checkpoint function to replace (transformers' format before 4.35, which calls
``torch.utils.checkpoint`` itself) is refused with an error naming it: its recomputation could not be
told apart from another forward's.
"""

from __future__ import annotations

import contextlib
import functools
import weakref

import torch
from pyvene.models.intervenable_base import IntervenableModel

from .._records import Fix, Site
from .._registry import MODELS
from ..mechanisms.checkpoint_functions import APPLYING, checkpoint_functions
from ..mechanisms.copy_on_write import writing_to_copies
from ..mechanisms.hook_handles import Kept, keeping, setters_kept_alive



class CheckpointingState:
    """A model's forwards whose intervening hooks are kept for backward's recomputation (held by what can
    recompute them, weakly here), removed at close."""

    def __init__(self) -> None:
        self.pending: "weakref.WeakSet[Forward]" = weakref.WeakSet()

    def close(self) -> None:
        pending, self.pending = list(self.pending), weakref.WeakSet()
        for forward in pending:
            forward.remove()
class Forward:
    """One training forward of a checkpointing model: its intervening hooks (``kept``), kept for the
    recomputation of its checkpointed layers and acting only in that forward and those recomputations."""

    def __init__(self, model):
        self.model = model  # the IntervenableModel (a DataParallel replica is a model of its own)
        self.kept: Kept | None = None  # set as the forward starts
        self.finished = False  # the forward has returned: a call of its hooks now is a recomputation

    def wrap(self, hook):
        hook = on_a_copy_of_the_input(hook)

        def applied_in_its_own_forward_only(module, args, kwargs, *output):
            if APPLYING.get() is not self:
                return None  # another forward, a base-model call, or no forward at all: leave the module be
            if not self.finished:
                return hook(module, args, kwargs, *output)
            live, self.model.activations = self.model.activations, self.kept.activations  # its sources
            try:
                return hook(module, args, kwargs, *output)
            finally:
                self.model.activations = live

        return applied_in_its_own_forward_only

    def remove(self) -> None:
        self.kept.remove()


class _Lease:
    """Held by what can still recompute a forward's layers: the functions torch's checkpoints replay (kept
    by the graph: non-reentrant in its frames until backward frees them, reentrant on its node). When
    none is left, the forward's hooks go."""

    __slots__ = ("forward", "__weakref__")

    def __init__(self, forward: Forward):
        self.forward = forward


def _wrap_forward(wrapped, instance, args, kwargs):
    if not (torch.is_grad_enabled() and instance.training):
        return wrapped(*args, **kwargs)
    functions = checkpoint_functions(instance.model)
    if not functions:
        return wrapped(*args, **kwargs)
    forward = Forward(instance)
    lease = _Lease(forward)
    applying = APPLYING.set(forward)
    try:
        with setters_kept_alive(instance, wrap_hook=forward.wrap) as forward.kept, \
                _replaying_in(functions, lease):
            output = wrapped(*args, **kwargs)
    finally:
        APPLYING.reset(applying)
    forward.finished = True
    # From here only the replays torch's checkpoints kept hold the lease: the hooks go when nothing can
    # recompute this forward any more (at once if no checkpoint kept a replay), or at unpatch().
    MODELS.of(instance, CheckpointingState).pending.add(forward)
    weakref.finalize(lease, forward.remove)
    return output


@contextlib.contextmanager
def _replaying_in(functions, lease: _Lease):
    """For the duration of the forward, each checkpointing module's checkpoint function checkpoints a
    function that, when backward replays it, makes this forward's hooks the ones that act."""
    swapped = []
    try:
        for owner, name in functions:
            checkpoint = owner.__dict__[name]
            owner.__dict__[name] = _checkpointing_with(checkpoint, lease)
            swapped.append((owner, name, checkpoint))
        yield
    finally:
        for owner, name, checkpoint in reversed(swapped):
            owner.__dict__[name] = checkpoint


def _checkpointing_with(checkpoint, lease: _Lease):
    def checkpoint_replaying_this_forward(function, *args, **kwargs):
        return checkpoint(functools.partial(_replay, lease, function), *args, **kwargs)

    return checkpoint_replaying_this_forward


def _replay(lease: _Lease, function, *args, **kwargs):
    forward = lease.forward
    if APPLYING.get() is forward:  # the forward itself
        return function(*args, **kwargs)
    applying = APPLYING.set(forward)
    try:
        return function(*args, **kwargs)
    finally:
        APPLYING.reset(applying)


def on_a_copy_of_the_input(callback):
    """pyvene's intervening hook ``callback`` with, when it runs as a pre-hook, its in-place write going to
    a copy of the module's input, which the module then receives instead.

    Where a layer's ``__call__`` is checkpointed (transformers 4.x, and 5.x up to at least 5.17), the
    pre-hook of ``block_input`` runs inside the checkpoint and would write into the checkpoint's input:
    the very tensor the recomputation starts from again (non-reentrant: ``modified by an inplace
    operation``), or a detached leaf (reentrant: ``a leaf Variable that requires grad is being used in
    an in-place operation``). A copy changes neither outputs nor gradients; the tensor the caller passed
    in is left as it was. Forward hooks (output components) are called unchanged."""
    return writing_to_copies(callback, inputs=_always)


def _always(tensor: torch.Tensor) -> bool:
    return True


def _wrap_output_validation(wrapped, instance, args, kwargs):
    kept = keeping(instance)
    if kept is not None:  # the last moment pyvene's source activations exist: cleanup clears them next
        kept.activations = dict(instance.activations)
    return wrapped(*args, **kwargs)


FIX = Fix(
    __name__,
    sites=(
        Site((IntervenableModel, "forward"), _wrap_forward),
        Site((IntervenableModel, "_output_validation"), _wrap_output_validation),
    ),
    requires=("hooks",),  # its kept setters are the hooks fix's record of pyvene's handles
    state=CheckpointingState,
    upstream=("pyvene",),
)
