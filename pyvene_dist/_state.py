"""What the fixes keep about one pyvene model at run time: each fix its own part, found from the model.

A fix that keeps something per model declares the type in its record (``Fix(state=HookState)``): a class
made without arguments, whose ``close()`` undoes what it holds (hooks it registered, classes it swapped).
``MODELS.of(model, HookState)`` (``_registry.MODELS``) is that fix's part of ``model``'s state, made on first use;
``MODELS.get(model, HookState)`` reads it without making one. ``model`` is an
``IntervenableModel``, a ``ReftModel``, or a DataParallel replica of one (an object of its own, with a
state of its own). This module names no fix: it only keeps, finds and closes the parts.

Where it is kept: in the model's ``__dict__`` (``_pyvene_dist_states``), because torch.compile traces the
lookup. A process-wide weak map made dynamo guard on the position of the model among the map's keys,
and a compile during which another model was collected failed building that guard (``IndexError``).
Whatever copies a model's ``__dict__`` (DataParallel's replicas, ``copy.copy``) carries the original's
entry, which is not the copy's: an entry answers only for the model it was made for. ``copy.deepcopy``
and pickling (``torch.save`` of a whole model) carry an empty dict instead of the state.

A part of a model that must find its model's state without knowing the model (``orthogonal``'s rotations)
is registered with ``add_part(part, model)`` and found with ``of_part(part, Kind)``: a map part -> model,
weak both ways, owned by the registry.

A state is closed (every part's ``close()``, newest first) when its model is garbage collected, and for
every model at once by ``unpatch()``, which also takes the entry off each model.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Iterator, TypeVar

import torch

T = TypeVar("T")
#: The attribute of a model's ``__dict__`` that holds its ``ModelState``.
ATTRIBUTE = "_pyvene_dist_states"


class ModelState:
    """One model's state: a fix's state type -> its object. Nothing here refers to the model itself (its
    finalizer holds the state until the model goes); ``owner`` is the model's ``id``."""

    __slots__ = ("owner", "parts", "__weakref__")

    def __init__(self, owner: int) -> None:
        self.owner = owner
        self.parts: dict[type, Any] = {}

    def __reduce__(self):  # copy.deepcopy and pickle: a copy of the model starts with no state
        return dict, ()

    def close(self) -> None:
        parts, self.parts = self.parts, {}
        for part in reversed(list(parts.values())):
            part.close()


def _owned(model) -> ModelState | None:
    states = model.__dict__.get(ATTRIBUTE)
    return states if type(states) is ModelState and states.owner == id(model) else None


class ModelStates:
    """Every model's state; the one of the process is ``_registry.MODELS``."""

    def __init__(self) -> None:
        #: model -> the finalizer that closes its state: the models that have one, for ``close_all``.
        self._finalizers: "weakref.WeakKeyDictionary[Any, weakref.finalize]" = weakref.WeakKeyDictionary()
        #: part of a model -> a weak reference to that model (``add_part``); kept through ``close_all``.
        self._parts: "weakref.WeakKeyDictionary[Any, weakref.ref]" = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def of(self, model, kind: type[T]) -> T:
        """``model``'s part of type ``kind``, made (and closed when the model is collected) on first use."""
        states = _owned(model)
        if states is None:
            states = self._adopt(model)
        part = states.parts.get(kind)
        if part is None:
            part = states.parts[kind] = kind()
        return part

    def get(self, model, kind: type[T]) -> T | None:
        """``model``'s part of type ``kind``, or None where none was made."""
        states = _owned(model)
        return None if states is None else states.parts.get(kind)

    @torch.compiler.disable  # a finalizer is made eagerly; a traced call finds the state made already
    def _adopt(self, model) -> ModelState:
        with self._lock:  # DataParallel's replicas run in threads of their own
            states = _owned(model)
            if states is None:  # none yet, or a copy's entry, which is not its own
                states = model.__dict__[ATTRIBUTE] = ModelState(id(model))
                finalizer = weakref.finalize(model, states.close)
                finalizer.atexit = False  # at exit, nothing is left to undo
                self._finalizers[model] = finalizer
            return states

    def add_part(self, part, model) -> None:
        """Let ``part`` (an object of ``model``, which does not know it) find ``model``'s state: ``of_part``.
        The relation outlives ``unpatch()`` (it holds neither object), so a later ``patch()`` can restore
        what the state held: ``parts()``."""
        self._parts[part] = weakref.ref(model)

    def of_part(self, part, kind: type[T]) -> T | None:
        """The part of type ``kind`` of the model ``part`` was added for (``add_part``), or None: not added,
        its model collected, or no such part (none made, or closed by ``unpatch()``)."""
        ref = self._parts.get(part)
        model = ref() if ref is not None else None
        return self.get(model, kind) if model is not None else None

    def parts(self) -> list[tuple[Any, Any]]:
        """Every (part, model) added whose model is alive."""
        pairs = [(part, ref()) for part, ref in list(self._parts.items())]
        return [(part, model) for part, model in pairs if model is not None]

    def __len__(self) -> int:
        """How many live models have a state."""
        return sum(_owned(model) is not None for model in list(self._finalizers.keys()))

    def all(self, kind: type[T]) -> Iterator[T]:
        """Every live model's part of type ``kind``."""
        for model in list(self._finalizers.keys()):
            part = self.get(model, kind)
            if part is not None:
                yield part

    def close_all(self) -> None:
        """Close every state and take it off its model (``unpatch()``): later use starts afresh."""
        with self._lock:
            finalizers, self._finalizers = self._finalizers, weakref.WeakKeyDictionary()
        for model, finalizer in list(finalizers.items()):
            finalizer.detach()
            states = _owned(model)
            if states is not None:
                del model.__dict__[ATTRIBUTE]
                states.close()
