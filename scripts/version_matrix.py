#!/usr/bin/env python3
"""The version matrix: pyvene_dist's core tests and ``pyvene-dist check`` at the oldest releases setup.cfg admits,
at the newest on the registry, with pyreft's git main, and at CI's pins, each in a fresh venv of its own.

    python3 scripts/version_matrix.py                        # every column: build each venv, then run each
    python3 scripts/version_matrix.py --columns newest --reuse   # run again in the venv built before

Run it on demand and before each release; CI keeps its pinned constraints (``scripts/constraints.txt``).
Each column appends one row to ``benchmarks/results/version-matrix.jsonl`` (``--results``) and the script prints
the table of the rows it wrote. The venvs live under ``--venvs`` (``$PYVENE_DIST_MATRIX_VENVS``; default
``venvs/`` beside the repository), one folder ``matrix-<column>`` each, with the build's log beside it.

Standard library only: it runs with any Python 3.10+, and the venvs are made with that Python.

This file holds the columns and the command; matrix_rows.py beside it the pure parts (what a column is, the row
it writes, the table) and matrix_venvs.py the venvs (building one, running the suite and the check in it).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from matrix_rows import Column, floors, make_row, passed, table, table_cells
from matrix_venvs import ALLOW_ENV, ROOT, build, installed_versions, run_column, venv_path, venv_state

RESULTS = ROOT / "benchmarks" / "results" / "version-matrix.jsonl"
CONSTRAINTS = ROOT / "scripts" / "constraints.txt"
#: pyreft's git main, as the sessions keep it beside the repository (read-only: the column installs a copy).
PYREFT_MAIN = ROOT.parent / "shared" / "upstream" / "pyreft-main-dafd099"


def columns(setup_cfg: Path = ROOT / "setup.cfg") -> dict[str, Column]:
    """The matrix's columns, in the order they run."""
    oldest = tuple(f"{name}=={version}" for name, version in sorted(floors(setup_cfg).items()))
    return {column.name: column for column in (
        Column("oldest", "the floors of setup.cfg (==each >=), pyreft 0.1.0; the rest as pip resolves them",
               pins=oldest),
        Column("newest", "what pip resolves today, no constraints file and no cap on torch",
               lift_torch_cap=True, torch_fallback="torch==2.14.1"),
        Column("pyreft-main", "as newest, with pyreft's git main (dafd099) for pyreft 0.1.0",
               lift_torch_cap=True, torch_fallback="torch==2.14.1", pyreft=str(PYREFT_MAIN)),
        Column("pinned", "CI's scripts/constraints.txt and torch 2.13.0 (CPU build), as scripts/setup.sh",
               pins=tuple(_requirement_lines(CONSTRAINTS)), torch="torch==2.13.0"),
    )}


def _requirement_lines(path: Path) -> list[str]:
    return [line.strip() for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")]


# --- the command -----------------------------------------------------------------------------------------------

def commit_label() -> str:
    head = subprocess.run(["git", "rev-parse", "--short=7", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()
    changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "pyvene_dist", "tests"],
                             cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    return f"{head}-dirty" if changed else head


def default_machine() -> str:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"CPU, {cores} cores ({os.uname().machine})"


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--columns", default="oldest,newest,pyreft-main",
                        help="comma-separated, of: " + ", ".join(columns()) + " (default: oldest,newest,pyreft-main)")
    parser.add_argument("--venvs", type=Path,
                        default=Path(os.environ.get("PYVENE_DIST_MATRIX_VENVS", ROOT.parent / "venvs")),
                        help="folder of the venvs, one matrix-<column> each ($PYVENE_DIST_MATRIX_VENVS; "
                             "default: venvs/ beside the repository)")
    parser.add_argument("--reuse", action="store_true", help="run in the venvs already built (no fresh install)")
    parser.add_argument("--build-only", action="store_true", help="build the venvs (at once) and stop")
    parser.add_argument("--allow-unsupported", action="store_true",
                        help=f"set {ALLOW_ENV}=1 for the tests and the check (recorded in the row)")
    parser.add_argument("--results", type=Path, default=RESULTS, help="the JSONL file the rows are appended to")
    parser.add_argument("--machine", default=default_machine(), help="what the row says ran it")
    parser.add_argument("--table", action="store_true", help="print the table of the last row of each column in "
                                                             "--results and stop")
    return parser


def main(argv: list[str] | None = None) -> int:
    arguments = parser().parse_args(argv)
    known = columns()
    if arguments.table:
        print(table(latest_rows(arguments.results)))
        return 0
    chosen = [name.strip() for name in arguments.columns.split(",") if name.strip()]
    unknown = [name for name in chosen if name not in known]
    if unknown:
        print(f"version_matrix: unknown column {', '.join(unknown)}; expected one of {', '.join(known)}",
              file=sys.stderr)
        return 2
    built: dict[str, tuple[dict, float | None]] = {}
    if not arguments.reuse:
        def build_one(name: str):
            venv = venv_path(arguments.venvs, name)
            started = time.monotonic()
            with open(f"{venv}.build.log", "w") as log:
                result = build(known[name], venv, log)
            return name, result, round(time.monotonic() - started, 1)

        with ThreadPoolExecutor(max_workers=len(chosen)) as pool:  # the downloads overlap
            futures = [pool.submit(build_one, name) for name in chosen]
            for future in futures:
                try:
                    name, result, seconds = future.result()
                    built[name] = (result, seconds)
                    print(f"version_matrix: built {name} in {seconds:.0f} s", file=sys.stderr)
                except subprocess.CalledProcessError as error:
                    print(f"version_matrix: a build failed: {' '.join(error.cmd)} exited {error.returncode} (see "
                          f"the .build.log under {arguments.venvs})", file=sys.stderr)
        if arguments.build_only:
            return 0 if len(built) == len(chosen) else 1
    rows = []
    for name in chosen:
        if not arguments.reuse and name not in built:
            continue
        venv = venv_path(arguments.venvs, name)
        if not (venv / "bin" / "python").exists():
            print(f"version_matrix: no venv at {venv}; run without --reuse to build it", file=sys.stderr)
            return 2
        with open(f"{venv}.run.log", "w") as log:
            measured = run_column(known[name], venv, arguments.allow_unsupported, log)
        build_record, install_seconds = built.get(name, ({}, None))
        row = make_row(known[name], installed_versions(venv), measured, build_record, commit=commit_label(),
                       date=datetime.date.today().isoformat(), machine=arguments.machine,
                       allow_unsupported=arguments.allow_unsupported,
                       venv_state=venv_state(venv, arguments.reuse), install_seconds=install_seconds)
        arguments.results.parent.mkdir(parents=True, exist_ok=True)
        with open(arguments.results, "a") as out:
            out.write(json.dumps(row) + "\n")
        rows.append(row)
        print(f"version_matrix: {name}: {table_cells(row)}", file=sys.stderr)
    print(table(rows))
    return 0 if rows and all(passed(row) for row in rows) and len(rows) == len(chosen) else 1


def latest_rows(results: Path) -> list[dict]:
    """The last row of each column in ``results``, in the columns' order."""
    rows = [json.loads(line) for line in results.read_text().splitlines() if line.strip()]
    last = {row["column"]: row for row in rows}
    order = list(columns())
    return sorted(last.values(), key=lambda row: order.index(row["column"]) if row["column"] in order else len(order))


if __name__ == "__main__":
    sys.exit(main())
