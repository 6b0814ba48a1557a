"""Each fix's own tests fail without it: one sweep over every fix, on this machine.

For each fix (``pyvene_dist.fixes.fixes()``), its test modules (``tests/fixes/test_<fix>.py`` and
``tests/fixes/test_<fix>_*.py``, the layout ``tests/test_layout.py`` enforces) run in a pytest session of their own
with ``PYVENE_DIST_TEST_WITHOUT=<fix>`` (``tests/helpers.patch`` then leaves that fix out, and the fixes requiring
it). The fix passes the sweep where at least one of its tests fails; the session stops at its first failure
(``-x``). One row per fix goes to ``--out``; the exit status is 1 where some fix's tests all passed without it.

    python scripts/without_sweep.py --out benchmarks/results/without-sweep-cpu.jsonl
    python scripts/without_sweep.py --fixes householder,fast_path          # some fixes only
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests" / "fixes"


def modules_of(fix: str) -> list[Path]:
    """The fix's own test modules: ``test_<fix>.py`` and ``test_<fix>_<part>.py``."""
    found = [TESTS / f"test_{fix}.py"] + sorted(TESTS.glob(f"test_{fix}_*.py"))
    return [path for path in found if path.exists()]


def outcome(junit: Path) -> dict:
    """Counts and the first failing test of a JUnit XML report."""
    counts = {"failed": 0, "passed": 0, "skipped": 0}
    first = None
    for case in ET.parse(junit).getroot().iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            counts["failed"] += 1
            first = first or f"{case.get('classname')}::{case.get('name')}"
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return {**counts, "first_failure": first}


def sweep_one(fix: str, timeout: float) -> dict:
    modules = modules_of(fix)
    row = {"fix": fix, "modules": [str(path.relative_to(ROOT)) for path in modules]}
    if not modules:
        return {**row, "fails_without": False, "why": "no test module"}
    env = {**os.environ, "PYVENE_DIST_TEST_WITHOUT": fix}
    with tempfile.TemporaryDirectory() as folder:
        junit = Path(folder) / "junit.xml"
        started = time.perf_counter()
        try:
            result = subprocess.run(
                [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}",
                 *row["modules"]], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {**row, "fails_without": False, "why": f"timed out after {timeout:.0f} s"}
        seconds = round(time.perf_counter() - started, 1)
        found = outcome(junit) if junit.exists() else {"failed": 0, "passed": 0, "skipped": 0, "first_failure": None}
    fails = found["failed"] > 0
    why = None if fails else (result.stdout + result.stderr).strip().splitlines()[-1:]
    return {**row, **found, "returncode": result.returncode, "seconds": seconds, "fails_without": fails,
            **({"why": why[0] if why else "no test failed"} if not fails else {})}


def environment() -> dict:
    from pyvene_dist.versions import installed  # main() has put the checkout on sys.path

    names = ("torch", "transformers", "pyvene", "pyreft", "deepspeed", "accelerate")
    versions = {name: found for name in names if (found := installed.version(name)) is not None}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    return {"commit": commit.stdout.strip() or None, "date": now.date().isoformat(),
            "run_id": os.environ.get("PYVENE_DIST_RUN_ID") or f"{now:%Y%m%dT%H%M%SZ}-{platform.node()}",
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, no GPU" if not _has_cuda() else platform.node(),
            "versions": {**versions, "python": platform.python_version()}}


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fixes", help="comma-separated fix names (default: every fix)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per fix's session")
    parser.add_argument("--out", help="append one JSON row per fix to this file")
    options = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from pyvene_dist.fixes import fixes

    known = [fix.name for fix in fixes()]
    names = options.fixes.split(",") if options.fixes else known
    unknown = sorted(set(names) - set(known))
    if unknown:
        parser.error(f"--fixes names {unknown}, which are no fixes; known: {known}")
    shared = environment()
    rows = []
    for name in names:
        row = {**sweep_one(name, options.timeout), **shared}
        rows.append(row)
        mark = "fails without it" if row["fails_without"] else f"PASSES without it ({row.get('why')})"
        print(f"{name}: {mark}; {row.get('failed', 0)} failed, {row.get('passed', 0)} passed before stopping, "
              f"{row.get('seconds', '-')} s", flush=True)
        if options.out:
            with open(options.out, "a") as handle:
                handle.write(json.dumps(row) + "\n")
    missing = [row["fix"] for row in rows if not row["fails_without"]]
    print(f"{len(rows) - len(missing)} of {len(rows)} fixes: their tests fail without them"
          + (f"; not: {', '.join(missing)}" if missing else ""))
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
