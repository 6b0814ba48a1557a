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
"""

from __future__ import annotations

import argparse
import configparser
import dataclasses
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "version-matrix.jsonl"
CONSTRAINTS = ROOT / "scripts" / "constraints.txt"
#: pyreft's git main, as the sessions keep it beside the repository (read-only: the column installs a copy).
PYREFT_MAIN = ROOT.parent / "shared" / "upstream" / "pyreft-main-dafd099"
#: The extras of setup.cfg a column installs (setup.sh installs the same), and the floors it reads from them.
EXTRAS = ("test", "accelerate")
FLOOR_SECTIONS = (("options", "install_requires"), ("options.extras_require", "test"),
                  ("options.extras_require", "accelerate"), ("options.extras_require", "deepspeed"))
#: What each row records the version of (``importlib.metadata`` names).
PACKAGES = ("torch", "transformers", "accelerate", "deepspeed", "peft", "pyvene", "pyreft", "wrapt", "datasets",
            "pytest", "hypothesis")

#: The core suite: patching (the order matrix in subprocesses, every site wrapped and restored), the user
#: errors, a few fixes' own tests (locations, checkpoints, pyreft's trainer, zero_grad), and the parity tests of
#: one module each for DDP, FSDP2, accelerate and DeepSpeed (1 and 2 gloo ranks on CPU); the rows give its time.
#: Left out: the launchers (``-m slow``), GPU tests, and tests/fixes/test_gradient_checkpointing.py (the same
#: strategies again with checkpointing: 378 of the 1,343 s these files took with it, on the 2 cores beside three
#: other sessions' tests). The full suite takes 20-28 minutes.
CORE_TESTS = (
    "tests/test_patching.py",
    "tests/test_user_errors.py",
    "tests/fixes/test_locations.py",
    "tests/fixes/test_loreft_state_dict.py",  # the checkpoints group's tests but the dtype ones
    "tests/fixes/test_intervention_files.py",
    "tests/fixes/test_trainer_saves.py",
    "tests/fixes/test_hf_resume.py",
    "tests/fixes/test_reft_compute_loss.py",
    "tests/fixes/test_zero_grad.py",
    "tests/strategies/test_ddp.py",
    "tests/fixes/test_fsdp.py",
    "tests/strategies/test_accelerate.py",
    "tests/fixes/test_deepspeed.py",
)
CORE_MARKERS = "not slow"
#: The environment of the core suite and the check: on CPU, DeepSpeed on its CPU accelerator.
RUN_ENVIRONMENT = {"DS_ACCELERATOR": "cpu", "PYTHONDONTWRITEBYTECODE": "1"}
ALLOW_ENV = "PYVENE_DIST_ALLOW_UNSUPPORTED"


@dataclasses.dataclass(frozen=True)
class Column:
    """How one column's venv is built. ``pins``: requirement lines pip takes as constraints (``-c``) for every
    install; ``torch``: what is asked for first, and ``torch_fallback`` if that fails to install (the reason goes
    into the row); ``lift_torch_cap``: install without pip's configuration files, so a machine-wide constraint
    (this machine's /etc/xdg/pip caps torch at 2.14.1) does not hold the column back; ``pyreft``: ``"pypi"``
    (0.1.0, --no-deps, as setup.sh) or a source folder, copied and installed --no-deps."""

    name: str
    description: str
    pins: tuple[str, ...] = ()
    torch: str = "torch"
    torch_fallback: str | None = None
    lift_torch_cap: bool = False
    pyreft: str = "pypi"


def floors(setup_cfg: Path = ROOT / "setup.cfg") -> dict[str, str]:
    """Distribution -> the lowest release setup.cfg admits (``name>=X``) in install_requires and the extras a
    column installs. Requirements without a lower bound are left out: any release satisfies them."""
    parser = configparser.ConfigParser()
    parser.read(setup_cfg)
    found: dict[str, str] = {}
    for section, key in FLOOR_SECTIONS:
        for line in parser.get(section, key, fallback="").splitlines():
            match = re.fullmatch(r"\s*([A-Za-z0-9_.\-]+)\s*>=\s*([0-9][\w.]*)\s*", line.split("#")[0])
            if match:
                name, version = match.groups()
                if name in found and found[name] != version:
                    raise ValueError(f"setup.cfg gives {name} two floors: {found[name]} and {version}")
                found[name] = version
    return found


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


# --- building a column's venv --------------------------------------------------------------------------------

def venv_path(root: Path, column: str) -> Path:
    return root / f"matrix-{column}"


def pip_environment(column: Column) -> dict[str, str]:
    environment = dict(os.environ)
    if column.lift_torch_cap:
        environment["PIP_CONFIG_FILE"] = os.devnull  # no pip.conf: neither the machine's cap nor its constraint
        environment.pop("PIP_CONSTRAINT", None)
    return environment


def build(column: Column, venv: Path, log) -> dict:
    """Make ``venv`` afresh and install the column into it, as scripts/setup.sh installs .venv. Returns what the
    row records of the build (the torch actually asked for, and why, when it fell back)."""
    if venv.exists():
        shutil.rmtree(venv)
    venv.parent.mkdir(parents=True, exist_ok=True)
    _run([sys.executable, "-m", "venv", str(venv)], log)
    environment = pip_environment(column)
    constraints = []
    if column.pins:
        (venv / "constraints.txt").write_text("\n".join(column.pins) + "\n")
        constraints = ["-c", str(venv / "constraints.txt")]

    def pip(*arguments: str) -> None:
        _run([str(venv / "bin" / "python"), "-m", "pip", "--disable-pip-version-check", *arguments], log,
             env=environment)

    pip("install", "--upgrade", "pip")
    built = {"torch_requested": column.torch}
    try:
        pip("install", *constraints, column.torch)
    except subprocess.CalledProcessError as error:
        if column.torch_fallback is None:
            raise
        built = {"torch_requested": column.torch_fallback,
                 "torch_note": f"{column.torch} did not install (pip exited {error.returncode}; see the build log)"
                               f", so {column.torch_fallback} under this machine's cap"}
        environment = dict(os.environ)
        pip("install", *constraints, column.torch_fallback)
    # DeepSpeed builds against the torch above, so without build isolation; setup.sh's order.
    pip("install", *constraints, "setuptools", "wheel")
    pip("install", *constraints, "--no-build-isolation", "deepspeed")
    pip("install", *constraints, "-e", f"{ROOT}[{','.join(EXTRAS)}]")
    if column.pyreft == "pypi":
        pip("install", *constraints, "--no-deps", "pyreft==0.1.0")
    else:
        with tempfile.TemporaryDirectory() as folder:  # the source stays read-only: pip builds in the copy,
            copy = Path(folder) / Path(column.pyreft).name  # named as the source (the row reads its commit there)
            shutil.copytree(column.pyreft, copy, ignore=shutil.ignore_patterns(".git"))
            pip("install", "--no-deps", str(copy))
    _build_deepspeed_comm_op(venv, log)
    return built


def _build_deepspeed_comm_op(venv: Path, log) -> None:
    """DeepSpeed's CPU shared-memory op, built now (as setup.sh does) rather than inside the first test's time
    limit; into the venv's own extensions folder, so that columns with different torch builds never share one."""
    code = ("from deepspeed.accelerator import get_accelerator; "
            "get_accelerator().create_op_builder('ShareMemCommBuilder').load()")
    try:
        _run([str(venv / "bin" / "python"), "-c", code], log, env=run_environment(venv, False), timeout=900)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired):
        log.write("version_matrix: DeepSpeed's shm comm op did not build; the first DeepSpeed test will\n")


def _run(command: list[str], log, env: dict | None = None, timeout: float | None = None) -> None:
    log.write(f"$ {' '.join(command)}\n")
    log.flush()
    subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env, check=True, timeout=timeout, cwd=ROOT)


# --- running a column ----------------------------------------------------------------------------------------

def run_environment(venv: Path, allow_unsupported: bool) -> dict[str, str]:
    """The venv's bin first on PATH, and this checkout's pyvene_dist first on sys.path (the venv's editable
    install may point at another checkout: a venv built once serves a clean worktree of each commit)."""
    environment = {**os.environ, **RUN_ENVIRONMENT, "TORCH_EXTENSIONS_DIR": str(venv / "torch_extensions"),
                   "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}", "VIRTUAL_ENV": str(venv),
                   "PYTHONPATH": str(ROOT)}
    environment.pop(ALLOW_ENV, None)
    if allow_unsupported:
        environment[ALLOW_ENV] = "1"
    return environment


def pytest_counts(junit: Path) -> dict:
    """passed/failed/errors/skipped and the failing tests' ids, from pytest's junit XML."""
    root = ElementTree.parse(junit).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "failed_tests": []}
    for suite in suites:
        for case in suite.iter("testcase"):
            outcome = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
            counts[{"failure": "failed", "error": "errors"}.get(outcome, outcome)] += 1
            if outcome in ("failure", "error"):
                counts["failed_tests"].append(f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}")
    return counts


def check_summary(returncode: int, stdout: str, stderr: str) -> dict:
    """``pyvene-dist check --json``'s verdict: ``passed`` (exit 0), ``failed`` (a strategy differs or failed: the
    rows say which), or ``error`` (no rows: the last line it printed)."""
    try:
        rows = json.loads(stdout)
    except json.JSONDecodeError:
        last = next((line for line in reversed(stderr.splitlines()) if line.strip()), "")
        return {"verdict": "error", "exit_code": returncode, "detail": last[:500]}
    verdicts: dict[str, int] = {}
    for row in rows:
        verdicts[row["verdict"]] = verdicts.get(row["verdict"], 0) + 1
    wrong = [f"{row['strategy']} x{row['world_size']}: {row['verdict']}" for row in rows
             if row["verdict"] in ("differs", "failed")]
    unavailable = [f"{row['strategy']} x{row['world_size']}" for row in rows if row["verdict"] == "unavailable"]
    return {"verdict": "passed" if returncode == 0 else "failed", "exit_code": returncode, "rows": verdicts,
            "wrong": wrong, "unavailable": unavailable}


def installed_versions(venv: Path) -> dict:
    """The releases in the venv, and where pyreft came from (a local folder leaves a direct_url.json)."""
    code = ("import json, importlib.metadata as m, platform\n"
            f"names = {list(PACKAGES)!r}\n"
            "def version(name):\n"
            "    try:\n        return m.version(name)\n"
            "    except m.PackageNotFoundError:\n        return None\n"
            "found = {name: version(name) for name in names}\n"
            "import torch; found['torch'] = torch.__version__\n"
            "found['python'] = platform.python_version()\n"
            "try:\n    url = m.distribution('pyreft').read_text('direct_url.json')\n"
            "except m.PackageNotFoundError:\n    url = None\n"
            "found['pyreft_from'] = json.loads(url)['url'] if url else 'the registry'\n"
            "print(json.dumps(found))\n")
    result = subprocess.run([str(venv / "bin" / "python"), "-c", code], capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def pyreft_label(pyreft: str | None, source: str) -> str:
    """``0.1.0`` from the registry, or ``git main <commit>`` when it came from the main checkout."""
    if source == "the registry":
        return str(pyreft)
    commit = re.search(r"pyreft-main-([0-9a-f]{7,})", source)
    return f"git main {commit.group(1)}" if commit else f"{pyreft} from {source}"


def run_column(column: Column, venv: Path, allow_unsupported: bool, log) -> dict:
    """The core suite, then the check, in ``venv``; the row's measured part."""
    environment = run_environment(venv, allow_unsupported)
    python = str(venv / "bin" / "python")
    junit = venv / "core-junit.xml"
    junit.unlink(missing_ok=True)
    started = time.monotonic()
    tests = subprocess.run([python, "-m", "pytest", *CORE_TESTS, "-m", CORE_MARKERS, "-q", "-p", "no:cacheprovider",
                            f"--junitxml={junit}"], cwd=ROOT, env=environment, stdout=log, stderr=subprocess.STDOUT)
    pytest_seconds = time.monotonic() - started
    counts = pytest_counts(junit) if junit.exists() else {
        "passed": 0, "failed": 0, "errors": 0, "skipped": 0, "failed_tests": [f"pytest exited {tests.returncode}"]}
    started = time.monotonic()
    check = subprocess.run([str(venv / "bin" / "pyvene-dist"), "check", "--json"], cwd=ROOT, env=environment,
                           capture_output=True, text=True)
    check_seconds = time.monotonic() - started
    log.write(check.stderr)
    Path(f"{venv}.check.json").write_text(check.stdout)  # the rows in full, each unavailable one with its reason
    return {"pytest": {**counts, "exit_code": tests.returncode, "seconds": round(pytest_seconds, 1)},
            "check": {**check_summary(check.returncode, check.stdout, check.stderr),
                      "seconds": round(check_seconds, 1)}}


def make_row(column: Column, versions: dict, measured: dict, built: dict, *, commit: str, date: str,
             machine: str, allow_unsupported: bool, venv_state: str, install_seconds: float | None) -> dict:
    """One row of version-matrix.jsonl."""
    release_versions = {name: versions.get(name) for name in PACKAGES}
    pytest_seconds, check_seconds = measured["pytest"]["seconds"], measured["check"]["seconds"]
    return {
        "run_id": f"version-matrix-{column.name}-{commit}-{date}",
        "column": column.name,
        "description": column.description,
        "commit": commit,
        "date": date,
        "machine": machine,
        "python": versions.get("python"),
        "versions": release_versions,
        "pyreft": pyreft_label(versions.get("pyreft"), versions.get("pyreft_from", "the registry")),
        "pins": list(column.pins) if column.name == "oldest" else ("scripts/constraints.txt" if column.pins else []),
        **built,
        "allow_unsupported": allow_unsupported,
        "venv": venv_state,
        "core_tests": list(CORE_TESTS),
        "core_markers": CORE_MARKERS,
        "pytest": measured["pytest"],
        "check": measured["check"],
        "seconds": {"install": install_seconds, "pytest": pytest_seconds, "check": check_seconds,
                    "wall": round(pytest_seconds + check_seconds, 1)},
    }


# --- the table -------------------------------------------------------------------------------------------------

TABLE_COLUMNS = ("column", "date", "commit", "torch", "transformers", "accelerate", "deepspeed", "peft", "pyvene",
                 "pyreft", "passed/failed/skipped", "check", "wall s")
#: The columns of TABLE_COLUMNS that are releases of a package.
_RELEASES = TABLE_COLUMNS[3:9]


def table_cells(row: dict) -> tuple[str, ...]:
    versions, tests = row["versions"], row["pytest"]
    failed = tests["failed"] + tests["errors"]
    # pytest's exit codes 2-5 (interrupted, internal error, usage error, no tests) leave no counts to show
    outcome = f"{tests['passed']}/{failed}/{tests['skipped']}" if tests["exit_code"] in (0, 1) else (
        f"pytest exit {tests['exit_code']}")
    return (row["column"] + (" (allow-unsupported)" if row["allow_unsupported"] else ""), row["date"], row["commit"],
            *(str(versions.get(name) or "-") for name in _RELEASES), row["pyreft"],
            outcome, row["check"]["verdict"], f"{row['seconds']['wall']:.0f}")


def table(rows: list[dict]) -> str:
    """A Markdown table of ``rows``, one line per column."""
    lines = [TABLE_COLUMNS, *(table_cells(row) for row in rows)]
    return "\n".join(["| " + " | ".join(lines[0]) + " |", "|" + "---|" * len(TABLE_COLUMNS),
                      *("| " + " | ".join(cells) + " |" for cells in lines[1:])])


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


def venv_state(venv: Path, reused: bool) -> str:
    """``fresh`` (built by this run), or when the venv built before was made (its pyvenv.cfg)."""
    if not reused:
        return "fresh"
    made = datetime.datetime.fromtimestamp((venv / "pyvenv.cfg").stat().st_mtime, datetime.timezone.utc)
    return f"reused, built {made:%Y-%m-%d %H:%M} UTC"


def passed(row: dict) -> bool:
    tests = row["pytest"]
    return tests["failed"] == tests["errors"] == 0 and tests["passed"] > 0 and row["check"]["verdict"] == "passed"


def latest_rows(results: Path) -> list[dict]:
    """The last row of each column in ``results``, in the columns' order."""
    rows = [json.loads(line) for line in results.read_text().splitlines() if line.strip()]
    last = {row["column"]: row for row in rows}
    order = list(columns())
    return sorted(last.values(), key=lambda row: order.index(row["column"]) if row["column"] in order else len(order))


if __name__ == "__main__":
    sys.exit(main())
