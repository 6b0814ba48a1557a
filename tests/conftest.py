"""Loaded first by every test run under tests/: with no ``__init__.py`` here, pytest (``--import-mode=prepend``,
setup.cfg) puts this folder on ``sys.path``, so the modules of tests/fixes/, tests/strategies/ and the other
folders import ``helpers``, ``launchers`` and ``pyreft_setup`` by name, as do the ranks they spawn."""

import os

import pytest
import torch
from hypothesis import settings

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed on CPU, for this process and the ranks it spawns

# Extend hypothesis' own "ci" profile (derandomized, no deadline) rather than replacing it.
settings.register_profile("pyvene_dist", parent=settings.get_profile("ci"), max_examples=200)
settings.register_profile("pyvene_dist-dev", max_examples=50, deadline=None)
settings.load_profile("pyvene_dist" if os.environ.get("CI") else "pyvene_dist-dev")


@pytest.fixture
def patched(monkeypatch):
    """pyvene_dist patched for the test (see helpers.patch), and exactly as before afterwards."""
    import pyvene_dist

    from helpers import patch

    patch()
    yield
    pyvene_dist.unpatch()


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module of tiny models (the serving tests): they gain nothing from more, and on a
    loaded 2-core machine the threads' spinning made each small matmul ten times slower and costlier (350 us of wall
    and 160 us of CPU against 36 and 15 with one thread, measured)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def serving_saved(tmp_path_factory):
    """The serving tests' base model and ReFTs, saved once per session, and pyreft's answers, memoised for every module
    that compares with them (serving_refts.save_all). Skipped without pyreft, as the serving modules are."""
    pytest.importorskip("pyreft")
    from serving_refts import save_all

    return save_all(tmp_path_factory.mktemp("serving"))


@pytest.fixture(scope="session")
def serving_server(serving_saved):
    """``pyvene-dist serve`` of serving_refts.SERVED, as docs/serving.md starts it, once per session for every test
    that calls a server (tests/test_openai_server.py, tests/test_inputs.py's serving section): its base URL. Runtime
    loading is on; a test that loads a ReFT unloads it."""
    from serving_refts import BODY_TIMEOUT, NEW_TOKENS, SERVED, running_server

    with running_server({name: serving_saved.folders[name] for name in SERVED}, "--max_tokens", str(NEW_TOKENS),
                        "--body_timeout", str(BODY_TIMEOUT), "--allow_runtime_loading") as url:
        yield url


pytest_plugins = ["pytester"]
