"""Remove only pyvene's own hooks, never anyone else's; keep the intervening ones when backward needs them.

``IntervenableModel._cleanup_states`` runs at the start and end of every ``forward`` and ``generate``
and calls ``remove_forward_hooks(self.model)``, which pops *every* forward and pre-forward hook of
every module of the base model. DeepSpeed ZeRO-3 and FSDP2 gather and free parameters in such hooks;
profilers and users keep theirs there too. After one pyvene forward they are silently gone.

The fix records the handles pyvene's hook factories (``_intervention_getter``,
``_intervention_setter``) return in the model's state (``REGISTRY.models.of(model).handles``), and
``_remove_forward_hooks`` removes exactly those. The state is found from the model object, so
``nn.DataParallel`` replicas (shallow copies) keep their own; ``unpatch()`` removes what is left.

``setters_kept_alive(model)`` is for ``fixes.gradient_checkpointing``: inside it, the handles of the hooks that
*apply* interventions are handed to the caller instead of to pyvene, which would remove them when its
forward returns, before backward recomputes checkpointed layers; the caller may also replace the hooks
themselves as they are registered (``wrap_hook``).

Checked on pyvene 0.1.8 with torch 2.11 and 2.13.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Iterator

from .._registry import REGISTRY, Fix, Site

_BASE = "pyvene.models.intervenable_base"
FIX = Fix(
    __name__,
    sites=(
        Site(f"{_BASE}:IntervenableModel._intervention_getter", "_wrap_hook_factory"),
        Site(f"{_BASE}:IntervenableModel._intervention_setter", "_wrap_setter_factory"),
        Site(f"{_BASE}:IntervenableModel._remove_forward_hooks", "_wrap_remove_forward_hooks", kind="replace",
             fingerprint="f76d928fd9d68878"),
    ),
    upstream=("pyvene",),
    checked={"pyvene": "==0.1.8"},
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


@contextlib.contextmanager
def setters_kept_alive(model, wrap_hook: Callable | None = None) -> Iterator[Kept]:
    kept = Kept(wrap_hook=wrap_hook)
    state = REGISTRY.models.of(model)
    state.kept = kept
    try:
        yield kept
    except BaseException:
        kept.remove()
        raise
    finally:
        state.kept = None


def keeping(model) -> Kept | None:
    state = REGISTRY.models.get(model)
    return None if state is None else state.kept


def _wrap_hook_factory(wrapped, instance, args, kwargs):
    handler_list = wrapped(*args, **kwargs)
    REGISTRY.models.of(instance).handles.extend(handler_list.handlers)
    return handler_list


def _wrap_setter_factory(wrapped, instance, args, kwargs):
    kept = keeping(instance)
    if kept is None:
        return _wrap_hook_factory(wrapped, instance, args, kwargs)
    handler_list = wrapped(*args, **kwargs)
    if kept.wrap_hook is not None:
        for handle in handler_list.handlers:
            hooks = handle.hooks_dict_ref()
            if hooks is not None and handle.id in hooks:
                hooks[handle.id] = kept.wrap_hook(hooks[handle.id])
    kept.handles.extend(handler_list.handlers)
    return type(handler_list)([])  # what pyvene removes when its forward returns: nothing


def _wrap_remove_forward_hooks(wrapped, instance, args, kwargs):
    state = REGISTRY.models.get(instance)
    if state is None:
        return
    handles, state.handles = state.handles, []
    for handle in handles:
        handle.remove()
