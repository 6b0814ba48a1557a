"""The tests are laid out by what they test (docs/testing.md): each fix's in ``tests/fixes/test_<fix>.py``
(more modules of one fix as ``test_<fix>_<aspect>.py``), and module names are unique across tests/, because
pytest imports each module by its bare name (no ``__init__.py``) and spawned ranks import it again by that name.
"""

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


def layout_problems(folder: Path, names, renamed) -> list[str]:
    """Each fix in ``names`` without ``folder/test_<fix>.py``, and each module there named after no fix
    (saying the new name where it is named after one in ``renamed``)."""
    stems = sorted(path.stem.removeprefix("test_") for path in folder.glob("test_*.py"))
    problems = []
    for name in names:
        if name not in stems:
            old = [old for old in renamed if name in _new_names(old) and _owner(old, stems)]
            hint = f" (found {', '.join(f'test_{o}.py' for o in old)}, named after the old name)" if old else ""
            problems.append(f"fix {name!r} has no test module: expected {folder.name}/test_{name}.py{hint}")
    for stem in stems:
        if _owner(stem, names) is not None:
            continue
        old = _owner(stem, renamed)
        if old is not None:
            problems.append(f"{folder.name}/test_{stem}.py is named after fix {old!r}, which is now "
                            f"{' and '.join(map(repr, _new_names(old)))}: rename or split it")
        else:
            problems.append(f"{folder.name}/test_{stem}.py is named after no fix; fixes: {', '.join(sorted(names))}")
    return problems


def test_every_fix_has_its_test_module_and_every_module_there_a_fix():
    problems = layout_problems(TESTS / "fixes", [fix.name for fix in fixes.fixes()], fixes.RENAMED)
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


def test_module_names_are_unique_across_the_folders():
    folders = collections.defaultdict(list)
    for path in TESTS.rglob("*.py"):
        if path.name != "conftest.py" and "scripts" not in path.relative_to(TESTS).parts:
            folders[path.name].append(str(path.parent.relative_to(TESTS.parent)))
    clashes = {name: where for name, where in folders.items() if len(where) > 1}
    assert not clashes, f"modules of one name in several folders (pytest imports them by name): {clashes}"


def import_cycles(package: Path) -> list[list[str]]:
    """The cycles among ``package``'s modules through the imports each runs when it is imported (its top level;
    an import inside a function runs later and cannot deadlock or half-initialise a module)."""
    import ast

    modules = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    edges = collections.defaultdict(set)
    for module, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in ast.parse(path.read_text()).body:  # the top level only
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = module if is_package else module.rsplit(".", 1)[0]
                for _ in range(node.level - 1):
                    base = base.rsplit(".", 1)[0]
                prefix = f"{base}.{node.module}" if node.level and node.module else (base if node.level else node.module)
                # a submodule named is what runs; any other name is read from the module (or package) itself
                targets = [f"{prefix}.{alias.name}" if f"{prefix}.{alias.name}" in modules else prefix
                           for alias in node.names]
            else:
                continue
            edges[module] |= {target for target in targets if target in modules and target != module}
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
