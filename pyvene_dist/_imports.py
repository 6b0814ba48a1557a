"""Run a callback right after a module's import, through a finder that ``unpatch()`` takes off again.

wrapt's post-import hooks cannot be unregistered: its finder stayed on ``sys.meta_path`` and its registry
kept pyvene_dist's hooks after ``unpatch()``. ``ImportHook`` is one finder, put first on ``sys.meta_path`` by
``install()`` and removed by ``uninstall()``; it answers only for the modules it awaits, with the spec the
other finders give and a loader that runs the module's own and then the callback. The module keeps its own
loader (``__loader__``, ``__spec__.loader``). A module awaited while it was being imported already (another
thread's import, or one that ``patch()`` ran inside) gets its callback at the next import the finder sees.
"""

from __future__ import annotations

import importlib.abc
import sys
from typing import Any, Callable, Collection


class ImportHook(importlib.abc.MetaPathFinder):
    def __init__(self, awaited: Collection[str], on_import: Callable[[str, Any], None]) -> None:
        #: The module names waited for (a live view: the caller adds and removes names).
        self.awaited = awaited
        self.on_import = on_import

    def install(self) -> None:
        if self not in sys.meta_path:
            sys.meta_path.insert(0, self)

    def uninstall(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)

    def find_spec(self, fullname: str, path=None, target=None):
        for name in [name for name in self.awaited if name in sys.modules and not is_importing(sys.modules[name])]:
            self.on_import(name, sys.modules[name])
        if fullname not in self.awaited:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None) if finder is not self else None
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _ThenCall(spec.loader, self.on_import)
                return spec
        return None


class _ThenCall(importlib.abc.Loader):
    """``loader``, then ``on_import(name, module)`` once the module has run."""

    def __init__(self, loader: importlib.abc.Loader, on_import: Callable[[str, Any], None]) -> None:
        self.loader, self.on_import = loader, on_import

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        module.__spec__.loader = module.__loader__ = self.loader
        self.loader.exec_module(module)
        self.on_import(module.__name__, module)

    def __getattr__(self, name: str) -> Any:  # get_code, get_source, is_package ... are the module's loader's
        return getattr(self.loader, name)


def is_importing(module: Any) -> bool:
    """Whether ``module`` is in ``sys.modules`` but still running (its import not finished)."""
    spec = getattr(module, "__spec__", None)
    return bool(getattr(spec, "_initializing", False))
