"""The handles of the hooks pyvene registers on a model, kept in the model's state (``HookState``).

``fixes.hooks`` records them as pyvene's hook factories return them, so that pyvene's ``_remove_forward_hooks``
removes exactly those; ``setters_kept_alive(model)`` is for ``fixes.gradient_checkpointing``: inside it, the
handles of the hooks that *apply* interventions are handed to the caller (``Kept``) instead of to pyvene, which
would remove them when its forward returns, before backward recomputes checkpointed layers; the caller may also
replace the hooks themselves as they are registered (``wrap_hook``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Iterator

from .._registry import MODELS


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
    state = MODELS.of(model, HookState)
    state.kept = kept
    try:
        yield kept
    except BaseException:
        kept.remove()
        raise
    finally:
        state.kept = None


def keeping(model) -> Kept | None:
    state = MODELS.get(model, HookState)
    return None if state is None else state.kept
