"""The old names of moved modules, still importable with a ``DeprecationWarning`` naming the new one.

Each name is used at one level only, so a module whose name repeated another's was renamed (``fsdp`` beside
``fixes.fsdp``, ``testing.registry`` beside ``_registry``, ...). The old names are files of their own in an
``_old_names`` folder that the package lists last on its own ``__path__`` (``pyvene_dist`` and
``pyvene_dist.testing``), so ``import pyvene_dist.fsdp`` finds ``_old_names/fsdp.py`` and nothing outside the
package changes: no finder on ``sys.meta_path``, no path hook. Each file calls ``forward(__name__)``, which
makes the module forward every attribute to the new one, so ``from pyvene_dist.fsdp import fully_shard_model``
gives the same function as ``from pyvene_dist.fully_shard import fully_shard_model``.
"""

from __future__ import annotations

import importlib
import os
import sys
import warnings
from types import MappingProxyType

#: Old module name -> the module it is now (``fixes.RENAMED`` is the fixes' old names, for ``patch()``).
MOVED = MappingProxyType({
    "pyvene_dist.fsdp": "pyvene_dist.fully_shard",
    "pyvene_dist.plan": "pyvene_dist.memory_plan",
    "pyvene_dist.testing.registry": "pyvene_dist.testing.strategies",
    "pyvene_dist.testing.tensor_parallel": "pyvene_dist.testing.mesh_runners",
    "pyvene_dist.testing.quantized": "pyvene_dist.testing.quantized_cases",
    # the version guard, one subpackage (issue 51)
    "pyvene_dist._versions": "pyvene_dist.versions.guard",
    "pyvene_dist._fingerprints": "pyvene_dist.versions.forms",
    "pyvene_dist._installed": "pyvene_dist.versions.installed",
    "pyvene_dist._fingerprints_table": "pyvene_dist.versions.table",
})
#: The folder of each package that holds its old names.
FOLDER = "_old_names"


def old_names_folder(package_file: str) -> str:
    """The ``_old_names`` folder beside a package's ``__init__.py``, for the package to list on its ``__path__``."""
    return os.path.join(os.path.dirname(package_file), FOLDER)


def forward(name: str) -> None:
    """Make the module ``name`` (an old name being imported) stand for the module it is now, warning once, at the
    line that imports it (the warnings module skips importlib's own frames)."""
    new = MOVED.get(name)
    if new is None:
        raise ImportError(f"{name} is no old module name; the old names are {', '.join(MOVED)}")
    warnings.warn(f"{name} is now {new}: import it from there ({name} goes in a later release)",
                  DeprecationWarning, stacklevel=3)
    target = importlib.import_module(new)
    module = sys.modules[name]
    module.__getattr__ = lambda attribute: getattr(target, attribute)
    module.__dir__ = lambda: dir(target)
    module.__doc__ = target.__doc__
