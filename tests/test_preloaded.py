"""Ranks forked from the preloaded server (``testing._preloaded``) are processes as fresh as spawned ones."""

import os
import sys

import pytest

from pyvene_dist.testing import _preloaded
from pyvene_dist.testing.launch import spawn

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="no forkserver on Windows")


def _report(folder):
    import pyvene

    import pyvene_dist

    wrapped = hasattr(pyvene.IntervenableModel.forward, "__wrapped__") or pyvene_dist.is_patched()
    with open(os.path.join(folder, f"rank{os.environ['RANK']}-{os.getpid()}.txt"), "w") as out:
        out.write(f"{os.getcwd()}\n{int(wrapped)}\n{os.environ.get('PYVENE_DIST_PRELOAD_TEST', '')}\n"
                  f"{int(os.path.dirname(__file__) in sys.path)}\n")
    pyvene_dist.patch()  # stays in this rank: the next world's ranks must start unpatched


def _reports(folder):
    return sorted(p.read_text().split("\n")[:4] for p in folder.iterdir() if p.name.startswith("rank"))


def test_forked_ranks_start_unpatched_in_the_parents_folder(tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    assert type(_preloaded.context()).__name__ == "_Context" or len(_preloaded._servers) == _preloaded.MAX_SERVERS
    import pyvene_dist

    pyvene_dist.patch()  # the parent's patch is the parent's (a fork of the parent would carry it)
    try:
        for _ in range(2):  # the second world's ranks come after the first's patch()
            outcome = spawn(_report, world_size=2, workdir=tmp_path / "world", args=(str(out),))
            assert not outcome.failed, outcome.report()
    finally:
        pyvene_dist.unpatch()
    assert _reports(out) == [[str(work), "0", "", "1"]] * 4


def test_another_environment_gets_a_server_of_its_own(tmp_path, monkeypatch):
    first = _preloaded.context()  # the server of the environment of now
    monkeypatch.setenv("PYVENE_DIST_PRELOAD_TEST", "seen")
    second = _preloaded.context()
    assert second._name == "spawn" or second._key != first._key  # spawn's once MAX_SERVERS are running
    out = tmp_path / "out"
    out.mkdir()
    outcome = spawn(_report, world_size=1, workdir=tmp_path / "world", args=(str(out),))
    assert not outcome.failed, outcome.report()
    assert _reports(out)[0][2] == "seen"  # the first server's ranks have the environment without it


def test_past_the_last_server_ranks_are_spawned(monkeypatch):
    monkeypatch.setattr(_preloaded, "MAX_SERVERS", len(_preloaded._servers))
    monkeypatch.setenv("PYVENE_DIST_PRELOAD_TEST", "one more")
    assert _preloaded.context()._name == "spawn"


def test_the_switch_turns_it_off(monkeypatch):
    monkeypatch.setenv(_preloaded.VARIABLE, "0")
    assert _preloaded.context()._name == "spawn"
    monkeypatch.setenv(_preloaded.VARIABLE, "maybe")
    with pytest.raises(ValueError, match="PYVENE_DIST_FORKSERVER='maybe': expected one of"):
        _preloaded.context()


def test_the_running_tests_name_starts_no_server_of_its_own(monkeypatch):
    """pytest sets PYTEST_CURRENT_TEST for every test: with it in the key, each test that started a world started a
    server, and past MAX_SERVERS every rank was spawned."""
    monkeypatch.setattr(_preloaded, "MAX_SERVERS", len(_preloaded._servers) + 1)  # room for one more, not two
    monkeypatch.setenv("PYVENE_DIST_PRELOAD_TEST", "a setting of its own")
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "tests/test_a.py::test_one (call)")
    first = _preloaded.context()
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "tests/test_a.py::test_two (call)")
    second = _preloaded.context()
    assert first._name != "spawn" and second._name != "spawn" and second._key == first._key


def test_with_cuda_ranks_are_spawned(monkeypatch):
    """A rank forked after its server touched CUDA cannot take its GPU ('Cannot re-initialize CUDA in forked
    subprocess', on one H200): with CUDA the ranks are spawned."""
    import torch

    monkeypatch.setattr(_preloaded, "MAX_SERVERS", len(_preloaded._servers) + 1)  # else a new server would serve
    monkeypatch.setenv("PYVENE_DIST_PRELOAD_TEST", "with CUDA")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert _preloaded.context()._name == "spawn"
