"""What a fix is: ``Fix``, the record each fix module declares, and its sites (``Site``); how a record is applied
(``Fix.patch``, into ``_registry``'s undo log), with the checks that refuse a site the installed release changed.

Each fix module declares one ``FIX = Fix(...)``: the sites it wraps, replaces or adds, the functions it relies on
besides, the fixes it is built on and the upstream packages whose ``FIXES`` retire it. The releases it was checked
on are those of the forms of its functions known to work (``versions``), which ``patch()`` compares first.
``Fix.patch(undo_log, import_hooks, options)`` applies it; of the module, only what the record names runs at ``patch()``.

Patches name the class that *defines* a method (``BaseModel.named_parameters``, not
``IntervenableModel.named_parameters``): wrapping through a subclass would shadow the base
definition, and a later pyvene release that moves the method would go unnoticed. Here it fails loudly.

A record refers to code by the objects themselves wherever the fix module can import them: each site of torch,
transformers (but ``transformers.trainer``) and pyvene is its owner and attribute, ``Site((BaseModel,
"named_parameters"), ...)``, a re-export's module is the module object, and ``relies_on`` holds the functions; a
reader (or a tool) follows them to the code as Python does, and ``patch()`` resolves nothing by name. By name, as
``"module:Qualified.attr"``, only the sites of modules patched when they are imported (``IMPORTED_LATER``): pyreft
(optional; ``patch()`` never imports it), ``transformers.trainer`` (seconds to import, for a user who may never
train), accelerate and deepspeed (optional, and slow to import); ``_imports``' hook hands ``Fix.patch`` the module
as it is imported, and the site is looked up in it. Either way a site has its path (``Site.path``, derived from the
object as ``f"{owner.__module__}:{owner.__qualname__}.{attribute}"``): the version guard's table, the docs and
``pyvene-dist fixes`` key sites by it.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import types
from typing import Any, Callable

from . import versions
from ._options import Option, Options
from ._registry import FixError, ImportHooks, UndoLog

_ABSENT = object()
#: Modules patched when they are imported rather than imported by ``patch()``: pyreft is optional and
#: ``transformers.trainer`` is slow to import; accelerate and deepspeed are optional and slow to import.
IMPORTED_LATER = ("pyreft", "transformers.trainer", "accelerate", "deepspeed")
KINDS = ("wrap", "replace", "add", "entry")


def _path_of(owner: Any, attribute: str) -> str:
    """``"module:Qualified.attr"`` for ``attribute`` of ``owner``, a module or a class."""
    if isinstance(owner, types.ModuleType):
        return f"{owner.__name__}:{attribute}"
    if isinstance(owner, type):
        return f"{owner.__module__}:{owner.__qualname__}.{attribute}"
    raise TypeError(f"Site owner {owner!r}: expected a module or a class, whose __dict__ holds {attribute!r}")


def code_path(function: Any) -> str:
    """``"module:Qualified.name"`` of a function (or method) given as the object: how ``relies_on`` keys it."""
    if isinstance(function, str):
        return function
    function = getattr(function, "__func__", function)
    return f"{function.__module__}:{function.__qualname__}"


@dataclasses.dataclass(frozen=True)
class Site:
    """One symbol a fix changes: ``(owner, "attr")``, the module or class whose ``__dict__`` holds it and the
    attribute's name, or ``"module:Qualified.attr"`` for a module imported later (``IMPORTED_LATER``). ``path`` is
    ``"module:Qualified.attr"`` either way (given as a pair, it is derived from the owner), and ``holder`` the owner
    where it was given.

    ``kind`` says how: ``wrap`` puts a ``wrapt.FunctionWrapper`` calling ``wrapper`` around the original
    (which the wrapper calls); ``replace`` does the same with a wrapper that never calls the original,
    so the original's source must be one the replacement was written for (a form ``versions.table.KNOWN`` holds
    for it, checked at ``patch()`` and again on the object it replaces: ``versions.check_replaced``); ``add`` gives
    the owner an attribute it lacks (``wrapper`` is the value); ``entry``
    puts a plain function in place of what the owner holds now (another fix's wrap, or the original):
    ``wrapper(current)`` returns it, and it calls ``current`` for what it does not do itself. torch.compile
    traces a plain function, where it runs a ``wrapt`` wrapper's original without the wrapper.
    ``wrapper`` is the object itself, never its name: a fix's record stands below the code it names, so a reader
    follows each site to its wrapper as Python does.

    ``reexported_in`` holds the modules that re-export the attribute (``from .modeling_utils import *``), as
    objects (by name for modules imported later): each holds the same original under the same qualified name, and
    is patched the same way, since code there looks the name up in its own module (``Fix.places`` lists them all).

    ``any_form``: the fix compares the target's source itself and, where it is not the one the fix was written
    from, leaves the target's behaviour as it is (``fast_path`` takes pyvene's general path); ``patch()`` then
    does not refuse the fix for a changed form of it (``versions``).
    """

    path: str  # given as (owner, "attribute") or "module:Qualified.attr"; "module:Qualified.attr" once made
    wrapper: Any
    kind: str = "wrap"
    reexported_in: tuple[Any, ...] = ()
    any_form: bool = False
    #: Set by ``places()`` on a re-export's place: the module it re-exports from, whose attribute it must hold.
    reexports: str | None = None
    #: The module or class whose ``__dict__`` holds the attribute, where the site was given it; None for a site
    #: given by name, looked up in its module when that is imported.
    holder: Any = None
    #: Set by ``places()`` on a re-export's place given as an object: the owner of the original it re-exports.
    source: Any = None

    def __post_init__(self) -> None:
        if isinstance(self.path, tuple):
            if len(self.path) != 2 or not isinstance(self.path[1], str):
                raise TypeError(f"Site {self.path!r}: expected (owner, 'attribute') or 'module:Qualified.attr'")
            owner, attribute = self.path
            object.__setattr__(self, "path", _path_of(owner, attribute))
            object.__setattr__(self, "holder", owner)
        if isinstance(self.reexported_in, (str, types.ModuleType)) or any(
                isinstance(module, str) and ":" in module for module in self.reexported_in):
            raise TypeError(f"Site {self.path!r}: reexported_in={self.reexported_in!r}, expected a tuple of modules "
                            "(by name for a module imported later) such as (pyvene.models.intervenable_base,)")
        if self.kind not in KINDS:
            raise ValueError(f"Site {self.path!r}: kind={self.kind!r}, expected one of {KINDS}")
        _check_path("Site", self.path)
        if self.any_form and self.kind in ("replace", "add"):
            raise ValueError(f"Site {self.path!r}: any_form=True with kind={self.kind!r}; a replacement must match "
                             "a form it was written for, and an added attribute has none")

    @property
    def module(self) -> str:
        return self.path.split(":")[0]

    def places(self) -> tuple["Site", ...]:
        """This site in its module and in each module that re-exports it."""
        qualified = self.path.split(":")[1]
        return (dataclasses.replace(self, reexported_in=()),) + tuple(
            dataclasses.replace(self, path=f"{_module_name(module)}:{qualified}", reexported_in=(),
                                reexports=self.module, source=self.holder,
                                holder=None if isinstance(module, str) else _in_module(module, qualified))
            for module in self.reexported_in)

    @property
    def attribute(self) -> str:
        return self.path.rsplit(".", 1)[-1].split(":")[-1]

    def owner(self, module: Any = None) -> Any:
        """The module or class whose ``__dict__`` holds the attribute: ``holder``, or, for a site given by name,
        looked up in ``module``, its module as imported."""
        return self.holder if self.holder is not None else _in_module(module, self.path.split(":")[1])

    @property
    def imported_later(self) -> bool:
        return any(self.module == name or self.module.startswith(name + ".") for name in IMPORTED_LATER)


@dataclasses.dataclass(frozen=True)
class Fix:
    """One failure mode's fix: everything ``patch()``, the docs and the tests need to know about it.

    Declared once per fix module as ``FIX = Fix(__name__, sites=(...), ...)``; its name is the module's.
    """

    module: str
    sites: tuple[Site, ...]
    #: Fixes whose runtime code or behaviour this one is built on (it calls them whatever is applied):
    #: applied with it, before it.
    requires: tuple[str, ...] = ()
    #: Fixes this one is applied after when they are applied too, without pulling them in: an ``entry``
    #: site stacks on the wraps of the same attribute, and code calls theirs only where ``_registry.applied``
    #: says they are (or keeps their state coherent). tests/test_patching.py derives both from the imports.
    after: tuple[str, ...] = ()
    #: Packages that each must name this fix in their ``FIXES`` before ``patch()`` leaves it out;
    #: empty for a runtime-only fix (docs/upstreaming.md says why each is).
    upstream: tuple[str, ...] = ()
    #: Functions of torch or transformers whose behaviour this fix relies on without wrapping them (it mirrors
    #: them op for op, or reads what they set): ``patch()`` checks their forms as it does its sites'. Given as the
    #: functions (by ``"module:Qualified.name"`` in a module imported later), kept as their paths.
    relies_on: tuple[str, ...] = ()
    #: The type of what the fix keeps per pyvene model (``pyvene_dist._state``): made without arguments, with a
    #: ``close()`` that undoes what it holds.
    state: type | None = None
    #: Run at ``patch()`` before the sites are touched, with the ``Options`` (a signature check, a switch).
    on_patch: Callable[[Options], None] | None = None
    #: This fix's switches (``pyvene_dist._options.Option``): ``patch(name=...)`` takes each, checked here, and
    #: the fix reads it at run time as ``_registry.OPTIONS.current.<name>``.
    options: tuple[Option, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.relies_on, str) or not isinstance(self.relies_on, tuple):
            raise TypeError(f"Fix {self.module!r}: relies_on={self.relies_on!r}, expected a tuple of functions "
                            "(or 'module:Qualified.name' strings for modules imported later)")
        object.__setattr__(self, "relies_on", tuple(map(code_path, self.relies_on)))
        if not isinstance(self.options, tuple) or not all(isinstance(option, Option) for option in self.options):
            raise TypeError(f"Fix {self.module!r}: options={self.options!r}, expected a tuple of "
                            "pyvene_dist._options.Option")
        for path in self.relies_on:
            _check_path(f"Fix {self.module!r}: relies_on", path)
        named = [f"{where}={value!r}" for where, value in (("state", self.state), ("on_patch", self.on_patch),
                                                             *((f"Site({site.path!r}).wrapper", site.wrapper)
                                                               for site in self.sites)) if isinstance(value, str)]
        if named:
            raise TypeError(f"Fix {self.module!r}: {', '.join(named)}: expected the object itself, not its name "
                            "(put the record below the code it names)")

    @functools.cached_property  # read on hot paths (``applied(FIX.name, by=FIX)``)
    def name(self) -> str:
        return self.module.rsplit(".", 1)[-1]

    @functools.cached_property
    def places(self) -> tuple[Site, ...]:
        """Every site ``patch()`` touches: each of ``sites`` in its module and where it is re-exported."""
        return tuple(place for site in self.sites for place in site.places())

    def patch(self, undo_log: UndoLog, import_hooks: ImportHooks, options: Options = Options(allow_unsupported=False)) -> None:
        """Apply this fix, each change recorded in ``undo_log``: sites of imported modules now, of modules imported
        later (``IMPORTED_LATER``) on their import, through ``import_hooks``."""
        if self.on_patch is not None:
            self.on_patch(options)
        by_module: dict[str, list[Site]] = {}
        for site in self.places:
            by_module.setdefault(site.module, []).append(site)
        for module_name, sites in by_module.items():
            apply = functools.partial(_apply_sites, self, tuple(sites), undo_log, options)
            if all(site.holder is not None for site in sites):
                apply(None)  # the owners themselves: nothing to resolve
            elif sites[0].imported_later:
                import_hooks.when_imported(module_name, apply, fix=self.name)
            else:  # a record outside pyvene_dist that names a site of an imported module (a test's)
                apply(importlib.import_module(module_name))


def _apply_sites(fix: Fix, sites: tuple[Site, ...], undo_log: UndoLog, options: Options, module: Any) -> None:
    for site in sites:
        owner = site.owner(module)
        if site.reexports is not None:
            _check_reexport(fix, site, owner, undo_log)
        if site.kind == "add":
            undo_log.add(owner, site.attribute, site.wrapper)
            continue
        if site.kind == "entry":
            undo_log.enter(owner, site.attribute, site.wrapper)
            continue
        if site.kind == "replace" and undo_log.find(owner, site.attribute) is None:
            versions.check_replaced(fix.name, site.path, vars(owner).get(site.attribute), options)
        undo_log.wrap(owner, site.attribute, site.wrapper)


def _check_reexport(fix: Fix, site: Site, owner: Any, undo_log: UndoLog) -> None:
    """A re-export's place must hold what its module re-exports (the original, before any wrap). A module imported
    after the place it imports from was patched holds that place's wrap (``from accelerate.utils import
    save_fsdp_model`` in ``transformers.trainer``): it is given the original back, to be wrapped as its own place, so
    that ``unpatch()`` leaves it the original."""
    source = site.source if site.source is not None else _in_module(
        importlib.import_module(site.reexports), site.path.split(":")[1])  # by name: imported with this one
    wrapped = undo_log.find(source, site.attribute)
    exported = wrapped.original if wrapped is not None else vars(source).get(site.attribute, _ABSENT)
    found = vars(owner).get(site.attribute, _ABSENT)
    if undo_log.find(owner, site.attribute) is None and any(
            place.proxy is found and place.original is exported for place in undo_log.sites):
        setattr(owner, site.attribute, exported)
        found = exported
    if found is not exported and undo_log.find(owner, site.attribute) is None:
        raise FixError(f"pyvene_dist's fix {fix.name!r}: {site.path} is not {site.reexports}'s {site.attribute} "
                       f"re-exported ({found!r} there); the installed version defines its own, which needs a Site "
                       "of its own rather than reexported_in")


def _in_module(module: Any, qualified: str) -> Any:
    """The owner of ``Qualified.attr`` in ``module``: the module itself, or the class the name goes through."""
    return functools.reduce(getattr, qualified.split(".")[:-1], module)


def _module_name(module: Any) -> str:
    return module if isinstance(module, str) else module.__name__


def _check_path(what: str, path: str) -> None:
    if path.count(":") != 1:
        raise ValueError(f"{what} {path!r}: expected 'module:Qualified.attr'")

