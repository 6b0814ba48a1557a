"""The old names of moved modules, still importable with a ``DeprecationWarning`` naming the new one.

Each name is used at one level only, so a module whose name repeated another's was renamed (``fsdp`` beside
``fixes.fsdp``, ``testing.registry`` beside ``_registry``, ...). No file keeps the old name: ``Finder``, on
``sys.meta_path`` after the finders of files, answers only for the names in ``MOVED``, with a module that
forwards every attribute to the new one, so ``from pyvene_dist.fsdp import fully_shard_model`` gives the same
function as ``from pyvene_dist.fully_shard import fully_shard_model``.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

#: Old module name -> the module it is now (``fixes.RENAMED`` is the fixes' old names, for ``patch()``).
MOVED = {
    "pyvene_dist.fsdp": "pyvene_dist.fully_shard",
    "pyvene_dist.plan": "pyvene_dist.memory_plan",
    "pyvene_dist.testing.registry": "pyvene_dist.testing.strategies",
    "pyvene_dist.testing.tensor_parallel": "pyvene_dist.testing.mesh_runners",
    "pyvene_dist.testing.quantized": "pyvene_dist.testing.quantized_cases",
}


class Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds and loads the old names of ``MOVED``; every other name is left to the other finders."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def exec_module(self, module) -> None:
        new = MOVED[module.__name__]
        warnings.warn(f"{module.__name__} is now {new}: import it from there ({module.__name__} goes in a later "
                      "release)", DeprecationWarning, stacklevel=2)
        target = importlib.import_module(new)
        module.__getattr__ = lambda name: getattr(target, name)
        module.__dir__ = lambda: dir(target)
        module.__doc__ = target.__doc__


def install() -> None:
    """Put one ``Finder`` last on ``sys.meta_path`` (a second call, or a second import of pyvene_dist, adds none)."""
    if not any(type(finder).__name__ == "Finder" and type(finder).__module__ == __name__ for finder in sys.meta_path):
        sys.meta_path.append(Finder())
