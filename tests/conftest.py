import os

from hypothesis import settings

# Extend hypothesis' own "ci" profile (derandomized, no deadline) rather than replacing it.
settings.register_profile("pyvene_dist", parent=settings.get_profile("ci"), max_examples=200)
settings.register_profile("pyvene_dist-dev", max_examples=50, deadline=None)
settings.load_profile("pyvene_dist" if os.environ.get("CI") else "pyvene_dist-dev")

import pytest


@pytest.fixture
def patched(monkeypatch):
    """pyvene_dist patched for the test, and exactly as before afterwards.

    To see which tests fail without a fix: PYVENE_DIST_TEST_WITHOUT=weight_decay,hooks (or "all").
    """
    import pyvene_dist
    from pyvene_dist import patches

    without = set(filter(None, os.environ.get("PYVENE_DIST_TEST_WITHOUT", "").split(",")))
    if "all" in without:
        yield
        return
    monkeypatch.setattr(patches, "CONCERNS", tuple(c for c in patches.CONCERNS if c not in without))
    with pyvene_dist.patched():
        yield

pytest_plugins = ["pytester"]
