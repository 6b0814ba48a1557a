"""The version matrix's venvs (scripts/version_matrix.py drives them): make a column's venv afresh as
scripts/setup.sh makes .venv, then run the core suite and ``pyvene-dist check`` in it and read back what it
installed. Each step writes to the column's log; what the row makes of the results is matrix_rows.py's.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

from matrix_rows import CORE_MARKERS, CORE_TESTS, EXTRAS, PACKAGES, Column, check_summary, pytest_counts

ROOT = Path(__file__).resolve().parents[1]
#: The environment of the core suite and the check: on CPU, DeepSpeed on its CPU accelerator.
RUN_ENVIRONMENT = types.MappingProxyType({"DS_ACCELERATOR": "cpu", "PYTHONDONTWRITEBYTECODE": "1"})
ALLOW_ENV = "PYVENE_DIST_ALLOW_UNSUPPORTED"


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


def venv_state(venv: Path, reused: bool) -> str:
    """``fresh`` (built by this run), or when the venv built before was made (its pyvenv.cfg)."""
    if not reused:
        return "fresh"
    made = datetime.datetime.fromtimestamp((venv / "pyvenv.cfg").stat().st_mtime, datetime.timezone.utc)
    return f"reused, built {made:%Y-%m-%d %H:%M} UTC"
