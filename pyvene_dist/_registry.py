"""Everything pyvene_dist changes while patched, one object per job, and the one ``restore_all`` that undoes it.

- ``UNDO_LOG`` (``UndoLog``): every wrap, so that ``unpatch()`` puts back the very objects it found. A wrap is
  recorded as (owner, attribute, original, proxy): ``owner`` is the module or class whose ``__dict__`` defines the
  attribute, ``original`` is what that ``__dict__`` held (the raw function, ``staticmethod`` or ``classmethod``
  object, never a bound method), and ``proxy`` is the ``wrapt.FunctionWrapper`` put in its place. Restoring writes
  ``original`` back, in reverse order.
- ``IMPORT_HOOKS`` (``ImportHooks``): modules that may be imported after ``patch()`` (pyreft,
  ``transformers.trainer``) are patched right after their import, through ``_imports.ImportHook``, a finder on
  ``sys.meta_path`` while some are awaited; ``unpatch()`` takes it off, so ``sys.meta_path`` is as ``patch()``
  found it.
- ``MODELS`` (``_state.ModelStates``): what the fixes keep per pyvene model.
- ``APPLIED`` (``Applied``): whether patched, and the names of the fixes applied.
- ``OPTIONS`` (``CurrentOptions``): the ``Options`` ``patch()`` resolved, which the fixes read at run time.

``Fix.patch`` is handed the undo log and the import hooks; the fixes' code reads ``MODELS`` and ``OPTIONS``, and
asks whether a fix is applied through ``applied(name, by=FIX)``, which answers only for the fixes the asking
record declares (``requires``, ``after``). This is the one module of pyvene_dist that holds mutable module state.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import types
from typing import Any, Callable

import wrapt

from ._imports import ImportHook, is_importing
from ._options import Options
from ._state import ModelStates

_MISSING = object()


class FixError(RuntimeError):
    """A fix could not be applied; its message names the fix and the cause."""


def qualified_name(owner: Any) -> str:
    """``pyvene.models.intervenable_base.BaseModel`` for a class, the module name for a module."""
    if isinstance(owner, type):
        return f"{owner.__module__}.{owner.__qualname__}"
    return getattr(owner, "__name__", repr(owner))


@dataclasses.dataclass(frozen=True)
class Wrap:
    owner: Any
    attribute: str
    original: Any  # _MISSING for an attribute pyvene_dist added
    proxy: Any  # the wrapt.FunctionWrapper (or added attribute) now in place

    @property
    def name(self) -> str:
        return f"{qualified_name(self.owner)}.{self.attribute}"


def is_entry(value: Any) -> bool:
    """Whether ``value`` is a function a ``Site`` of kind ``entry`` put in place (``UndoLog.enter``)."""
    return getattr(value, "__pyvene_dist_entry__", False) is True


class _BoundMethodWrapper(wrapt.BoundFunctionWrapper):
    """A wrapped method bound to an instance, whose ``__func__`` calls through the wrapper.

    wrapt forwards ``__func__`` to the bound original, so code that rebinds a model's method from its
    function bypasses every wrap. accelerate does exactly that for native mixed precision (HF Trainer's
    ``--bf16``): ``model.forward = MethodType(autocast(model.forward.__func__), model)``. Under it the
    checkpointing fix never saw pyvene's forward, and a checkpointed layer's recomputation ran without
    the forward's interventions (torch's ``CheckpointError``, or wrong gradients).
    """

    @property
    def __func__(self):
        parent, original = self._self_parent, self.__wrapped__.__func__
        if self._self_binding != "function":  # a classmethod's: nothing rebinds those
            return original

        @functools.wraps(original)
        def through_the_wrapper(instance, *args, **kwargs):
            return parent.__get__(instance, type(instance))(*args, **kwargs)

        return through_the_wrapper


class _MethodWrapper(wrapt.FunctionWrapper):
    __bound_function_wrapper__ = _BoundMethodWrapper


def _not_defined(owner: Any, attribute: str) -> AttributeError:
    return AttributeError(f"{qualified_name(owner)} does not define {attribute!r} itself; pyvene_dist patches the "
                          "class that defines it. The installed version differs from the one this patch was written for.")


class UndoLog:
    """Every attribute pyvene_dist wrapped, replaced or added, with what was there before."""

    def __init__(self) -> None:
        self._sites: list[Wrap] = []

    @property
    def sites(self) -> tuple[Wrap, ...]:
        return tuple(self._sites)

    def find(self, owner: Any, attribute: str) -> Wrap | None:
        for site in self._sites:
            if site.owner is owner and site.attribute == attribute:
                return site
        return None

    def wrap(self, owner: Any, attribute: str, wrapper: Callable) -> None:
        """Replace ``owner.attribute`` with a ``wrapt.FunctionWrapper`` calling ``wrapper``, once.

        A second wrapper for the same attribute is refused: it would be skipped silently otherwise."""
        existing = self.find(owner, attribute)
        if existing is not None and is_entry(existing.proxy):
            raise FixError(f"{existing.name} holds an entry function already ({existing.proxy.__qualname__}); a wrap "
                           f"({wrapper.__qualname__}) must be applied before it: name the fix in the entry's `after`")
        if existing is not None:
            if getattr(existing.proxy, "_self_wrapper", wrapper) is not wrapper:
                raise FixError(f"{existing.name} is wrapped already by {existing.proxy._self_wrapper.__qualname__}; "
                               f"two fixes cannot both wrap it ({wrapper.__qualname__}): wrap another site")
            return
        original = vars(owner).get(attribute, _MISSING)
        if original is _MISSING:
            raise _not_defined(owner, attribute)
        proxy = _MethodWrapper(original, wrapper)
        setattr(owner, attribute, proxy)
        self._sites.append(Wrap(owner, attribute, original, proxy))

    def enter(self, owner: Any, attribute: str, make_entry: Callable[[Any], Callable]) -> None:
        """Put the plain function ``make_entry(current)`` in place of ``owner.attribute`` (``Site`` kind
        ``entry``), once per ``make_entry``: ``current`` is what the owner holds now, possibly another fix's wrap or
        entry (two fixes' entries stack, the later outside)."""
        current = vars(owner).get(attribute, _MISSING)
        held = current
        while is_entry(held):
            if held.__pyvene_dist_made_by__ is make_entry:
                return
            held = held.__wrapped__
        if current is _MISSING:
            raise _not_defined(owner, attribute)
        entry = make_entry(current)
        if not isinstance(entry, types.FunctionType):
            raise TypeError(f"the entry for {qualified_name(owner)}.{attribute} is {entry!r}, expected a plain function")
        functools.update_wrapper(entry, getattr(current, "__wrapped__", current))
        entry.__wrapped__, entry.__pyvene_dist_entry__ = current, True  # inspect.signature follows __wrapped__
        entry.__pyvene_dist_made_by__ = make_entry
        setattr(owner, attribute, entry)
        self._sites.append(Wrap(owner, attribute, current, entry))

    def add(self, owner: Any, attribute: str, value: Any) -> None:
        """Give ``owner`` an attribute it does not define (``unpatch()`` deletes it again)."""
        if self.find(owner, attribute) is not None:
            return
        if attribute in vars(owner):
            raise AttributeError(
                f"{qualified_name(owner)} already defines {attribute!r}; pyvene_dist would replace it rather than add it. "
                "The installed version differs from the one this patch was written for."
            )
        setattr(owner, attribute, value)
        self._sites.append(Wrap(owner, attribute, _MISSING, value))

    def check_restorable(self) -> None:
        """Refuse (``RuntimeError`` naming them) while someone else replaced a site after pyvene_dist wrapped it."""
        expected: dict[tuple[int, str], Any] = {}  # what each attribute holds: its last site's proxy
        for site in self._sites:
            expected[id(site.owner), site.attribute] = site.proxy
        replaced = sorted({site.name for site in self._sites
                           if vars(site.owner).get(site.attribute) is not expected[id(site.owner), site.attribute]})
        if replaced:
            raise RuntimeError(
                f"cannot unpatch {', '.join(replaced)}: replaced by someone else after pyvene_dist wrapped it; "
                "unwrap that first"
            )

    def restore(self) -> None:
        """Put back every original, newest first (``check_restorable`` first)."""
        self.check_restorable()
        for site in reversed(self._sites):
            if site.original is _MISSING:
                delattr(site.owner, site.attribute)
            else:
                setattr(site.owner, site.attribute, site.original)
        self._sites.clear()


class ImportHooks:
    """The fixes waiting for a module's import (``when_imported``), applied right after it; ``undo`` is what a
    failing one calls to leave pyvene_dist unpatched (``restore_all`` for the module's objects)."""

    def __init__(self, undo: Callable[[], None]) -> None:
        self._undo = undo
        self._deferred: dict[str, list[tuple[str, Callable[[Any], None]]]] = {}
        self._finder = ImportHook(self._deferred, self._on_import)

    def when_imported(self, module_name: str, apply: Callable[[Any], None], fix: str = "") -> None:
        """Run ``apply(module)`` now if ``module_name`` is imported, else right after its import.

        An ``apply`` that fails on import undoes every fix (pyvene_dist is then unpatched, as after
        ``unpatch()``) and raises ``FixError`` naming ``fix`` and the cause from the user's import.
        """
        module = sys.modules.get(module_name)
        if module is not None and not is_importing(module):
            apply(module)
            return
        self._deferred.setdefault(module_name, []).append((fix, apply))
        self._finder.install()

    def clear(self) -> None:
        """Wait for nothing more, and take the finder off ``sys.meta_path``."""
        self._deferred.clear()
        self._finder.uninstall()

    def _on_import(self, module_name: str, module: Any) -> None:
        pending = self._deferred.pop(module_name, [])
        if not self._deferred:
            self._finder.uninstall()
        for fix, apply in pending:
            try:
                apply(module)
            except Exception as error:
                try:
                    self._undo()
                    undone = "every fix was undone (pyvene_dist is unpatched)"
                except RuntimeError as refused:
                    undone = f"undoing the fixes failed too: {refused}"
                raise FixError(
                    f"pyvene_dist's fix {fix!r} failed when {module_name} was imported "
                    f"({type(error).__name__}: {error}); {undone}"
                ) from error


class Applied:
    """Whether ``patch()`` is in force (``active``), and the names of the fixes it applied (``name in APPLIED``)."""

    def __init__(self) -> None:
        self.active = False
        self.names: set[str] = set()

    def __contains__(self, name: str) -> bool:
        return name in self.names

    def add(self, name: str) -> None:
        self.names.add(name)

    def clear(self) -> None:
        self.active = False
        self.names = set()


class CurrentOptions:
    """The ``Options`` ``patch()`` resolved (``current``), None while unpatched: what the fixes read at run time
    (``OPTIONS.current.fast_path``)."""

    def __init__(self) -> None:
        self.current: Options | None = None


def applied(name: str, *, by: Any) -> bool:
    """Whether the fix ``name`` is applied, asked by the fix whose record is ``by`` (its ``FIX``): its own name, or
    one its record names in ``requires`` or ``after``. Another is refused (``FixError`` naming both): code that acts
    only where another fix is applied must be applied after it, and ``exclude=`` must leave that code's use of it
    out with it (``fsdp`` ran ``consistency``'s check with ``consistency`` excluded)."""
    if name != by.name and name not in by.requires and name not in by.after:
        raise FixError(f"the fix {by.name!r} asks whether {name!r} is applied, which its record does not declare: "
                       f"requires={by.requires!r}, after={by.after!r}; name {name!r} in its after")
    return name in APPLIED


def restore_all() -> None:
    """Undo what ``patch()`` did: put back every original, newest first, stop waiting for imports, forget the
    fixes applied and the options, and close every model's state (the hooks the fixes registered on live objects
    go with it). Refuses (changing nothing) if a site was replaced."""
    UNDO_LOG.restore()  # first: refuses, changing nothing, while a site was replaced
    IMPORT_HOOKS.clear()
    APPLIED.clear()
    OPTIONS.current = None
    MODELS.close_all()


UNDO_LOG = UndoLog()
IMPORT_HOOKS = ImportHooks(undo=restore_all)
MODELS = ModelStates()
APPLIED = Applied()
OPTIONS = CurrentOptions()
