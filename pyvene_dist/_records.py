"""What a fix is: ``Fix``, the record each fix module declares, and its sites (``Site``); how a record is applied
(``Fix.patch``, into ``_registry``'s undo log), with the checks that refuse a site the installed release changed.

Each fix module declares one ``FIX = Fix(...)``: the sites it wraps, replaces or adds, the functions it relies on
besides, the fixes it is built on and the upstream packages whose ``FIXES`` retire it. The releases it was checked
on are those of the forms of its functions known to work (``_fingerprints``), which ``patch()`` compares first.
``Fix.patch(undo_log, import_hooks, options)`` applies it; of the module, only what the record names runs at ``patch()``.

Patches name the class that *defines* a method (``BaseModel.named_parameters``, not
``IntervenableModel.named_parameters``): wrapping through a subclass would shadow the base
definition, and a later pyvene release that moves the method would go unnoticed. Here it fails loudly.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import warnings
from typing import Any, Callable

from ._fingerprints import digest, known, known_forms
from ._options import Option, Options
from ._registry import FixError, ImportHooks, UndoLog
from ._versions import ALLOW_ENV, UnsupportedVersionError

_ABSENT = object()
#: Modules patched when they are imported rather than imported by ``patch()``: pyreft is optional and
#: ``transformers.trainer`` is slow to import.
IMPORTED_LATER = ("pyreft", "transformers.trainer")
KINDS = ("wrap", "replace", "add", "entry")


@dataclasses.dataclass(frozen=True)
class Site:
    """One symbol a fix changes: ``"module:Qualified.attr"``.

    ``kind`` says how: ``wrap`` puts a ``wrapt.FunctionWrapper`` calling ``wrapper`` around the original
    (which the wrapper calls); ``replace`` does the same with a wrapper that never calls the original,
    so the original's source must be one the replacement was written for (a form ``_fingerprints.KNOWN`` holds
    for it, checked at ``patch()`` and again on the object it replaces); ``add`` gives the owner an attribute it
    lacks (``wrapper`` is the value); ``entry``
    puts a plain function in place of what the owner holds now (another fix's wrap, or the original):
    ``wrapper(current)`` returns it, and it calls ``current`` for what it does not do itself. torch.compile
    traces a plain function, where it runs a ``wrapt`` wrapper's original without the wrapper.
    ``wrapper`` is the object itself, never its name: a fix's record stands below the code it names, so a reader
    follows each site to its wrapper as Python does.

    ``reexported_in`` names the modules that re-export the attribute (``from .modeling_utils import *``):
    each holds the same original under the same qualified name, and is patched the same way, since code
    there looks the name up in its own module (``Fix.places`` lists them all).

    ``any_form``: the fix compares the target's source itself and, where it is not the one the fix was written
    from, leaves the target's behaviour as it is (``fast_path`` takes pyvene's general path); ``patch()`` then
    does not refuse the fix for a changed form of it (``_versions``).
    """

    path: str
    wrapper: Any
    kind: str = "wrap"
    reexported_in: tuple[str, ...] = ()
    any_form: bool = False
    #: Set by ``places()`` on a re-export's place: the module it re-exports from, whose attribute it must hold.
    reexports: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.reexported_in, str) or any(":" in name for name in self.reexported_in):
            raise TypeError(f"Site {self.path!r}: reexported_in={self.reexported_in!r}, expected a tuple of module "
                            "names such as ('pyvene.models.intervenable_base',)")
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
            dataclasses.replace(self, path=f"{module}:{qualified}", reexported_in=(), reexports=self.module)
            for module in self.reexported_in)

    @property
    def attribute(self) -> str:
        return self.path.rsplit(".", 1)[-1].split(":")[-1]

    def owner(self, module: Any) -> Any:
        """The module or class whose ``__dict__`` holds the attribute."""
        qualified = self.path.split(":")[1]
        return functools.reduce(getattr, qualified.split(".")[:-1], module)

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
    #: site stacks on the wraps of the same attribute, and code calls theirs only where ``_registry.APPLIED``
    #: names them (or keeps their state coherent). tests/test_patching.py derives both from the imports.
    after: tuple[str, ...] = ()
    #: Packages that each must name this fix in their ``FIXES`` before ``patch()`` leaves it out;
    #: empty for a runtime-only fix (docs/upstreaming.md says why each is).
    upstream: tuple[str, ...] = ()
    #: Functions (``"module:Qualified.name"``) of torch or transformers whose behaviour this fix relies on
    #: without wrapping them (it mirrors them op for op, or reads what they set): ``patch()`` checks their forms
    #: as it does its sites'.
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
        if isinstance(self.relies_on, str):
            raise TypeError(f"Fix {self.module!r}: relies_on={self.relies_on!r}, expected a tuple of "
                            "'module:Qualified.name' strings")
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

    @functools.cached_property  # read on hot paths (``FIX.name in APPLIED``)
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
            if sites[0].imported_later:
                import_hooks.when_imported(module_name, apply, fix=self.name)
            else:
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
            _check_fingerprint(fix, site, vars(owner).get(site.attribute), options)
        undo_log.wrap(owner, site.attribute, site.wrapper)


def _check_reexport(fix: Fix, site: Site, owner: Any, undo_log: UndoLog) -> None:
    """A re-export's place must hold what its module re-exports (the original, before any wrap)."""
    source = site.owner(importlib.import_module(site.reexports))
    wrapped = undo_log.find(source, site.attribute)
    exported = wrapped.original if wrapped is not None else vars(source).get(site.attribute, _ABSENT)
    found = vars(owner).get(site.attribute, _ABSENT)
    if found is not exported and undo_log.find(owner, site.attribute) is None:
        raise FixError(f"pyvene_dist's fix {fix.name!r}: {site.path} is not {site.reexports}'s {site.attribute} "
                       f"re-exported ({found!r} there); the installed version defines its own, which needs a Site "
                       "of its own rather than reexported_in")


def _check_path(what: str, path: str) -> None:
    if path.count(":") != 1:
        raise ValueError(f"{what} {path!r}: expected 'module:Qualified.attr'")


def fingerprint(original: Any) -> str:
    """The first 16 hex digits of the SHA-256 of ``original``'s source (dedented)."""
    return digest(inspect.getsource(getattr(original, "__func__", original)))


def _check_fingerprint(fix: Fix, site: Site, original: Any, options: Options) -> None:
    """The object a ``replace`` site replaces must have a known form: ``patch()`` checked its file, and this is
    what was imported (a module imported after ``patch()`` from elsewhere, an original someone replaced)."""
    try:
        found = fingerprint(original)
    except (TypeError, OSError):  # no source to read: no fingerprint either
        found = "none"
    forms = known().get(site.path, {})
    if found in forms:
        return
    message = (
        f"pyvene_dist's fix {fix.name!r} replaces {site.path}, written for the sources {known_forms(forms)}; "
        f"the one imported has {found}, so the replacement may drop what changed"
    )
    if options.allow_unsupported:
        warnings.warn(f"pyvene_dist: patching anyway: {message}", RuntimeWarning, stacklevel=4)
        return
    raise UnsupportedVersionError(
        f"{message}. To patch anyway, call pyvene_dist.patch(allow_unsupported=True) or set "
        f"{ALLOW_ENV}=1."
    )
