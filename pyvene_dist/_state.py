"""What the fixes know about one pyvene model at run time, kept in one object found from the model.

``REGISTRY.models.of(model)`` is the ``ModelState`` of ``model`` (an ``IntervenableModel``, a
``ReftModel``, or a DataParallel replica of one: a replica is an object of its own, with a state of
its own), created on first use; ``REGISTRY.models.get(model)`` reads it without creating one.
The map holds models weakly: a state never keeps its model alive, and nothing is written on the model.

A part of a model that must find its model's state without knowing the model (``orthogonal``'s
rotations, torch modules that pyvene's interventions hold) is registered with ``REGISTRY.models.add_part``
and found with ``REGISTRY.models.of_part(part)``: a map part -> model owned by the registry, weak both
ways (nothing is written on the part, and the part keeps neither the state nor the model alive).

A state is torn down (``ModelState.close``: the hooks it registered removed, the rotations it adopted
given torch's class back, what it holds dropped) when its model is garbage collected and when
``unpatch()`` runs, for every model at once.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from typing import Any, Iterator


@dataclasses.dataclass(eq=False)
class ModelState:
    """One pyvene model's runtime state, a field per fix that keeps some. Nothing here refers to the model
    itself (its finalizer holds the state until the model goes)."""

    #: ``hooks``: the handles of the hooks pyvene registered on the model's modules, removed at cleanup.
    handles: list = dataclasses.field(default_factory=list)
    #: ``hooks``: while a checkpointing training forward runs, its intervening hooks (``hooks.Kept``).
    kept: Any = None
    #: ``gradient_checkpointing``: forwards whose intervening hooks are kept for backward's recomputation (held
    #: by what can recompute them, weakly here).
    pending: "weakref.WeakSet" = dataclasses.field(default_factory=weakref.WeakSet)
    #: ``fsdp``: intervention parameter -> the handle of its gradient-averaging hook.
    reduced: "weakref.WeakKeyDictionary" = dataclasses.field(default_factory=weakref.WeakKeyDictionary)
    #: ``data_parallel``: for a replica, its device (its weights are plain tensors that cannot say).
    replica_device: Any = None
    #: ``data_parallel``: the names from the base model down to its first parameter (``get_device``).
    first_parameter: Any = None
    #: ``data_parallel``: the signature of the model's ``forward`` (scatter binds its arguments to it).
    forward_signature: Any = None
    #: ``data_parallel``: intervention key -> the name of the module its hook sits on.
    hooked_module_names: Any = None
    #: ``data_parallel``: devices whose Householder product was initialised from the calling thread.
    warmed_devices: set = dataclasses.field(default_factory=set)
    #: ``tensor_parallel``: whether the base model holds DTensor parameters (None: not looked yet).
    dtensor_parameters: Any = None
    #: ``orthogonal``: each torch orthogonal parametrization adopted for this model -> torch's class, which
    #: it is given back at close (its class is ``ReftOrthogonal`` while patched).
    rotations: "weakref.WeakKeyDictionary" = dataclasses.field(default_factory=weakref.WeakKeyDictionary)
    #: ``fast_path``: the plan its calls run on (``fast_path.Plan``; its hooks are removed at close).
    plan: Any = None
    #: ``orthogonal``: rotation -> its captured CUDA graphs (and their memory pool).
    graphs: "weakref.WeakKeyDictionary" = dataclasses.field(default_factory=weakref.WeakKeyDictionary)

    def close(self) -> None:
        """Remove every hook this state registered, give the adopted rotations torch's class back and drop
        what it holds."""
        handles, self.handles = self.handles, []
        for handle in handles:
            handle.remove()
        if self.plan is not None:
            self.plan.remove()
        self.plan = None
        for kept in [self.kept, *self.pending]:  # hooks.Kept, then checkpointing.Forward objects
            if kept is not None:
                kept.remove()
        self.kept = None
        self.pending = weakref.WeakSet()
        for handle in list(self.reduced.values()):
            handle.remove()
        self.reduced = weakref.WeakKeyDictionary()
        self.replica_device = None
        self.forward_signature = None
        self.first_parameter = None
        self.hooked_module_names = None
        self.dtensor_parameters = None
        self.warmed_devices = set()
        for rotation, torchs in list(self.rotations.items()):
            if type(rotation) is not torchs:
                rotation.__class__ = torchs
        self.rotations = weakref.WeakKeyDictionary()
        self.graphs = weakref.WeakKeyDictionary()


class ModelStates:
    """model -> ``ModelState``, held weakly by the model; owned by the registry (``REGISTRY.models``)."""

    def __init__(self) -> None:
        self._states: "weakref.WeakKeyDictionary[Any, ModelState]" = weakref.WeakKeyDictionary()
        self._finalizers: "weakref.WeakKeyDictionary[Any, weakref.finalize]" = weakref.WeakKeyDictionary()
        #: part of a model -> a weak reference to that model (``add_part``); kept through ``close_all``.
        self._parts: "weakref.WeakKeyDictionary[Any, weakref.ref]" = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()  # DataParallel's replicas run in threads of their own

    def of(self, model) -> ModelState:
        """The state of ``model``, created (and closed when the model is collected) on first use."""
        state = self._states.get(model)
        if state is not None:
            return state
        with self._lock:
            state = self._states.get(model)
            if state is None:
                state = self._states[model] = ModelState()
                finalizer = weakref.finalize(model, state.close)
                finalizer.atexit = False  # at exit, nothing is left to undo
                self._finalizers[model] = finalizer
            return state

    def get(self, model) -> ModelState | None:
        """The state of ``model``, or None if no fix kept any for it."""
        return self._states.get(model)

    def add_part(self, part, model) -> None:
        """Let ``part`` (an object of ``model``, which does not know it) find ``model``'s state: ``of_part``.
        The relation outlives ``unpatch()`` (it holds neither object), so a later ``patch()`` can restore
        what the state held: ``parts()``."""
        self._parts[part] = weakref.ref(model)

    def of_part(self, part) -> ModelState | None:
        """The state of the model ``part`` was added for (``add_part``), or None: not added, its model
        collected, or no state since ``unpatch()``."""
        ref = self._parts.get(part)
        model = ref() if ref is not None else None
        return self._states.get(model) if model is not None else None

    def parts(self) -> list[tuple[Any, Any]]:
        """Every (part, model) added whose model is alive."""
        pairs = [(part, ref()) for part, ref in list(self._parts.items())]
        return [(part, model) for part, model in pairs if model is not None]

    def __len__(self) -> int:
        return len(self._states)

    def __iter__(self) -> Iterator[ModelState]:
        return iter(list(self._states.values()))

    def close_all(self) -> None:
        """Close every state and forget it (``unpatch()``): later use starts afresh."""
        with self._lock:
            states, finalizers = list(self._states.values()), list(self._finalizers.values())
            self._states, self._finalizers = weakref.WeakKeyDictionary(), weakref.WeakKeyDictionary()
        for finalizer in finalizers:
            finalizer.detach()
        for state in states:
            state.close()
