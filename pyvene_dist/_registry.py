"""The record of every wrap pyvene_dist installs, so that ``unpatch()`` puts back the very objects it found.

A wrap is recorded as (owner, attribute, original, proxy): ``owner`` is the module or class whose
``__dict__`` defines the attribute, ``original`` is what that ``__dict__`` held (the raw function,
``staticmethod`` or ``classmethod`` object, never a bound method), and ``proxy`` is the
``wrapt.FunctionWrapper`` put in its place. Restoring writes ``original`` back, in reverse order.

Patches name the class that *defines* a method (``BaseModel.named_parameters``, not
``IntervenableModel.named_parameters``): wrapping through a subclass would shadow the base
definition, and a later pyvene release that moves the method would go unnoticed. Here it fails loudly.

Modules that may be imported after ``patch()`` (pyreft, ``transformers.trainer``) are patched by a
post-import hook; hooks cannot be unregistered from wrapt, so they stay installed and do nothing
while unpatched.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from typing import Any, Callable

import wrapt

_MISSING = object()


def describe(owner: Any) -> str:
    """``pyvene.models.intervenable_base.BaseModel`` for a class, the module name for a module."""
    if isinstance(owner, type):
        return f"{owner.__module__}.{owner.__qualname__}"
    return getattr(owner, "__name__", repr(owner))


@dataclasses.dataclass(frozen=True)
class Site:
    owner: Any
    attribute: str
    original: Any  # _MISSING for an attribute pyvene_dist added
    proxy: Any  # the wrapt.FunctionWrapper (or added attribute) now in place

    @property
    def name(self) -> str:
        return f"{describe(self.owner)}.{self.attribute}"


class Registry:
    def __init__(self) -> None:
        self._sites: list[Site] = []
        self._deferred: dict[str, list[Callable[[Any], None]]] = {}
        self._hooked_modules: set[str] = set()
        self.active = False

    @property
    def sites(self) -> tuple[Site, ...]:
        return tuple(self._sites)

    def find(self, owner: Any, attribute: str) -> Site | None:
        for site in self._sites:
            if site.owner is owner and site.attribute == attribute:
                return site
        return None

    def wrap(self, owner: Any, attribute: str, wrapper: Callable) -> None:
        """Replace ``owner.attribute`` with a ``wrapt.FunctionWrapper`` calling ``wrapper``, once."""
        if self.find(owner, attribute) is not None:
            return
        original = vars(owner).get(attribute, _MISSING)
        if original is _MISSING:
            raise AttributeError(
                f"{describe(owner)} does not define {attribute!r} itself; pyvene_dist patches the class "
                "that defines it. The installed version differs from the one this patch was written for."
            )
        proxy = wrapt.FunctionWrapper(original, wrapper)
        setattr(owner, attribute, proxy)
        self._sites.append(Site(owner, attribute, original, proxy))

    def add(self, owner: Any, attribute: str, value: Any) -> None:
        """Give ``owner`` an attribute it does not define (``unpatch()`` deletes it again)."""
        if self.find(owner, attribute) is not None:
            return
        if attribute in vars(owner):
            raise AttributeError(
                f"{describe(owner)} already defines {attribute!r}; pyvene_dist would replace it rather than add it. "
                "The installed version differs from the one this patch was written for."
            )
        setattr(owner, attribute, value)
        self._sites.append(Site(owner, attribute, _MISSING, value))

    def when_imported(self, module_name: str, apply: Callable[[Any], None]) -> None:
        """Run ``apply(module)`` now if ``module_name`` is imported, else right after its import."""
        module = sys.modules.get(module_name)
        if module is not None and not _is_importing(module):
            apply(module)
            return
        self._deferred.setdefault(module_name, []).append(apply)
        if module_name not in self._hooked_modules:
            wrapt.register_post_import_hook(functools.partial(self._on_import, module_name), module_name)
            self._hooked_modules.add(module_name)

    def _on_import(self, module_name: str, module: Any) -> None:
        for apply in self._deferred.pop(module_name, []):
            apply(module)

    def restore_all(self) -> None:
        """Put back every original, newest first. Refuses (changing nothing) if a site was replaced."""
        replaced = [site.name for site in self._sites if vars(site.owner).get(site.attribute) is not site.proxy]
        if replaced:
            raise RuntimeError(
                f"cannot unpatch {', '.join(replaced)}: replaced by someone else after pyvene_dist wrapped it; "
                "unwrap that first"
            )
        for site in reversed(self._sites):
            if site.original is _MISSING:
                delattr(site.owner, site.attribute)
            else:
                setattr(site.owner, site.attribute, site.original)
        self._sites.clear()
        self._deferred.clear()
        self.active = False


def _is_importing(module: Any) -> bool:
    spec = getattr(module, "__spec__", None)
    return bool(getattr(spec, "_initializing", False))


REGISTRY = Registry()
