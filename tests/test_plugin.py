"""The pytest plugin itself: passing worlds, a failing rank, a hanging rank, skips, crashes, GPU needs.

Most cases are inner test files run by pytest in a subprocess. Those that need no options or environment of their
own run in one inner session (``inner``): each session pays about 6 s to import torch, transformers and pyvene
before its first world, once instead of once per case. Each case keeps its own file, and its test here asserts on
that file's reports alone: its outcomes, and the text pytest prints for them (failures, captured output, summary).
"""

import collections
import json
import os
import subprocess
import sys

import pytest

HEADER = """
import os, sys, time
import pytest
import torch.distributed as dist
"""


def run(pytester, body, *args):
    pytester.makepyfile(test_world=HEADER + body)
    return pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rA", *args)


#: Inner test files that run together in the ``inner`` session: file name -> body (after HEADER).
INNER = {}


def inner_file(name: str, body: str) -> str:
    """Add ``body`` to the inner session as ``name``; returns the name."""
    INNER[name] = body
    return name


#: The inner session's conftest: every report (setup and teardown only where they did not pass), as JSON.
RECORDER = """
import json, os

REPORTS = []


def pytest_runtest_logreport(report):
    if report.when == "call" or report.outcome != "passed":
        REPORTS.append({"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome,
                        "longrepr": report.longreprtext, "sections": report.sections})


def pytest_sessionfinish(session):
    with open(os.environ["INNER_REPORTS"], "w") as file:
        json.dump(REPORTS, file)
"""


class InnerResult:
    """One inner file's reports, asserted on as pytester's ``RunResult``: ``assert_outcomes`` counts them as
    pytest's summary does, and ``stdout`` holds what pytest prints for them with ``-rA``, in its order (each
    failure, each pass's captured output, then one summary line per test)."""

    def __init__(self, reports: list, session_output: str) -> None:
        self.reports = reports
        failures = [r for r in reports if r["outcome"] == "failed"]
        passes = [r for r in reports if r["outcome"] == "passed"]
        lines = []
        for report in failures + passes:
            lines.append(f"_____ {report['nodeid']} _____")
            if report["outcome"] == "failed":
                lines += report["longrepr"].splitlines()
            for title, content in report["sections"]:
                lines += [f"----- {title} -----", *content.splitlines()]
        for report in reports:
            reason = f" - {report['longrepr']}" if report["outcome"] == "skipped" else ""
            lines.append(f"{self._word(report).upper()} {report['nodeid']}{reason}")
        self.stdout = pytest.LineMatcher(lines)
        self.session_output = session_output

    @staticmethod
    def _word(report: dict) -> str:
        if report["outcome"] == "failed" and report["when"] != "call":
            return "error"
        return report["outcome"]

    def assert_outcomes(self, passed: int = 0, failed: int = 0, skipped: int = 0, errors: int = 0) -> None:
        counts = collections.Counter(self._word(report) for report in self.reports)
        found = {"passed": counts["passed"], "failed": counts["failed"], "skipped": counts["skipped"],
                 "errors": counts["error"]}
        expected = {"passed": passed, "failed": failed, "skipped": skipped, "errors": errors}
        assert found == expected, f"{found} != {expected}; the inner session printed:\n{self.session_output}"


@pytest.fixture(scope="module")
def inner(tmp_path_factory) -> dict:
    """Every file of ``INNER`` in one pytest subprocess, in the order they were added, as pytester's
    ``runpytest_subprocess`` runs one (``-p no:cacheprovider -rA``, a home and temp folder of its own, no
    ``PYTEST_ADDOPTS``): file name -> its ``InnerResult``. ``SHARED`` names a folder every test may write."""
    folder = tmp_path_factory.mktemp("inner")
    for name, body in INNER.items():
        (folder / name).write_text(HEADER + body)
    (folder / "conftest.py").write_text(RECORDER)
    for subfolder in ("home", "shared"):
        (folder / subfolder).mkdir()
    environment = {**os.environ, "HOME": str(folder / "home"), "USERPROFILE": str(folder / "home"), "PY_COLORS": "0",
                   "SHARED": str(folder / "shared"), "INNER_REPORTS": str(folder / "reports.json")}
    for name in ("PYTEST_ADDOPTS", "TOX_ENV_DIR"):
        environment.pop(name, None)
    session = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rA",
                              f"--basetemp={folder / 'basetemp'}", *INNER],
                             cwd=folder, env=environment, capture_output=True, text=True)
    output = f"{session.stdout}\n{session.stderr}"
    assert (folder / "reports.json").exists(), f"the inner session ended before its end:\n{output}"
    reports = json.loads((folder / "reports.json").read_text())
    return {name: InnerResult([r for r in reports if r["nodeid"].split("::")[0] == name], output) for name in INNER}


SIZES = inner_file("test_sizes.py", """
@pytest.mark.world_size(1, 2)
def test_sizes(tmp_path, world_size):
    assert dist.get_world_size() == world_size == int(os.environ["WORLD_SIZE"])
    assert dist.get_rank() == int(os.environ["RANK"]) == int(os.environ["LOCAL_RANK"])
    value = __import__("torch").ones(1)
    dist.all_reduce(value)
    assert value.item() == world_size
    (tmp_path / f"rank{dist.get_rank()}").write_text("ok")
    dist.barrier()
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"rank{r}" for r in range(world_size)]
""")


def test_passing_world_runs_every_size_with_a_real_group(inner):
    result = inner[SIZES]
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["PASSED *test_sizes?world1?", "PASSED *test_sizes?world2?"])


FAILING = inner_file("test_failing.py", """
def check(value):
    assert value == 0, f"boom from rank {value}"

@pytest.mark.world_size(2)
def test_fails_on_rank_one():
    check(dist.get_rank())
""")


def test_failing_rank_reports_its_traceback(inner):
    result = inner[FAILING]
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*--- rank 0: passed*", "*--- rank 1: failed*", "*in check*", "*boom from rank 1*"])


HANGING = inner_file("test_hanging.py", """
def wait_forever():
    time.sleep(600)

@pytest.mark.world_size(2, timeout=5)
def test_hangs():
    if dist.get_rank() == 1:
        wait_forever()
""")


def test_hanging_rank_dumps_every_stack_and_fails(inner):
    result = inner[HANGING]
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*--- rank 0: passed*", "*--- rank 1: timed out*", "*stack at the deadline*",
                                 "*in wait_forever*"])


KEPT = inner_file("test_kept.py", """
import pyvene_dist
from pathlib import Path

def pids():
    pid = __import__("torch").tensor([os.getpid()])
    gathered = [pid.clone() for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, pid)
    return sorted(int(p) for p in gathered)

@pytest.mark.world_size(2)
def test_a_leaves_things():
    print(f"rank {dist.get_rank()} speaking")
    Path(os.environ["SHARED"], f"a-{dist.get_rank()}").write_text(repr(pids()))
    os.environ["LEFT_BEHIND"] = "1"
    os.chdir("/")
    pyvene_dist.patch()
    dist.destroy_process_group()

@pytest.mark.world_size(2)
def test_b_finds_them_gone():
    assert "LEFT_BEHIND" not in os.environ and os.getcwd() != "/" and not pyvene_dist.is_patched()
    assert repr(pids()) == Path(os.environ["SHARED"], f"a-{dist.get_rank()}").read_text()  # same processes
    raise RuntimeError("b fails")

@pytest.mark.world_size(2)
def test_c_runs_in_new_processes():
    assert repr(pids()) != Path(os.environ["SHARED"], f"a-{dist.get_rank()}").read_text()
""")


def test_a_world_serves_the_next_test_and_is_put_back_between_tests(inner):
    """The second test runs in the first one's processes (the same pids), and finds none of what the first left:
    its environment variable, its working directory, pyvene_dist patched, its process group destroyed. A failed
    test ends its world: the test after it runs in new processes. Each rank's output reaches the test's report."""
    result = inner[KEPT]
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(["*RuntimeError: b fails*", "*rank 0 speaking*", "*FAILED test_kept.py::test_b_finds_them_gone*"])


STUCK = inner_file("test_stuck.py", """
@pytest.mark.world_size(2, timeout=60, grace=2)  # rank 1 never reports: any grace shorter than the timeout shows it
def test_one_fails_other_waits():
    if dist.get_rank() == 0:
        raise RuntimeError("rank 0 gives up")
    time.sleep(600)   # stands for a collective rank 0 will never join
""")


def test_rank_stuck_in_a_collective_after_another_failed_is_reported(inner):
    result = inner[STUCK]
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*--- rank 0: failed*", "*rank 0 gives up*", "*--- rank 1: stuck after another rank stopped*"])


SKIPS = inner_file("test_skips.py", """
@pytest.mark.world_size(2)
def test_skips():
    pytest.skip("not on this machine")
""")


def test_skip_inside_ranks_is_a_skip(inner):
    result = inner[SKIPS]
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*not on this machine*"])


CRASHES = inner_file("test_crashes.py", """
@pytest.mark.world_size(2)
def test_crashes():
    if dist.get_rank() == 1:
        os._exit(3)
""")


def test_crashed_rank_is_a_failure(inner):
    result = inner[CRASHES]
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*--- rank 1: crashed*", "*exited with code 3*"])


def test_gpu_needs_are_skips_that_say_how_many(pytester, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    result = run(pytester, """
@pytest.mark.world_size(2, backend="nccl")
def test_nccl():
    pass

@pytest.mark.gpus(2)
def test_two_gpus():
    pass
""")
    result.assert_outcomes(skipped=2)
    result.stdout.fnmatch_lines(["*needs 2 GPUs for nccl, found 0*", "*needs 2 GPUs, found 0*"])


def test_bad_world_sizes_are_a_usage_error(pytester):
    result = run(pytester, """
@pytest.mark.world_size(0)
def test_nothing():
    pass
""")
    assert result.ret != 0
    result.stdout.fnmatch_lines(["*world_size needs one or more positive integers, got (0,)*"])


@pytest.mark.parametrize("gpus, expected", [(0, "gloo"), (1, "skip"), (2, "nccl"), (3, "nccl")])
def test_auto_backend_never_puts_two_ranks_on_a_machine_with_too_few_gpus(monkeypatch, gpus, expected):
    """With some GPUs but fewer than ranks, gloo ranks would still place rank r on cuda:r (DeepSpeed,
    FSDP) and fail with ``invalid device ordinal``: such a world is skipped, naming what it needs."""
    from pyvene_dist import pytest_plugin

    monkeypatch.setattr(pytest_plugin, "_gpu_count", lambda: gpus)
    config = type("Config", (), {"getoption": staticmethod(lambda name: "auto")})()
    marker = pytest.mark.world_size(2).mark
    if expected == "skip":
        with pytest.raises(pytest.skip.Exception, match="needs 2 GPUs for nccl, found 1"):
            pytest_plugin._backend(config, marker, 2)
    else:
        assert pytest_plugin._backend(config, marker, 2) == expected


@pytest.mark.parametrize("gpus, skipped", [(0, False), (1, True), (2, False), (3, False)])
def test_a_test_starting_its_own_ranks_is_skipped_where_a_rank_would_have_no_gpu(monkeypatch, gpus, skipped):
    """``ranks(2)``: a launcher's rank 1 takes cuda:1, out of range on a one-GPU machine (the HF Trainer DeepSpeed
    test under torchrun failed so); without GPUs the ranks run on the CPU."""
    from pyvene_dist import pytest_plugin

    monkeypatch.setattr(pytest_plugin, "_gpu_count", lambda: gpus)
    item = type("Item", (), {"get_closest_marker": lambda self, name: pytest.mark.ranks(2).mark if name == "ranks"
                             else None})()
    if skipped:
        with pytest.raises(pytest.skip.Exception, match="needs 2 GPUs for its 2 ranks .or none, on CPU., found 1"):
            pytest_plugin.pytest_runtest_setup(item)
    else:
        pytest_plugin.pytest_runtest_setup(item)


@pytest.mark.parametrize("module, test", [
    ("fixes.test_deepspeed", "test_hf_trainer_deepspeed_under_torchrun_matches_one_process"),
    ("strategies.test_launchers", "test_torchrun_pyreft_trainer_matches_one_process"),
    ("strategies.test_launchers", "test_torchrun_resume_from_checkpoint_continues_exactly"),
])
def test_the_launchers_that_take_a_gpu_per_rank_say_how_many_ranks_they_start(module, test):
    """The marker is on each test whose ranks run on the GPUs where there are some (no ``--use_cpu``), so the skip
    above applies to them; the launchers that pass ``--use_cpu`` or ``ACCELERATE_USE_CPU`` run anywhere."""
    import importlib

    marks = getattr(importlib.import_module(module), test).pytestmark
    assert [mark.args for mark in marks if mark.name == "ranks"] == [(2,)]


SLOW_INIT = inner_file("test_slow_init.py", """
from pathlib import Path

initialise = dist.init_process_group

def slow_on_rank_1(*args, **kwargs):  # the test module is imported in each rank before its group starts
    initialise(*args, **kwargs)
    if os.environ["RANK"] == "1":
        time.sleep(2)
        Path("rank1-through").write_text("")

dist.init_process_group = slow_on_rank_1

@pytest.mark.world_size(2, fresh=True)  # the module is imported before the group forms: spawn's order
def test_body():
    if dist.get_rank() == 0:
        assert Path("rank1-through").exists(), "rank 0 started its body while rank 1 was still initialising"
""")


def test_no_rank_starts_its_body_before_every_rank_is_through_init_process_group(inner):
    """A rank whose body is ``pass`` used to leave while the other was still inside init_process_group,
    which then failed with ``Gloo connectFullMesh failed ... Connection closed by peer`` (1 to 6 times in
    20 under load). Here rank 1 stays 2 s longer in init_process_group: rank 0's body must find it through."""
    result = inner[SLOW_INIT]
    result.assert_outcomes(passed=1)


@pytest.mark.slow
def test_no_op_worlds_pass_10_times_in_a_row_on_a_loaded_machine(pytester):
    """The symptom itself, as a smoke test: 10 tests of a world of 2 pass while two busy processes load the
    cores. Since worlds are kept (3db00fb) the 10 run in one world, started once, so this is one start under
    load and 10 runs in it; the deterministic check of every start is the test above (before kept worlds, at
    the 1 failure in 20 once measured, 10 fresh worlds showed the symptom 2 times in 5)."""
    import subprocess
    import sys

    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        result = run(pytester, """
@pytest.mark.world_size(2)
@pytest.mark.parametrize("repeat", range(10))
def test_nothing(repeat):
    pass
""")
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()
    result.assert_outcomes(passed=10)


@pytest.mark.parametrize("load", [
    pytest.param(["-p", "pyvene_dist.pytest_plugin"], id="-p"),
    pytest.param(["conftest"], id="conftest-pytest_plugins"),
])
def test_plugin_named_by_its_module_loads_beside_the_entry_point(pytester, load):
    if load == ["conftest"]:
        pytester.makeconftest('pytest_plugins = ["pyvene_dist.pytest_plugin"]')
        load = []
    result = run(pytester, """
@pytest.mark.world_size(1)
def test_one(world_size):
    assert dist.get_world_size() == world_size
""", *load)
    result.assert_outcomes(passed=1)


UNPICKLABLE = inner_file("test_unpicklable.py", """
@pytest.mark.world_size(2)
def test_capsys(capsys):
    pass

@pytest.mark.world_size(2)
def test_request(request):
    pass

@pytest.mark.world_size(2)
@pytest.mark.parametrize("transform", [lambda x: x])
def test_lambda(transform):
    pass
""")


def test_unpicklable_fixture_or_parameter_is_named_in_one_line(inner):
    result = inner[UNPICKLABLE]
    result.assert_outcomes(failed=3)
    result.stdout.fnmatch_lines([
        "test_unpicklable.py::test_capsys?world2?: fixture 'capsys' (CaptureFixture) cannot be sent to the ranks, *",
        "test_unpicklable.py::test_request?world2?: fixture 'request' (*) cannot be sent to the ranks, *",
        "test_unpicklable.py::test_lambda?world2-<lambda>?: parameter 'transform' (function) cannot be sent to the "
        "ranks, which get their arguments pickled: *lambda*",
    ])
    assert "Traceback" not in result.stdout.str()


LEAVES_A_SEMAPHORE = '''
import multiprocessing, sys, tempfile, time
from multiprocessing import util

from pyvene_dist.testing.launch import spawn


def body():
    """A semaphore made in the rank (as DeepSpeed and accelerate make them), then a slow exit handler: run
    before the semaphore's own (higher priority first), it holds the rank in its exit after it reported."""
    body.lock = multiprocessing.get_context("spawn").Lock()
    util.Finalize(None, time.sleep, args=(3,), exitpriority=10)


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as folder:
        outcome = spawn(body, world_size=1, workdir=folder)
    sys.exit(1 if outcome.failed else 0)
'''


def test_a_rank_that_reported_exits_by_itself_and_leaks_nothing(tmp_path):
    """``pyvene-dist check`` ended with ``resource_tracker: There appear to be 1 leaked semaphore objects``:
    the parent killed every rank still alive once all had reported, inside their exit handlers, before they
    released what they made."""
    import subprocess
    import sys

    script = tmp_path / "leaves_a_semaphore.py"
    script.write_text(LEAVES_A_SEMAPHORE)
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "leaked semaphore" not in result.stderr, result.stderr
