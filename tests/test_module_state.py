"""No module of pyvene_dist keeps mutable state at module level, except ``_registry`` (the undo log, the import hook
and the per-model states it owns). State belongs to the model it serves (``pyvene_dist._state``): a module-level
dict filled at run time outlives ``unpatch()``, is shared by every model of the process, and is what issue 40
found in ``fixes/fast_path.py`` (``_same_source: dict = {}``).

Read with ``ast``, never imported: each assignment at module level (or in a class body at module level) whose value
is a mutable container, a literal (``{}``, ``[]``, ``{1}``, a comprehension) or a call that makes one (``dict()``,
``defaultdict(...)``, ``WeakKeyDictionary()``, ``threading.local()``, ...), and each ``global`` statement. Constant
tables are written as tuples, frozensets, strings or ``types.MappingProxyType`` (read-only), or annotated
``Final`` (a table the module never changes).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pyvene_dist

PACKAGE = Path(pyvene_dist.__file__).parent
#: Calls that return a new mutable container (by the called name: ``collections.defaultdict`` or ``defaultdict``).
MUTABLE_CALLS = frozenset({
    "dict", "list", "set", "bytearray", "defaultdict", "OrderedDict", "Counter", "deque", "ChainMap",
    "WeakKeyDictionary", "WeakValueDictionary", "WeakSet", "local",
})
MUTABLE_LITERALS = (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)
#: The one module whose job is process-wide state.
OWNER = "_registry.py"
#: Findings allowed, as "path:name" -> why. Constant tables are tuples, frozensets, ``MappingProxyType``s or ``Final``;
#: the one entry is run-time state of the test process, not of a model (an entry whose finding is gone fails
#: ``test_the_allow_list_names_only_what_is_there``).
ALLOWED = {
    "testing/_preloaded.py:_servers": "owner of testing/: the harness's fork servers, one per setting, for the "
                                      "process's life (test infrastructure, no model's state): the one real state",
}


def _called_name(node: ast.expr) -> str | None:
    return node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", None)


def _mutable(value: ast.expr | None) -> bool:
    return isinstance(value, MUTABLE_LITERALS) or (
        isinstance(value, ast.Call) and _called_name(value.func) in MUTABLE_CALLS)


def _final(node: ast.stmt) -> bool:
    annotation = getattr(node, "annotation", None)
    if isinstance(annotation, ast.Subscript):
        annotation = annotation.value
    return _called_name(annotation) == "Final" if annotation is not None else False


def _statements(body: list[ast.stmt]):
    """The statements that run at import: the module's, and those of its classes, ifs and trys."""
    for node in body:
        yield node
        if isinstance(node, ast.ClassDef):
            yield from _statements(node.body)
        for field in ("body", "orelse", "finalbody"):
            if not isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                yield from _statements(getattr(node, field, []))
        for handler in getattr(node, "handlers", []):
            yield from _statements(handler.body)


def module_state(source: str) -> list[tuple[int, str, str]]:
    """(line, name, what) for each mutable container assigned at import and each ``global`` statement."""
    tree = ast.parse(source)
    found = []
    for node in _statements(tree.body):
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and _mutable(node.value) and not _final(node):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                name = ast.unparse(target)
                found.append((node.lineno, name, f"{name} = {ast.unparse(node.value)[:60]}"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            found.append((node.lineno, ",".join(node.names), f"global {', '.join(node.names)}"))
    return sorted(found)


def findings(package: Path = PACKAGE) -> dict[str, str]:
    """"path:name" -> "path:line: what" for every module of ``package`` but ``_registry.py``."""
    found = {}
    for path in sorted(package.rglob("*.py")):
        relative = path.relative_to(package).as_posix()
        if relative == OWNER:
            continue
        for line, name, what in module_state(path.read_text(encoding="utf-8")):
            found[f"{relative}:{name}"] = f"pyvene_dist/{relative}:{line}: {what}"
    return found


def test_no_module_keeps_mutable_state_outside_the_registry():
    found = findings()
    unexpected = [where for key, where in found.items() if key not in ALLOWED]
    assert not unexpected, "module-level mutable state (state belongs to the model: pyvene_dist._state; a " \
        "constant table is a tuple, frozenset, MappingProxyType or Final):\n" + "\n".join(unexpected)


def test_the_allow_list_names_only_what_is_there():
    """An entry whose finding is gone (the owner made it a constant) leaves the list, so that the list cannot come to
    excuse a new dict of the same name."""
    found = findings()
    stale = [key for key in ALLOWED if key not in found]
    assert not stale, f"allowed but not found (take them out of ALLOWED): {stale}"


def test_each_kind_of_module_state_is_found():
    source = (
        "import collections, threading, weakref\n"
        "from typing import Final\n"
        "CACHE: dict = {}\n"
        "NAMES = [1, 2]\n"
        "SEEN = {1}\n"
        "BY = collections.defaultdict(list)\n"
        "REFS = weakref.WeakKeyDictionary()\n"
        "LOCAL = threading.local()\n"
        "if True:\n"
        "    LATE = dict()\n"
        "class Holder:\n"
        "    shared = {}\n"
        "def f():\n"
        "    global CACHE\n"
        "    inner = {}\n"
        "TUPLE = (1, 2)\n"
        "FROZEN = frozenset({1})\n"
        "TABLE: Final = {'a': 1}\n"
        "WORD = 'x'\n"
    )
    names = [name for _, name, _ in module_state(source)]
    assert names == ["CACHE", "NAMES", "SEEN", "BY", "REFS", "LOCAL", "LATE", "shared", "CACHE"]
