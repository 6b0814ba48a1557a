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


pytest_plugins = ["pytester"]
