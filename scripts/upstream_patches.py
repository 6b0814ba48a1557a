"""Copy the installed pyvene and pyreft into a folder and apply the upstream diffs under patches/.

    python scripts/upstream_patches.py apply DEST        # DEST/pyvene, DEST/pyreft, every series applied
    python scripts/upstream_patches.py apply DEST --none # the same copies, unpatched (to see the tests fail)
    python scripts/upstream_patches.py check             # each diff still mirrors its runtime concern
    PYTHONPATH=DEST python -c "import pyvene; print(pyvene.FIXES)"

Each series is applied in order with ``patch -p1 --fuzz=0`` from DEST, first as a dry run; any fuzz,
offset or reject stops with patch's own output. ``check`` compares the ``Mirrors:`` line of every
diff's header (the git blob of ``pyvene_dist/fixes/<concern>.py`` the diff was written against)
with that file now: a runtime fix that changed needs its diff brought along, then the line updated.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PATCHES = ROOT / "patches"
PACKAGES = ("pyvene", "pyreft")
MIRRORS = re.compile(r"^Mirrors: (?P<path>\S+) \(git blob (?P<blob>[0-9a-f]{40})\)$", re.MULTILINE)


def series(package: str) -> list[Path]:
    """The diffs of ``patches/<package>/series``, in order (``#`` starts a comment)."""
    folder = PATCHES / package
    names = [line.split("#", 1)[0].strip() for line in (folder / "series").read_text().splitlines()]
    return [folder / name for name in names if name]


def installed(package: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"{package} is not installed in {sys.executable}'s environment")
    return Path(next(iter(spec.submodule_search_locations)))


def copy_installed(dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for package in PACKAGES:
        target = dest / package
        if target.exists():
            raise SystemExit(f"{target} exists; apply into an empty folder")
        shutil.copytree(installed(package), target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))


def apply(dest: Path, diff: Path) -> None:
    for dry_run in (True, False):
        command = ["patch", "-p1", "--fuzz=0", "--batch", "--forward", "--no-backup-if-mismatch", "-i", str(diff)]
        result = subprocess.run(command + (["--dry-run"] if dry_run else []), cwd=dest, capture_output=True, text=True)
        if result.returncode != 0 or re.search(r"(?i)\b(fuzz|offset|reject)", result.stdout):
            raise SystemExit(f"{diff.relative_to(ROOT)} does not apply cleanly in {dest}:\n{result.stdout}{result.stderr}")


def blob(path: Path) -> str:
    """``git hash-object path``, without git."""
    content = path.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


def stale() -> list[str]:
    """One line per diff whose runtime concern changed since it was written (or that names none)."""
    problems = []
    for package in PACKAGES:
        for diff in series(package):
            match = MIRRORS.search(diff.read_text().split("\ndiff ", 1)[0])
            if match is None:
                problems.append(f"{diff.relative_to(ROOT)}: its header has no 'Mirrors: <path> (git blob <sha>)' line")
                continue
            runtime = ROOT / match["path"]
            now = blob(runtime) if runtime.exists() else "missing"
            if now != match["blob"]:
                problems.append(
                    f"{diff.relative_to(ROOT)} mirrors {match['path']} at blob {match['blob'][:12]}, which is now "
                    f"{now[:12]}: bring the diff along with the runtime fix, then set its Mirrors line to {now}"
                )
    return problems


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    apply_parser = commands.add_parser("apply", help="copy the installed packages into DEST and apply each series")
    apply_parser.add_argument("dest", type=Path)
    apply_parser.add_argument("--none", action="store_true", help="copy only, apply nothing")
    commands.add_parser("check", help="every diff still mirrors its runtime concern")
    args = parser.parse_args(argv)
    if args.command == "check":
        problems = stale()
        print("\n".join(problems) or "every diff mirrors its runtime concern")
        raise SystemExit(1 if problems else 0)
    copy_installed(args.dest)
    if not args.none:
        for package in PACKAGES:
            for diff in series(package):
                apply(args.dest, diff)
    print(args.dest)


if __name__ == "__main__":
    main()
