"""Helpers shared by the tests (importable from spawned ranks too: this folder is on sys.path)."""

import os


def patch():
    """``pyvene_dist.patch()``, minus the concerns named in PYVENE_DIST_TEST_WITHOUT (or all of them).

    PYVENE_DIST_TEST_WITHOUT=weight_decay,hooks pytest tests/   shows which tests fail without those fixes.
    """
    import pyvene_dist
    from pyvene_dist import patches

    without = set(filter(None, os.environ.get("PYVENE_DIST_TEST_WITHOUT", "").split(",")))
    if "all" in without:
        return
    patches.CONCERNS = tuple(c for c in patches.CONCERNS if c not in without)
    pyvene_dist.patch()
