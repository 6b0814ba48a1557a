"""Remove only pyvene's own hooks, never anyone else's.

``IntervenableModel._cleanup_states`` runs at the start and end of every ``forward`` and ``generate``
and calls ``remove_forward_hooks(self.model)``, which pops *every* forward and pre-forward hook of
every module of the base model. DeepSpeed ZeRO-3 and FSDP2 gather and free parameters in such hooks;
profilers and users keep theirs there too. After one pyvene forward they are silently gone.

The fix records the handles pyvene's hook factories (``_intervention_getter``,
``_intervention_setter``) return, per model, and ``_remove_forward_hooks`` removes exactly those.
The record is keyed by the model object, so ``nn.DataParallel`` replicas (shallow copies) keep their own.

Checked on pyvene 0.1.8 with torch 2.11 and 2.13.
"""

from __future__ import annotations

import weakref

SITES = (
    "pyvene.models.intervenable_base:IntervenableModel._intervention_getter",
    "pyvene.models.intervenable_base:IntervenableModel._intervention_setter",
    "pyvene.models.intervenable_base:IntervenableModel._remove_forward_hooks",
)

_handles: "weakref.WeakKeyDictionary[object, list]" = weakref.WeakKeyDictionary()


def patch(registry) -> None:
    from pyvene.models.intervenable_base import IntervenableModel

    registry.wrap(IntervenableModel, "_intervention_getter", _wrap_hook_factory)
    registry.wrap(IntervenableModel, "_intervention_setter", _wrap_hook_factory)
    registry.wrap(IntervenableModel, "_remove_forward_hooks", _wrap_remove_forward_hooks)


def _wrap_hook_factory(wrapped, instance, args, kwargs):
    handler_list = wrapped(*args, **kwargs)
    _handles.setdefault(instance, []).extend(handler_list.handlers)
    return handler_list


def _wrap_remove_forward_hooks(wrapped, instance, args, kwargs):
    for handle in _handles.pop(instance, ()):
        handle.remove()
