"""The forms of the functions the fixes depend on, read from their files without importing them, and the table of
the forms known to work (``table.KNOWN``).

A fix depends on the functions it wraps, replaces or enters (each place of its sites but ``add``) and on those it
names in ``relies_on``: its ``targets``. A target's form is its source fingerprint, the first 16 hex digits of the
SHA-256 of its dedented source, as ``fingerprint`` gives for the function object. Here it comes from the
module's file, found as the import system would find it (``module_file``; nothing is imported, not even a parent
package) and read as ``inspect.getsource`` reads it: from the function's first line (its first decorator's), found
through the file's cached bytecode (the code objects' ``co_firstlineno``, as ``inspect`` does) or, without fresh
bytecode, with ``ast``, then the block ``inspect.getblock`` gives. ``patch()`` can so check pyreft and
``transformers.trainer``, which it patches only when they are imported. Each file is read once per change of it.

``table.KNOWN`` maps each target to its forms, each with the releases it was seen and tested with; a fix's "checked on"
is derived from it (``checked_on``), per distribution. ``record`` adds the installed environment's forms (or a
source tree's) and rewrites the table: ``python -m pyvene_dist.fix_list --record`` after a run passed there.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import hashlib
import importlib.util
import inspect
import marshal
import os
import sys
import textwrap
import tokenize
import types
from importlib.machinery import PathFinder
from pathlib import Path
from typing import Iterable, Protocol

from packaging.version import InvalidVersion, Version

from . import installed
from .table import FILES, KNOWN


class Dependent(Protocol):
    """What the table reads of a fix's record (``_records.Fix``, which imports this package): the places it touches
    and the functions it relies on besides."""

    name: str
    places: tuple
    relies_on: tuple[str, ...]


#: The form of a target whose module does not define it (a release that added or removed the function).
ABSENT = "absent"
#: The form of a target whose module has no Python source to read (bytecode only, an extension module).
NO_SOURCE = "none"
#: The table: a package of one generated module per distribution (``forms_<distribution>.py``).
TABLE = Path(__file__).with_name("table")


def digest(source: str) -> str:
    """The fingerprint of a function's source as ``inspect.getsource`` returns it."""
    return hashlib.sha256(textwrap.dedent(source).encode()).hexdigest()[:16]


def fingerprint(original) -> str:
    """The first 16 hex digits of the SHA-256 of ``original``'s source (dedented): the form of a function object."""
    return digest(inspect.getsource(getattr(original, "__func__", original)))


@dataclasses.dataclass(frozen=True)
class Target:
    """A function a fix depends on: ``"module:Qualified.name"``, as ``KNOWN`` keys it."""

    path: str
    #: For a re-export's place (``Site.reexported_in``): the module it takes the function from.
    reexports: str | None = None
    #: The fix checks this one's form itself (``Site.any_form``): recorded, but a change refuses nothing.
    any_form: bool = False

    @property
    def module(self) -> str:
        return self.path.split(":")[0]

    @property
    def distribution(self) -> str:
        """The distribution that ships it: the top-level package's name (pyvene, pyreft, torch, transformers)."""
        return self.module.split(".")[0]


def targets(fix: Dependent) -> tuple[Target, ...]:
    """What ``fix`` depends on: each place of its sites but those it adds, then its ``relies_on``."""
    found = [Target(place.path, place.reexports, place.any_form) for place in fix.places if place.kind != "add"]
    return tuple(dict.fromkeys(found + [Target(path) for path in fix.relies_on]))


def module_file(module: str, root: str | os.PathLike | None = None) -> str | None:
    """The file the import system would load ``module`` from (from the folder ``root`` instead of ``sys.path``
    where given), or None. Imports nothing: a module imported already is where it was loaded from; else each
    package on the way is looked up by ``PathFinder`` in its parent's folders (``importlib.util.find_spec``
    would import the parents)."""
    parts = module.split(".")
    search: list[str] | None = None if root is None else [os.fspath(root)]
    spec = None
    for depth in range(len(parts)):
        name = ".".join(parts[: depth + 1])
        loaded = sys.modules.get(name) if root is None else None
        spec = getattr(loaded, "__spec__", None)
        if spec is None and depth == 0 and root is None:
            spec = importlib.util.find_spec(name)  # a top-level name has no parent to import; every finder is asked
        elif spec is None:
            spec = PathFinder.find_spec(name, search)
        if spec is None:
            return None
        search = [os.fspath(folder) for folder in spec.submodule_search_locations or ()]  # transformers' are Paths
    return spec.origin if spec.has_location else None


@dataclasses.dataclass(frozen=True)
class _Source:
    lines: list[str]
    #: qualified name -> index of its first line (its first decorator's), the last definition of the name.
    starts: dict[str, int]


def _stamp(file: str) -> tuple[str, int, int]:
    """``file`` with its modification time and size: the caches below read a file again when it changes."""
    stat = os.stat(file)
    return file, stat.st_mtime_ns, stat.st_size


@functools.lru_cache(maxsize=128)
def _file_digest(file: str, mtime_ns: int, size: int) -> str:
    return hashlib.sha256(Path(file).read_bytes()).hexdigest()[:16]


@functools.lru_cache(maxsize=128)
def _source(file: str, mtime_ns: int, size: int, from_bytecode: bool) -> _Source:
    with tokenize.open(file) as handle:  # as linecache reads it for inspect
        lines = handle.readlines()
    starts = (_starts_from_bytecode(file, mtime_ns, size) if from_bytecode else None) or _starts_from_ast(lines)
    return _Source(lines, starts)


@functools.lru_cache(maxsize=1024)
def _form(file: str, mtime_ns: int, size: int, qualified: str, from_bytecode: bool) -> str | None:
    """The fingerprint of ``qualified`` as ``file`` defines it, or None where it does not."""
    source = _source(file, mtime_ns, size, from_bytecode and sys.version_info >= (3, 11))
    start = source.starts.get(qualified)
    return None if start is None else digest("".join(inspect.getblock(source.lines[start:])))


def _starts_from_bytecode(file: str, mtime_ns: int, size: int) -> dict[str, int] | None:
    """The functions' first lines from the file's cached bytecode, where it is fresh: milliseconds where ``ast``
    takes a tenth of a second for ``transformers/trainer.py``. None without it (Python 3.10's code objects lack
    ``co_qualname``, so it is not asked there)."""
    try:
        data = Path(importlib.util.cache_from_source(file)).read_bytes()
    except (OSError, NotImplementedError, ValueError):
        return None
    flags = int.from_bytes(data[4:8], "little")
    if data[:4] != importlib.util.MAGIC_NUMBER:
        return None
    if flags & 1:  # hash-based
        if data[8:16] != importlib.util.source_hash(Path(file).read_bytes()):
            return None
    elif (int.from_bytes(data[8:12], "little") != (mtime_ns // 10**9) & 0xFFFFFFFF
            or int.from_bytes(data[12:16], "little") != size & 0xFFFFFFFF):
        return None
    starts, pending = {}, [marshal.loads(data[16:])]
    while pending:
        code = pending.pop(0)
        for constant in code.co_consts:
            if isinstance(constant, types.CodeType) and "<" not in constant.co_qualname:
                starts[constant.co_qualname] = constant.co_firstlineno - 1
                pending.append(constant)
    return starts


def _starts_from_ast(lines: list[str]) -> dict[str, int]:
    starts: dict[str, int] = {}

    def visit(body: list, prefix: str) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                first = min([node.lineno] + [decorator.lineno for decorator in node.decorator_list])
                starts[prefix + node.name] = first - 1
                if isinstance(node, ast.ClassDef):
                    visit(node.body, f"{prefix}{node.name}.")
            else:  # definitions under if/try/with at this level
                for field in ("body", "orelse", "finalbody", "handlers"):
                    visit([n for n in getattr(node, field, ()) if isinstance(n, (ast.stmt, ast.excepthandler))],
                          prefix)

    visit(ast.parse("".join(lines)).body, "")
    return starts


def static_fingerprint(target: Target, root: str | os.PathLike | None = None, from_bytecode: bool = True,
                       index: dict | None = None) -> str | None:
    """``target``'s form read from its file (``ABSENT`` where its module does not define it, ``NO_SOURCE`` where the
    module has no source), or None where the module is not found.

    With ``index`` (``known_files()``), a file byte for byte one recorded answers from it without reading the
    function (tokenizing the functions takes most of the time otherwise)."""
    module, qualified = target.path.split(":")
    file = module_file(module, root)
    if file is None:
        return None
    if not file.endswith(".py"):
        return NO_SOURCE
    stamp = _stamp(file)
    if index is not None and target.reexports is None:
        indexed = index.get(module, {}).get(_file_digest(*stamp), {}).get(qualified)
        if indexed is not None:
            return indexed
    form = _form(*stamp, qualified, from_bytecode)
    if form is None and target.reexports is not None:  # the name comes from the module it re-exports
        return static_fingerprint(Target(f"{target.reexports}:{qualified}"), root, from_bytecode, index)
    return ABSENT if form is None else form


# --- the table of known forms ------------------------------------------------------------------------------


def known() -> dict[str, dict[str, tuple[str, ...]]]:
    """Target -> {form: the releases it was seen and tested with}."""
    return KNOWN


def known_files() -> dict[str, dict[str, dict[str, str]]]:
    """Module -> {digest of a file it was recorded from: {qualified name: its form there}}: ``static_fingerprint``'s
    index, so that a release as recorded is checked by hashing files."""
    return FILES


def checked_on(fix: Dependent, table: dict | None = None) -> dict[str, list[str]]:
    """Distribution -> the releases in which every function ``fix`` depends on there was recorded, as the table
    has them (``0.1.0+git.dafd099`` for a git checkout)."""
    table = known() if table is None else table
    releases: dict[str, set[str]] = {}
    for target in targets(fix):
        seen = {release for form in table.get(target.path, {}).values() for release in form}
        current = releases.get(target.distribution)
        releases[target.distribution] = seen if current is None else current & seen
    return {name: sorted(found, key=_release_order) for name, found in releases.items()}


def _release_order(release: str):
    try:
        return (0, Version(release), release)
    except InvalidVersion:
        return (1, None, release)


# --- the installed environment against the table -----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Changed:
    """A function ``fix`` depends on whose installed form none of those known."""

    fix: str
    target: str
    found: str
    known: dict[str, tuple[str, ...]]

    def __str__(self) -> str:
        return (f"the fix {self.fix!r} depends on {self.target}, whose source here has the fingerprint {self.found}, "
                f"and knows {known_forms(self.known)}")


def known_forms(forms: dict[str, tuple[str, ...]]) -> str:
    """``d474bae7d6bf39cc (0.1.0), 983e15605f290488 (0.1.0+git.dafd099)``, or that there is none."""
    return ", ".join(f"{form} ({', '.join(releases)})" for form, releases in forms.items()) or "no form of it"


@dataclasses.dataclass(frozen=True)
class Survey:
    """What the version guard (``guard.check``) reads of the installed packages for a set of fixes."""

    #: Every function of the fixes whose installed form is not known, where its distribution is installed.
    changed: tuple[Changed, ...]
    #: Distribution -> installed version, for each release no form of the fixes' functions was recorded with.
    unlisted: dict[str, str]


def survey(fixes: Iterable[Dependent]) -> Survey:
    """The forms of every function ``fixes`` depend on against the table, and the installed releases against
    those the table records for them: read in one pass, the installed versions last (``installed``)."""
    table, index = known(), known_files()
    forms, recorded = [], {}
    for fix in fixes:
        for distribution, releases in checked_on(fix, table).items():
            public = {Version(release).public for release in releases}
            recorded[distribution] = recorded.get(distribution, public) & public
        forms += [(fix.name, target, static_fingerprint(target, index=index))
                  for target in targets(fix) if not target.any_form]
    versions = {name: installed.version(name)
                 for name in {target.distribution for _, target, _ in forms} | recorded.keys()}
    changed = tuple(Changed(name, target.path, form or ABSENT, table.get(target.path, {}))
                    for name, target, form in forms
                    if (form is not None or versions[target.distribution] is not None)  # pyreft absent: no sites
                    and (form or ABSENT) not in table.get(target.path, {}))
    unlisted = {name: version for name, version in versions.items()
                if version is not None and name in recorded and Version(version).public not in recorded[name]}
    return Survey(changed, unlisted)


Table = tuple[dict[str, dict[str, tuple[str, ...]]], dict[str, dict[str, dict[str, str]]]]


def record(fixes: Iterable[Dependent], root: str | os.PathLike | None = None,
           releases: dict[str, str] | None = None) -> Table:
    """The table (``KNOWN``, ``FILES``) with the forms of every target of ``fixes`` added, as found in this
    environment (or, with ``root``, in that source tree, under the releases ``releases`` names per distribution),
    and without the targets no fix depends on any longer."""
    every = {target.path: target for fix in fixes for target in targets(fix)}
    table = {path: dict(forms) for path, forms in known().items() if path in every}
    modules = {target.module for target in every.values()}
    files = {module: {file: dict(forms) for file, forms in found.items()}
             for module, found in known_files().items() if module in modules}
    for path, target in every.items():
        if root is not None and (releases or {}).get(target.distribution) is None:
            continue
        release = (releases or {}).get(target.distribution) or installed.release(target.distribution)
        form = static_fingerprint(target, root)
        if release is None or form is None:  # not installed here (pyreft is optional)
            continue
        forms = table.setdefault(path, {})
        forms[form] = tuple(sorted(set(forms.get(form, ())) | {release}, key=_release_order))
        file = module_file(target.module, root)
        if target.reexports is None and file is not None and file.endswith(".py"):
            module, qualified = path.split(":")
            files.setdefault(module, {}).setdefault(_file_digest(*_stamp(file)), {})[qualified] = form
    return table, files


def _literal(mapping: dict, depth: int = 1) -> str:
    """``mapping`` as a Python literal, one key a line, nested mappings indented below their key."""
    pad = "    " * depth
    lines = [f"{pad}{key!r}: {_literal(value, depth + 1) if isinstance(value, dict) else repr(value)},"
             for key, value in mapping.items()]
    return "{\n" + "\n".join(lines) + "\n" + "    " * (depth - 1) + "}"


def write(table: Table, folder: Path = TABLE) -> None:
    """The table as ``folder/forms_<distribution>.py``, one module per distribution (the top-level package)."""
    forms_known, files = table
    by_distribution: dict[str, tuple[dict, dict]] = {}
    for path, forms in sorted(forms_known.items()):
        by_distribution.setdefault(path.split(".")[0].split(":")[0], ({}, {}))[0][path] = forms
    for module, found in sorted(files.items()):
        sorted_found = {digest: dict(sorted(forms.items())) for digest, forms in found.items()}
        by_distribution.setdefault(module.split(".")[0], ({}, {}))[1][module] = sorted_found
    for stale in folder.glob("forms_*.py"):
        if stale.stem.removeprefix("forms_") not in by_distribution:
            stale.unlink()
    for distribution, (known_here, files_here) in by_distribution.items():
        (folder / f"forms_{distribution}.py").write_text(
            f'"""The forms of the {distribution} functions pyvene_dist\'s fixes depend on (``versions.forms``). '
            "Generated: after a\nrun passes on other releases, ``python -m pyvene_dist.fix_list --record`` adds "
            "their forms (``--source DIR\n--release NAME=RELEASE`` a source tree's). Edit by re-recording, not by "
            'hand."""\n\n'
            "from typing import Final\n\n"
            "#: Target -> {source fingerprint: the releases it was seen and tested with}.\n"
            f"KNOWN: Final = {_literal(known_here)}\n\n"
            "#: Module -> {digest of a file recorded: {function: its fingerprint there}}: a file as recorded is not "
            "read.\n"
            f"FILES: Final = {_literal(files_here)}\n"
        )
