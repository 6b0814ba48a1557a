"""The version matrix's pure parts (scripts/version_matrix.py runs them): what a column is and which floors of
setup.cfg it pins, what each row records of a run (pytest's counts, the check's verdict, the releases), and the
Markdown table the rows make. Nothing here makes a venv or starts a process (that is matrix_venvs.py), so the
tests read all of it in process.
"""

from __future__ import annotations

import configparser
import dataclasses
import json
import re
import xml.etree.ElementTree as ElementTree
from pathlib import Path

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


def floors(setup_cfg: Path) -> dict[str, str]:
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


# --- a row -----------------------------------------------------------------------------------------------------

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


def pyreft_label(pyreft: str | None, source: str) -> str:
    """``0.1.0`` from the registry, or ``git main <commit>`` when it came from the main checkout."""
    if source == "the registry":
        return str(pyreft)
    commit = re.search(r"pyreft-main-([0-9a-f]{7,})", source)
    return f"git main {commit.group(1)}" if commit else f"{pyreft} from {source}"


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


def passed(row: dict) -> bool:
    tests = row["pytest"]
    return tests["failed"] == tests["errors"] == 0 and tests["passed"] > 0 and row["check"]["verdict"] == "passed"


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
