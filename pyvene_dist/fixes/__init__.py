"""One module per failure mode, each declaring one record, ``FIX`` (see ``pyvene_dist._records.Fix``).

``ALL`` lists the fix modules, by import, and ``GROUPS`` the groups of fixes: a package here (``checkpoints/``)
whose ``ALL`` lists its fix modules the same way, and whose name stands for all of them wherever a fix name is
taken (``patch(only=, exclude=)``, a record's ``requires`` and ``after``, a package's ``FIXES``), without the
warning an old name (``RENAMED``) gives. A reader (or a tool) follows an import from here to each fix's module, and
from its record to each wrapper; tests/test_fix_groups.py keeps the lists and the folders equal. Importing this
package imports every fix (torch, pyvene, transformers); ``import pyvene_dist`` does not import it, ``patch()`` does.

Everything else derives from the records: the order ``patch()`` applies them in (each after the fixes
it ``requires``, otherwise by name; ``unpatch()`` restores in reverse), which of them upstream already
carries, the version check, the docs tables' checks and the patch tests.

Most fixes also exist as diffs for pyvene and pyreft themselves (``patches/`` in the repository,
``docs/upstreaming.md``). Each diff adds its fix's name to the package's ``FIXES``; ``patch()`` leaves
out a fix that every package in its ``upstream`` reports carrying (unless a fix still applied
``requires`` it), so the layer shrinks as upstream takes the fixes.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
import types
import warnings
from pathlib import Path
from typing import Iterable

from .._records import Fix
from ..versions import OPTIONAL
from . import (checkpoints, consistency, data_parallel, deepspeed, device_map, devices, evaluate_before_train, fast_path,
               fsdp, gradient_checkpointing, hf_trainer, hooks, householder, locations, orthogonal, pair_indexing,
               parameters, parametrizations, pyreft_trainer, representations, sharded_loading, tensor_parallel,
               train_mode, weight_decay, wrapper_attributes, zero_grad)

#: Every fix module here, by name; a group's are in its ``ALL``.
ALL = (consistency, data_parallel, deepspeed, device_map, devices, evaluate_before_train, fast_path, fsdp,
       gradient_checkpointing, hf_trainer, hooks, householder, locations, orthogonal, pair_indexing, parameters,
       parametrizations, representations, sharded_loading, tensor_parallel, train_mode, weight_decay,
       wrapper_attributes, zero_grad)
#: Every group of fixes (a package here), by name.
GROUPS = (checkpoints, pyreft_trainer)

#: Fix names that changed, each with the names it stands for now: ``patch(only=..., exclude=...)`` and a
#: package's ``FIXES`` take an old name as all of its new ones (``exclude=["trainer"]`` leaves out both halves),
#: and ``patch()`` warns (``DeprecationWarning``) naming the new ones.
RENAMED = types.MappingProxyType({
    "checkpointing": ("gradient_checkpointing",),  # beside the checkpoints fix, which saves and loads
    "trainer": ("pyreft_trainer", "hf_trainer"),  # one record for two targets: pyreft's trainers, HF Trainer's
})


def fixes() -> tuple[Fix, ...]:
    """Every fix, in the order ``patch()`` applies them: each after those it requires or names in ``after``,
    else by name."""
    found: dict[str, Fix] = {}
    for module in fix_modules():
        name = _short(module)
        record = getattr(module, "FIX", None)
        if not isinstance(record, Fix) or record.name != name:
            raise TypeError(f"{module.__name__} declares no FIX = Fix(name={name!r}, ...)")
        if name in found or name in groups():
            raise ValueError(f"{module.__name__}: the fix name {name!r} is taken (by "
                             f"{found[name].module if name in found else 'a group'})")
        found[name] = record
    return _ordered(found)


def groups() -> dict[str, tuple[str, ...]]:
    """Each group of fixes (a package here) by its name, with the names of the fixes it holds."""
    return {_short(group): tuple(sorted(_short(module) for module in group.ALL)) for group in GROUPS}


def fix_modules() -> tuple[types.ModuleType, ...]:
    """The modules that declare a fix: ``ALL``, then each group's ``ALL``."""
    return ALL + tuple(module for group in GROUPS for module in group.ALL)


def _short(module: types.ModuleType) -> str:
    return module.__name__.rsplit(".", 1)[-1]


def _ordered(found: dict[str, Fix]) -> tuple[Fix, ...]:
    ordered: list[Fix] = []
    placing: set[str] = set()

    def place(name: str, needed_by: str) -> None:
        if name not in found:
            raise ValueError(f"fix {needed_by!r} requires {name!r}, which is no fix; known: {sorted(found)}")
        if any(record.name == name for record in ordered):
            return
        if name in placing:
            raise ValueError(f"fixes require each other in a cycle through {name!r}")
        placing.add(name)
        for required in sorted(_current(found[name].requires)):
            place(required, name)
        for earlier in sorted(_current(found[name].after)):
            if earlier in found:
                place(earlier, name)
        ordered.append(found[name])

    for name in sorted(found):
        place(name, name)
    return tuple(ordered)


def by_name() -> dict[str, Fix]:
    return {record.name: record for record in fixes()}


def required_by(records: Iterable[Fix], known: dict[str, Fix]) -> set[str]:
    """The names of ``records`` and of every fix they require, transitively."""
    needed: set[str] = set()
    pending = [record.name for record in records]
    while pending:
        name = pending.pop()
        if name not in needed:
            needed.add(name)
            pending.extend(_current(known[name].requires))
    return needed


def select(only: Iterable[str] | None = None, exclude: Iterable[str] = ()) -> tuple[Fix, ...]:
    """The fixes ``patch(only=, exclude=)`` applies, in order, less those upstream carries.

    ``only`` pulls in what its fixes require; excluding a fix another selected one requires is an error.
    """
    known = by_name()
    exclude = _names("exclude", exclude, known)
    chosen = set(known) if only is None else required_by((known[n] for n in _names("only", only, known)), known)
    chosen -= exclude
    for name in sorted(chosen):
        missing = sorted(set(known[name].requires) & exclude)
        if missing:
            raise ValueError(f"exclude={sorted(exclude)} leaves out {missing}, which the fix {name!r} requires; "
                             f"exclude {name!r} too, or keep {missing}")
    carried = upstreamed([known[name] for name in chosen])
    return tuple(record for record in known.values() if record.name in chosen - carried)


def _names(argument: str, names: Iterable[str], known: dict[str, Fix]) -> set[str]:
    if isinstance(names, str):
        raise TypeError(f"{argument}={names!r}: expected a collection of fix names, such as ({names!r},)")
    names = set(names)
    old = sorted(names & set(RENAMED))
    if old:
        now = "; ".join(f"{name!r} is now {' and '.join(map(repr, RENAMED[name]))}" for name in old)
        warnings.warn(f"pyvene_dist.patch({argument}=...): {now}; the old names stop working in a later release",
                      DeprecationWarning, stacklevel=4)
    names = _current(names)
    unknown = sorted(names - set(known))
    if unknown:
        raise ValueError(f"{argument}: unknown fix {', '.join(map(repr, unknown))}; known fixes: {', '.join(known)}; "
                         f"groups: {', '.join(groups())}")
    return names


def _current(names: Iterable[str]) -> set[str]:
    """``names`` with each old name (``RENAMED``) and each group's name replaced by the names it stands for now."""
    grouped, names = groups(), set(names)
    found = {new for name in names for new in RENAMED.get(name) or grouped.get(name) or (name,)}
    return found if found == names else _current(found)  # an old name may stand for a group ("trainer")


def upstreamed(records: Iterable[Fix] | None = None) -> frozenset[str]:
    """The fixes every package in their ``upstream`` reports in its ``FIXES`` (pyvene_dist's own is then
    skipped), less those a fix that stays applied requires."""
    records = list(fixes() if records is None else records)
    found = {package: carried_fixes(package) for package in {p for record in records for p in record.upstream}}

    def carries(package: str, name: str) -> bool:
        carried = found[package]
        return name in carried if carried is not None else package in OPTIONAL

    done = {r.name for r in records if r.upstream and all(carries(package, r.name) for package in r.upstream)}
    known = {record.name: record for record in records}
    kept = [record for record in records if record.name not in done]
    return frozenset(done - required_by(kept, {**by_name(), **known}))


def carried_fixes(package: str) -> frozenset[str] | None:
    """The names in ``package.FIXES``, old names as their new ones (empty for a release without it; None when it is not installed).

    Read from the package's ``__init__.py`` when it is not imported yet: ``patch()`` never imports pyreft.
    """
    module = sys.modules.get(package)
    if module is not None and hasattr(module, "FIXES"):
        return frozenset(_current(module.FIXES))
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        return None
    for node in ast.parse(Path(spec.origin).read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(getattr(target, "id", None) == "FIXES" for target in node.targets):
            value = node.value
            if isinstance(value, ast.Call) and getattr(value.func, "id", None) in ("frozenset", "set") and value.args:
                value = value.args[0]
            return frozenset(_current(ast.literal_eval(value)))
    return frozenset()
