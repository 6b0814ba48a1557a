"""The tests are laid out by what they test (docs/testing.md): each fix's in ``tests/fixes/test_<fix>.py``
(more modules of one fix as ``test_<fix>_<aspect>.py``), and module names are unique across tests/, because
pytest imports each module by its bare name (no ``__init__.py``) and spawned ranks import it again by that name.
"""

import ast
import collections
from pathlib import Path

from pyvene_dist import fixes

TESTS = Path(__file__).parent


def _new_names(old: str) -> tuple[str, ...]:
    """What ``fixes.RENAMED`` says an old name became: one fix, or the fixes it was split into."""
    new = fixes.RENAMED[old]
    return (new,) if isinstance(new, str) else tuple(new)


def _owner(stem: str, names) -> str | None:
    """The name ``test_<stem>.py`` is named after: ``stem`` itself or the longest ``<name>_`` it starts with."""
    owners = [name for name in names if stem == name or stem.startswith(f"{name}_")]
    return max(owners, key=len, default=None)


def layout_problems(folder: Path, names, renamed, groups=()) -> list[str]:
    """Each fix in ``names`` without ``folder/test_<fix>.py``, and each module there named after no fix nor group
    of fixes (``groups``: ``test_checkpoints_<aspect>.py`` may test the group's fixes together), saying the new name
    where it is named after one in ``renamed``."""
    stems = sorted(path.stem.removeprefix("test_") for path in folder.glob("test_*.py"))
    problems = []
    for name in names:
        if name not in stems:
            old = [old for old in renamed if name in _new_names(old) and _owner(old, stems)]
            hint = f" (found {', '.join(f'test_{o}.py' for o in old)}, named after the old name)" if old else ""
            problems.append(f"fix {name!r} has no test module: expected {folder.name}/test_{name}.py{hint}")
    for stem in stems:
        if _owner(stem, [*names, *groups]) is not None:
            continue
        old = _owner(stem, renamed)
        if old is not None:
            problems.append(f"{folder.name}/test_{stem}.py is named after fix {old!r}, which is now "
                            f"{' and '.join(map(repr, _new_names(old)))}: rename or split it")
        else:
            problems.append(f"{folder.name}/test_{stem}.py is named after no fix; fixes: {', '.join(sorted(names))}")
    return problems


def test_every_fix_has_its_test_module_and_every_module_there_a_fix():
    problems = layout_problems(TESTS / "fixes", [fix.name for fix in fixes.fixes()], fixes.RENAMED, fixes.groups())
    assert not problems, "\n".join(problems)


def test_a_missing_or_renamed_module_is_named(tmp_path):
    for stem in ("hooks", "hooks_sdpa", "checkpointing", "stray"):
        (tmp_path / f"test_{stem}.py").touch()
    problems = layout_problems(tmp_path, ["hooks", "gradient_checkpointing", "zero_grad"],
                               {"checkpointing": "gradient_checkpointing"})
    folder = tmp_path.name
    assert problems == [
        f"fix 'gradient_checkpointing' has no test module: expected {folder}/test_gradient_checkpointing.py "
        "(found test_checkpointing.py, named after the old name)",
        f"fix 'zero_grad' has no test module: expected {folder}/test_zero_grad.py",
        f"{folder}/test_checkpointing.py is named after fix 'checkpointing', which is now 'gradient_checkpointing': "
        "rename or split it",
        f"{folder}/test_stray.py is named after no fix; fixes: gradient_checkpointing, hooks, zero_grad",
    ]


def test_a_module_named_after_a_group_is_the_groups(tmp_path):
    for stem in ("loreft_load", "checkpoints_end_to_end", "checkpoint_stray"):
        (tmp_path / f"test_{stem}.py").touch()
    problems = layout_problems(tmp_path, ["loreft_load"], {}, {"checkpoints": ("loreft_load",)})
    assert problems == [f"{tmp_path.name}/test_checkpoint_stray.py is named after no fix; fixes: loreft_load"]


def test_module_names_are_unique_across_the_folders():
    folders = collections.defaultdict(list)
    for path in TESTS.rglob("*.py"):
        if path.name != "conftest.py" and "scripts" not in path.relative_to(TESTS).parts:
            folders[path.name].append(str(path.parent.relative_to(TESTS.parent)))
    clashes = {name: where for name, where in folders.items() if len(where) > 1}
    assert not clashes, f"modules of one name in several folders (pytest imports them by name): {clashes}"


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(node, module: str, is_package: bool, known) -> list[str]:
    """The modules of ``known`` (other than ``module``) that the statement ``node`` imports: a submodule named is
    what runs; any other name is read from the module (or package) itself."""
    if isinstance(node, ast.Import):
        targets = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
        base = module if is_package else module.rsplit(".", 1)[0]
        for _ in range(node.level - 1):
            base = base.rsplit(".", 1)[0]
        prefix = f"{base}.{node.module}" if node.level and node.module else (base if node.level else node.module)
        targets = [f"{prefix}.{alias.name}" if f"{prefix}.{alias.name}" in known else prefix for alias in node.names]
    else:
        return []
    return [target for target in targets if target in known and target != module]


def import_cycles(package: Path) -> list[list[str]]:
    """The cycles among ``package``'s modules through the imports each runs when it is imported (its top level;
    an import inside a function runs later and cannot deadlock or half-initialise a module)."""
    modules = {_module_name(path, package): path for path in sorted(package.rglob("*.py"))}
    edges = collections.defaultdict(set)
    for module, path in modules.items():
        for node in ast.parse(path.read_text()).body:  # the top level only
            edges[module] |= set(_imported(node, module, path.name == "__init__.py", modules))
    cycles, done = [], set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            cycles.append(path[path.index(module):] + [module])
            return
        if module in done:
            return
        for target in sorted(edges[module]):
            visit(target, path + [module])
        done.add(module)

    for module in sorted(modules):
        visit(module, [])
    return cycles


def test_pyvene_dist_has_no_import_cycles():
    import pyvene_dist

    package = Path(pyvene_dist.__file__).parent
    assert import_cycles(package) == []


def test_an_import_cycle_is_found(tmp_path):
    package = tmp_path / "loop"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from . import b\n")
    (package / "b.py").write_text("from .a import thing\n\ndef later():\n    from . import c\n")
    (package / "c.py").write_text("import loop.b\n")
    assert import_cycles(package) == [["loop.a", "loop.b", "loop.a"]]


def imported_modules(path: Path, module: str, known) -> list[tuple[int, str]]:
    """(line, module) for each module of ``known`` that ``path`` (the module ``module``) imports, anywhere in it
    (at its top, in a function, under ``TYPE_CHECKING``): ``from . import x`` names module ``x`` where ``x`` is
    one, else the package it is read from."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        found += sorted({(node.lineno, target) for target in _imported(node, module, path.name == "__init__.py", known)})
    return found


def _code_owner(module: str, public: set[str]) -> str:
    """The fix (or group of fixes) whose code ``module`` is: itself where it is a fix; a private part
    ``_<fix>_*`` its fix's; another private module, or a group's ``__init__``, its group's (the package)."""
    package, _, stem = module.rpartition(".")
    if not stem.startswith("_"):
        return module  # a fix, or a group package itself
    owners = [name for name in public if name.rpartition(".")[0] == package and stem.startswith(f"_{name.rpartition('.')[2]}_")]
    return max(owners, key=len, default=package)


def fix_import_problems(package: Path) -> list[str]:
    """Each import of a fix module (or of the fix-selection package) by another fix, or by a module of
    ``mechanisms``: a fix is its record and its wiring over ``mechanisms``; it may import only its own private
    parts (``_<fix>_*.py``), and a fix of a group (a package under ``fixes/``) its group's private modules; a group's
    ``__init__`` imports its own fixes, to list them (``ALL``), as ``fixes/__init__.py`` lists every fix."""
    fixes_folder, mechanisms = package / "fixes", package / "mechanisms"
    selection = f"{package.name}.fixes"
    fix_modules = {_module_name(path, package): path for path in fixes_folder.rglob("*.py")
                   if path != fixes_folder / "__init__.py"}
    public = {name for name, path in fix_modules.items() if not path.stem.startswith("_")}
    known = set(fix_modules) | {selection}
    importers = {**fix_modules, **{_module_name(path, package): path for path in mechanisms.rglob("*.py")}}
    problems = []
    for module, path in sorted(importers.items()):
        for line, target in imported_modules(path, module, known):
            if module in fix_modules and target != selection:
                mine, theirs = _code_owner(module, public), _code_owner(target, public)
                group = module.rpartition(".")[0] if path.name != "__init__.py" else module
                if theirs == mine or (theirs == group and group != selection):
                    continue  # a fix and its private parts; a group's fix and the group's private modules
                if path.name == "__init__.py" and target.rpartition(".")[0] == module:
                    continue  # a group lists its fixes
            what = "the fix-selection package" if target == selection else f"the fix module {target}"
            problems.append(f"{path.relative_to(package.parent)}:{line}: {module} imports {what}")
    return problems


def test_no_fix_imports_another_fix():
    """A fix is its record and its wiring; what two fixes share is a mechanism (``pyvene_dist/mechanisms``),
    which imports no fix, so that leaving a fix out (``exclude=``) leaves out all of its code."""
    import pyvene_dist

    problems = fix_import_problems(Path(pyvene_dist.__file__).parent)
    assert not problems, "\n".join(problems)


def test_a_fix_importing_another_fix_is_named(tmp_path):
    package = tmp_path / "layered"
    (package / "fixes").mkdir(parents=True)
    (package / "mechanisms").mkdir()
    for path in ("__init__.py", "fixes/__init__.py", "mechanisms/__init__.py", "_records.py", "fixes/b.py",
                 "fixes/_b_part.py"):
        (package / path).write_text("")
    (package / "fixes/a.py").write_text("from .._records import Fix\nfrom ..mechanisms import shared\n\n\n"
                                        "def later():\n    from .b import thing\n    from . import carried\n")
    (package / "fixes/c.py").write_text("import layered.fixes.b\nfrom ._b_part import x\n")
    (package / "fixes/b.py").write_text("from ._b_part import x\n")
    (package / "mechanisms/shared.py").write_text("from ..fixes import a\n")
    (package / "fixes/group").mkdir()
    (package / "fixes/group/__init__.py").write_text("from ._shared import x\nfrom . import d, e\nfrom ..b import y\n")
    (package / "fixes/group/_shared.py").write_text("")
    (package / "fixes/group/d.py").write_text("from ._shared import x\nfrom . import e\nfrom ..b import y\n")
    (package / "fixes/group/e.py").write_text("")
    assert fix_import_problems(package) == [
        "layered/fixes/a.py:6: layered.fixes.a imports the fix module layered.fixes.b",
        "layered/fixes/a.py:7: layered.fixes.a imports the fix-selection package",
        "layered/fixes/c.py:1: layered.fixes.c imports the fix module layered.fixes.b",
        "layered/fixes/c.py:2: layered.fixes.c imports the fix module layered.fixes._b_part",
        "layered/fixes/group/__init__.py:3: layered.fixes.group imports the fix module layered.fixes.b",
        "layered/fixes/group/d.py:2: layered.fixes.group.d imports the fix module layered.fixes.group.e",
        "layered/fixes/group/d.py:3: layered.fixes.group.d imports the fix module layered.fixes.b",
        "layered/mechanisms/shared.py:1: layered.mechanisms.shared imports the fix module layered.fixes.a",
    ]


def shared_in_groups(package: Path) -> list[str]:
    """Each private module of a group of fixes (a package under ``fixes/``) that is no fix's own part
    (``_<fix>_*.py``): code its fixes share, which belongs in ``mechanisms/``, where code outside the group reaches
    it without importing a fix group (``reft_folder`` read checkpoints through ``fixes.checkpoints._files``)."""
    problems = []
    for group in sorted(path.parent for path in (package / "fixes").glob("*/__init__.py")):
        names = [path.stem for path in group.glob("*.py") if not path.stem.startswith("_")]
        for path in sorted(group.glob("_*.py")):
            if path.stem != "__init__" and not any(path.stem.startswith(f"_{name}_") for name in names):
                problems.append(f"{path.relative_to(package.parent)} is shared by the group's fixes: move it to "
                                f"{package.name}/mechanisms/")
    return problems


def test_a_group_of_fixes_keeps_no_shared_helper():
    import pyvene_dist

    problems = shared_in_groups(Path(pyvene_dist.__file__).parent)
    assert not problems, "\n".join(problems)


def test_a_shared_helper_in_a_group_is_named(tmp_path):
    package = tmp_path / "layered"
    (package / "fixes/group").mkdir(parents=True)
    for path in ("fixes/__init__.py", "fixes/_shared_at_top.py", "fixes/group/__init__.py", "fixes/group/a.py",
                 "fixes/group/_a_part.py", "fixes/group/_files.py"):
        (package / path).write_text("")
    assert shared_in_groups(package) == [
        "layered/fixes/group/_files.py is shared by the group's fixes: move it to layered/mechanisms/"]
