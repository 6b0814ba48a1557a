"""`pyvene-dist check`, the README's first command: a table per strategy, clear errors, honest exit codes."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def check(*arguments, timeout=900):
    return subprocess.run([sys.executable, "-m", "pyvene_dist", "check", *arguments], capture_output=True, text=True,
                          timeout=timeout)


def test_check_runs_what_this_machine_can_and_says_why_not_the_rest():
    result = check("--strategies", "ddp,zero3,dataparallel", "--json")
    assert result.returncode == 0, result.stderr
    rows = {row["strategy"]: row for row in json.loads(result.stdout)}
    assert rows["ddp"]["verdict"] == "agrees" and rows["ddp"]["loss"] < 1e-5
    assert rows["zero3"]["verdict"] == "agrees"
    assert rows["dataparallel"]["verdict"] == "unavailable" and "needs 2 GPUs" in rows["dataparallel"]["detail"]


def test_table_is_printed_by_default():
    result = check("--strategies", "ddp+checkpointing")
    assert result.returncode == 0, result.stderr
    assert "ddp+checkpointing" in result.stdout and "agrees" in result.stdout


@pytest.mark.parametrize("arguments, message", [
    (("--strategies", "bogus"), "pyvene-dist: unknown strategy bogus; known: ddp"),
    (("--world-sizes", "0"), "world sizes must be at least 1"),
    (("--model", "nope"), "invalid choice: 'nope'"),
])
def test_user_mistakes_are_one_clear_line(arguments, message):
    result = check(*arguments, timeout=120)
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr
