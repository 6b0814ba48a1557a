"""One module per failure mode. Each has ``SITES`` (the symbols it wraps) and ``patch(registry)``.

The order is the order ``patch()`` applies them; ``unpatch()`` restores in reverse.

Most fixes also exist as diffs for pyvene and pyreft themselves (``patches/`` in the repository,
``docs/upstreaming.md``). Each diff adds its concern's name to the package's ``FIXES``; ``patch()``
leaves out a concern that every package it touches reports carrying, so the layer shrinks as
upstream takes the fixes.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

CONCERNS = (
    "representations",
    "parameters",
    "train_mode",
    "hooks",
    "checkpointing",
    "devices",
    "locations",
    "parametrizations",
    "orthogonal",
    "householder",
    "data_parallel",
    "device_map",
    "consistency",
    "fsdp",
    "deepspeed",
    "wrapper_attributes",
    "trainer",
    "checkpoints",
    "weight_decay",
    "tensor_parallel",
)


#: Concerns that also exist as an upstream diff (``patches/<package>/<concern>.diff``), with the packages
#: whose ``FIXES`` must name them before ``patch()`` stops applying pyvene_dist's own fix.
UPSTREAM: dict[str, tuple[str, ...]] = {
    "representations": ("pyvene",),
    "parameters": ("pyvene",),
    "train_mode": ("pyvene",),
    "hooks": ("pyvene",),
    "checkpointing": ("pyvene",),
    "wrapper_attributes": ("pyvene",),
    "devices": ("pyvene",),
    "device_map": ("pyvene",),
    "deepspeed": ("pyvene", "pyreft"),
    "checkpoints": ("pyvene", "pyreft"),
    "trainer": ("pyreft",),
    "weight_decay": ("pyreft",),
    "locations": ("pyvene",),
    "parametrizations": ("pyvene",),
}
#: Concerns with no upstream diff: they change what torch's wrappers do (DataParallel's scatter,
#: DDP's and FSDP's setup, the orthogonal parametrization in half precision, the Householder
#: product's backward), which pyvene and pyreft cannot reach; ``tensor_parallel`` waits for transformers'
#: TP API to settle. docs/upstreaming.md says why.
RUNTIME_ONLY = ("data_parallel", "consistency", "fsdp", "orthogonal", "householder", "tensor_parallel")
#: A runtime concern built on another's runtime code keeps that one applied while it is applied itself.
BUILT_ON: dict[str, tuple[str, ...]] = {"checkpointing": ("hooks",)}
#: Packages that may be missing; a missing one has nothing to fix.
OPTIONAL_PACKAGES = frozenset({"pyreft"})


def concerns() -> list[ModuleType]:
    """The concerns ``patch()`` applies, in order: ``CONCERNS`` less those upstream already carries."""
    carried = upstreamed()
    return [importlib.import_module(f"{__name__}.{name}") for name in CONCERNS if name not in carried]


def upstreamed() -> frozenset[str]:
    """The concerns every package they touch reports in its ``FIXES`` (pyvene_dist's own is then skipped)."""
    fixes = {package: carried_fixes(package) for package in {p for ps in UPSTREAM.values() for p in ps}}

    def carries(package: str, concern: str) -> bool:
        found = fixes[package]
        return concern in found if found is not None else package in OPTIONAL_PACKAGES

    done = {concern for concern, packages in UPSTREAM.items() if all(carries(p, concern) for p in packages)}
    for concern, bases in BUILT_ON.items():
        if concern not in done:
            done -= set(bases)
    return frozenset(done)


def carried_fixes(package: str) -> frozenset[str] | None:
    """The names in ``package.FIXES`` (empty for a release without it; None when it is not installed).

    Read from the package's ``__init__.py`` when it is not imported yet: ``patch()`` never imports pyreft.
    """
    module = sys.modules.get(package)
    if module is not None and hasattr(module, "FIXES"):
        return frozenset(module.FIXES)
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        return None
    for node in ast.parse(Path(spec.origin).read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(getattr(target, "id", None) == "FIXES" for target in node.targets):
            value = node.value
            if isinstance(value, ast.Call) and getattr(value.func, "id", None) in ("frozenset", "set") and value.args:
                value = value.args[0]
            return frozenset(ast.literal_eval(value))
    return frozenset()
