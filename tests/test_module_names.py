"""Each module name is used at one level of pyvene_dist only, and a renamed module's old name still imports.

At b0b1170 ``fsdp`` was both ``pyvene_dist/fsdp.py`` (FSDP2 by hand) and ``fixes/fsdp.py`` (the fix),
``tensor_parallel`` both a fix and the harness's mesh runners, ``testing/registry.py`` (the strategies) sat
beside ``_registry.py`` (the undo log), and ``quantized`` was both the FSDP refusal and the harness's cases: a
reader who met the name had to look up which one. A leading ``_`` does not make another name.
"""

from __future__ import annotations

import collections
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from pyvene_dist import _moved_modules

PACKAGE = Path(__file__).parents[1] / "pyvene_dist"
#: Every package has these; they name the folder, not a module of their own.
SHARED = {"__init__", "__main__"}


def repeated_names(root: Path) -> dict[str, list[str]]:
    """Module name (without leading ``_``) -> the paths under ``root`` that use it, where more than one does."""
    paths = collections.defaultdict(list)
    for path in sorted(root.rglob("*.py")):
        if path.stem not in SHARED and _moved_modules.FOLDER not in path.parts:
            paths[path.stem.lstrip("_")].append(path.relative_to(root).as_posix())
    return {name: found for name, found in paths.items() if len(found) > 1}


def test_no_module_name_is_used_at_two_levels():
    repeated = repeated_names(PACKAGE)
    assert not repeated, "module names used more than once under pyvene_dist/ (rename the one that is not a fix; " \
        "fix names are public): " + "; ".join(f"{name}: {', '.join(paths)}" for name, paths in repeated.items())


def test_a_repeated_name_is_found_with_or_without_its_underscore(tmp_path):
    for path in ("fsdp.py", "fixes/fsdp.py", "_registry.py", "testing/registry.py", "testing/case.py",
                 "fixes/__init__.py", "__init__.py", "_old_names/case.py"):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).touch()
    assert repeated_names(tmp_path) == {"fsdp": ["fixes/fsdp.py", "fsdp.py"],
                                        "registry": ["_registry.py", "testing/registry.py"]}


def test_an_old_name_imports_the_new_module_with_a_warning_naming_it():
    """In a fresh interpreter, so that no name is imported yet; an old name's file is only its package's
    ``_old_names/`` forwarder, and importing pyvene_dist changes no finder or path hook of the interpreter."""
    kept = [old for old in _moved_modules.MOVED if (PACKAGE.parent / (old.replace(".", "/") + ".py")).exists()]
    assert not kept, f"still files: {kept}"
    forwarders = sorted(path.relative_to(PACKAGE).as_posix() for path in PACKAGE.rglob(f"{_moved_modules.FOLDER}/*.py")
                        if path.stem != "__init__")
    assert forwarders == sorted(
        "/".join([*old.split(".")[1:-1], _moved_modules.FOLDER, old.split(".")[-1]]) + ".py"
        for old in _moved_modules.MOVED), forwarders
    code = """if True:
        import importlib, sys, warnings
        interpreter = list(sys.meta_path), list(sys.path_hooks)
        from pyvene_dist._moved_modules import MOVED
        assert (list(sys.meta_path), list(sys.path_hooks)) == interpreter, "importing pyvene_dist changed them"
        for old, new in MOVED.items():
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                moved = importlib.import_module(old)
            name = min(n for n in dir(importlib.import_module(new)) if not n.startswith("_"))
            messages = [str(w.message) for w in caught if w.category is DeprecationWarning]
            assert any(f"{old} is now {new}" in m for m in messages), (old, messages)
            assert getattr(moved, name) is getattr(sys.modules[new], name), (old, name)
            exec(f"from {old} import {name} as found", globals())
            assert found is getattr(sys.modules[new], name), (old, name)
    """
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def test_a_name_that_was_never_a_module_is_still_not_found():
    with pytest.raises(ModuleNotFoundError, match="pyvene_dist.no_such_module"):
        importlib.import_module("pyvene_dist.no_such_module")


def test_no_helper_module_of_tests_or_benchmarks_shadows_another():
    """tests/ and benchmarks/ import their helpers by bare name (``from sharded_folders import ...``), each folder
    on ``sys.path``: two helpers of one name make the second import the first, as tests/sharded.py and
    benchmarks/sharded.py did (CI failed collecting three test modules)."""
    root = PACKAGE.parent
    paths = collections.defaultdict(list)
    for folder in ("tests", "benchmarks"):
        for path in sorted((root / folder).rglob("*.py")):
            if path.stem not in SHARED | {"conftest"} and not path.stem.startswith("test_"):
                paths[path.stem].append(path.relative_to(root).as_posix())
    repeated = {name: found for name, found in paths.items() if len(found) > 1}
    assert not repeated, "helper modules that shadow each other on sys.path: " + "; ".join(
        f"{name}: {', '.join(found)}" for name, found in repeated.items())
