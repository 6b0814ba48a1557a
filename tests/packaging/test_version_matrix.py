"""scripts/version_matrix.py's pure parts: the columns it builds, the rows it writes and the table it prints
(matrix_rows.py), and the environments it gives pip and the suite (matrix_venvs.py). No venv is built here (a
column takes minutes and GBs); the matrix itself runs on demand (docs/testing.md)."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]


def _load(name: str):
    """scripts/<name>.py, under its own name in sys.modules: dataclasses look their module up there, and the
    scripts import each other by name (run as a script, scripts/ is on sys.path; here it is not)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


matrix_rows = _load("matrix_rows")  # first: the other two import it
matrix_venvs = _load("matrix_venvs")
matrix = _load("version_matrix")

SETUP_CFG = """\
[options]
install_requires =
    torch>=2.11
    pyvene>=0.1.8
    packaging

[options.extras_require]
ray =
    ray[train]>=2.9
test =
    pytest>=8  # a comment
    accelerate>=1.0
    numpy
accelerate =
    accelerate>=1.0
"""


def test_the_oldest_column_pins_each_floor_of_setup_cfg_and_nothing_unbounded(tmp_path):
    (tmp_path / "setup.cfg").write_text(SETUP_CFG)
    oldest = matrix.columns(tmp_path / "setup.cfg")["oldest"]
    assert oldest.pins == ("accelerate==1.0", "pytest==8", "pyvene==0.1.8", "torch==2.11")  # not ray's extra
    assert oldest.pyreft == "pypi" and not oldest.lift_torch_cap


def test_two_floors_for_one_package_are_refused(tmp_path):
    (tmp_path / "setup.cfg").write_text(SETUP_CFG.replace("accelerate =\n    accelerate>=1.0",
                                                          "accelerate =\n    accelerate>=1.2"))
    with pytest.raises(ValueError, match="setup.cfg gives accelerate two floors: 1.0 and 1.2"):
        matrix_rows.floors(tmp_path / "setup.cfg")


def test_the_columns_of_the_issue():
    columns = matrix.columns()
    assert list(columns) == ["oldest", "newest", "pyreft-main", "pinned"]
    assert "torch==2.11" in columns["oldest"].pins and "transformers==5.17" in columns["oldest"].pins
    for name in ("newest", "pyreft-main"):  # the registry's newest: no pins, the machine's torch cap lifted
        assert columns[name].pins == () and columns[name].lift_torch_cap and columns[name].torch == "torch"
        assert columns[name].torch_fallback == "torch==2.14.1"
    assert columns["pyreft-main"].pyreft.endswith("shared/upstream/pyreft-main-dafd099")
    assert columns["newest"].pyreft == "pypi"
    assert "pyreft==0.1.0" in columns["pinned"].pins and columns["pinned"].torch == "torch==2.13.0"


def test_a_lifted_cap_reads_no_pip_configuration(monkeypatch):
    monkeypatch.setenv("PIP_CONSTRAINT", "/etc/xdg/pip/constraints.txt")
    lifted = matrix_venvs.pip_environment(matrix.columns()["newest"])
    assert lifted["PIP_CONFIG_FILE"] == os.devnull and "PIP_CONSTRAINT" not in lifted
    kept = matrix_venvs.pip_environment(matrix.columns()["oldest"])
    assert kept["PIP_CONSTRAINT"] == "/etc/xdg/pip/constraints.txt"


def test_the_core_suite_is_files_of_the_suite():
    missing = [path for path in matrix_rows.CORE_TESTS if not (ROOT / path).is_file()]
    assert not missing, f"CORE_TESTS names files that do not exist: {missing}"
    for strategy in ("test_ddp.py", "test_fsdp.py", "test_accelerate.py", "test_deepspeed.py", "test_patching.py"):
        assert any(path.endswith(strategy) for path in matrix_rows.CORE_TESTS), f"the core suite lacks {strategy}"


def test_the_allow_unsupported_switch_is_set_only_when_asked(monkeypatch, tmp_path):
    monkeypatch.setenv("PYVENE_DIST_ALLOW_UNSUPPORTED", "1")  # from the caller's shell: not inherited
    assert "PYVENE_DIST_ALLOW_UNSUPPORTED" not in matrix_venvs.run_environment(tmp_path, False)
    environment = matrix_venvs.run_environment(tmp_path, True)
    assert environment["PYVENE_DIST_ALLOW_UNSUPPORTED"] == "1"
    assert environment["TORCH_EXTENSIONS_DIR"] == str(tmp_path / "torch_extensions")
    assert environment["PATH"].startswith(f"{tmp_path / 'bin'}{os.pathsep}")
    assert environment["PYTHONPATH"] == str(ROOT)  # this checkout's pyvene_dist, whatever the venv points at


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="5">
<testcase classname="tests.test_patching" name="test_a"/>
<testcase classname="tests.test_patching" name="test_b"><failure message="boom"/></testcase>
<testcase classname="tests.fixes.test_fsdp" name="test_c[2]"><skipped message="gpu"/></testcase>
<testcase classname="tests.fixes.test_fsdp" name="test_d"><error message="fixture"/></testcase>
<testcase classname="tests.fixes.test_fsdp" name="test_e"/>
</testsuite></testsuites>"""


def test_pytest_counts_come_from_the_junit_file(tmp_path):
    (tmp_path / "junit.xml").write_text(JUNIT)
    assert matrix_rows.pytest_counts(tmp_path / "junit.xml") == {
        "passed": 2, "failed": 1, "errors": 1, "skipped": 1,
        "failed_tests": ["tests/test_patching.py::test_b", "tests/fixes/test_fsdp.py::test_d"]}


def test_the_check_verdict_names_what_differs():
    rows = [{"strategy": "single", "world_size": 1, "verdict": "reference"},
            {"strategy": "ddp", "world_size": 2, "verdict": "agrees"},
            {"strategy": "fsdp2", "world_size": 2, "verdict": "differs"},
            {"strategy": "dataparallel", "world_size": 2, "verdict": "unavailable"}]
    assert matrix_rows.check_summary(1, json.dumps(rows), "") == {
        "verdict": "failed", "exit_code": 1, "rows": {"reference": 1, "agrees": 1, "differs": 1, "unavailable": 1},
        "wrong": ["fsdp2 x2: differs"], "unavailable": ["dataparallel x2"]}
    assert matrix_rows.check_summary(1, "", "Traceback ...\nUnsupportedVersionError: torch 2.15.0\n\n") == {
        "verdict": "error", "exit_code": 1, "detail": "UnsupportedVersionError: torch 2.15.0"}


def test_pyreft_says_whether_it_is_the_release_or_git_main():
    assert matrix_rows.pyreft_label("0.1.0", "the registry") == "0.1.0"
    assert matrix_rows.pyreft_label("0.1.0", "file:///tmp/x/pyreft-main-dafd099/pyreft") == "git main dafd099"


VERSIONS = {"torch": "2.15.0", "transformers": "5.25.0", "accelerate": "1.16.0", "deepspeed": "0.19.8",
            "peft": "0.21.2", "pyvene": "0.1.8", "pyreft": "0.1.0", "python": "3.11.7",
            "pyreft_from": "file:///tmp/copy/pyreft-main-dafd099"}
MEASURED = {"pytest": {"passed": 120, "failed": 2, "errors": 1, "skipped": 7, "failed_tests": [], "exit_code": 1,
                       "seconds": 512.3},
            "check": {"verdict": "passed", "exit_code": 0, "seconds": 40.0}}


def _row(**changes):
    arguments = dict(commit="abc1234", date="2026-12-04", machine="CPU, 2 cores", allow_unsupported=False,
                     venv_state="fresh", install_seconds=300.0)
    return matrix_rows.make_row(matrix.columns()["pyreft-main"], VERSIONS, MEASURED, {"torch_requested": "torch"},
                                **{**arguments, **changes})


def test_a_row_carries_what_every_results_row_must_and_the_issue_asks():
    row = _row()
    for key in ("commit", "date", "machine", "versions", "run_id"):  # tests/docs/test_docs.py's rule for rows
        assert row[key], f"the row lacks {key}"
    assert row["run_id"] == "version-matrix-pyreft-main-abc1234-2026-12-04"
    assert row["python"] == "3.11.7" and row["pyreft"] == "git main dafd099"
    assert set(row["versions"]) >= {"torch", "transformers", "accelerate", "deepspeed", "peft", "pyvene", "pyreft"}
    assert "python" not in row["versions"] and "pyreft_from" not in row["versions"]
    assert row["seconds"] == {"install": 300.0, "pytest": 512.3, "check": 40.0, "wall": 552.3}
    assert row["allow_unsupported"] is False and row["torch_requested"] == "torch"
    assert json.loads(json.dumps(row)) == row


def test_the_table_has_a_line_per_row():
    rows = [_row(), _row(allow_unsupported=True)]
    assert matrix_rows.table(rows).splitlines() == [
        "| column | date | commit | torch | transformers | accelerate | deepspeed | peft | pyvene | pyreft "
        "| passed/failed/skipped | check | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        "| pyreft-main | 2026-12-04 | abc1234 | 2.15.0 | 5.25.0 | 1.16.0 | 0.19.8 | 0.21.2 | 0.1.8 | git main dafd099 "
        "| 120/3/7 | passed | 552 |",
        "| pyreft-main (allow-unsupported) | 2026-12-04 | abc1234 | 2.15.0 | 5.25.0 | 1.16.0 | 0.19.8 | 0.21.2 | 0.1.8 "
        "| git main dafd099 | 120/3/7 | passed | 552 |",
    ]


def test_a_suite_that_did_not_run_shows_pytest_s_exit_code_not_zero_counts():
    stopped = _row()
    stopped["pytest"] = {**MEASURED["pytest"], "passed": 0, "failed": 0, "errors": 0, "skipped": 0, "exit_code": 4}
    assert matrix_rows.table_cells(stopped)[10] == "pytest exit 4"


def test_the_table_option_shows_the_last_row_of_each_column(tmp_path, capsys):
    results = tmp_path / "rows.jsonl"
    newest = {**_row(), "column": "newest"}
    later = {**newest, "versions": {**newest["versions"], "torch": "2.14.1"}}
    results.write_text("".join(json.dumps(row) + "\n" for row in (newest, _row(), later)))
    assert matrix.main(["--table", "--results", str(results)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(" | ")[:4:3] for line in lines[2:]] == [["| newest", "2.14.1"], ["| pyreft-main", "2.15.0"]]


def test_an_unknown_column_is_refused_by_name(capsys):
    assert matrix.main(["--columns", "oldest,latest", "--venvs", "/nonexistent"]) == 2
    assert capsys.readouterr().err.strip() == (
        "version_matrix: unknown column latest; expected one of oldest, newest, pyreft-main, pinned")


def test_a_reused_venv_says_when_it_was_built(tmp_path):
    (tmp_path / "pyvenv.cfg").write_text("home = /usr/bin\n")
    os.utime(tmp_path / "pyvenv.cfg", (1796400000, 1796400000))  # 2026-12-04 16:00 UTC
    assert matrix_venvs.venv_state(tmp_path, reused=True) == "reused, built 2026-12-04 16:00 UTC"
    assert matrix_venvs.venv_state(tmp_path, reused=False) == "fresh"


def test_the_testing_page_shows_what_the_table_option_prints():
    """docs/testing.md's table is the last row of each column in the committed results, as ``.ci/matrix --table``
    prints it (through the .ci entry, which passes its arguments to the script)."""
    printed = subprocess.run([str(ROOT / ".ci" / "matrix"), "--table"], capture_output=True, text=True, check=True)
    page = (ROOT / "docs" / "testing.md").read_text()
    assert printed.stdout.strip() in page, (
        "docs/testing.md's version matrix table is not what `.ci/matrix --table` prints; paste it again:\n"
        + printed.stdout)
