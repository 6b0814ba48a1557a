"""pyvene's own test suite (v0.1.8) passes with ``pyvene_dist.patch()`` wherever it passes stock.

tests/upstream/pyvene_suite.py runs pyvene's unit and integration tests twice, stock and patched, on local stand-ins
for the hub models they load by name, and compares the outcomes test by test. A test that passes stock and
not patched is a pyvene_dist bug: the failure names it with the patched traceback's last lines. A stock
failure that ``STOCK_FAILURES`` does not explain fails too, since it means the harness (a hub stand-in, say)
no longer gives pyvene's tests what they need, and they would compare nothing.
"""

import pytest

import pyvene_suite

pytestmark = pytest.mark.skipif(pyvene_suite.missing() is not None, reason=pyvene_suite.missing() or "")


def assert_patched_passes_wherever_stock_passes(results):
    summary = pyvene_suite.summary(results)
    print(summary)
    lost = pyvene_suite.regressions(results)
    if lost:
        pytest.fail("pyvene's tests that pass stock and not patched:\n" + "\n".join(lost) + "\n\n" + summary,
                    pytrace=False)
    unexplained = pyvene_suite.unexplained_stock_failures(results)
    if unexplained:
        pytest.fail("pyvene's tests that fail stock for a reason STOCK_FAILURES does not give:\n"
                    + "\n".join(unexplained), pytrace=False)


def test_pyvene_suite_passes_patched_wherever_it_passes_stock(tmp_path):
    assert_patched_passes_wherever_stock_passes(pyvene_suite.run(tmp_path))


@pytest.mark.slow
@pytest.mark.gpus(1)
def test_pyvene_llama_tests_pass_patched_wherever_they_pass_stock(tmp_path):
    """InterventionWithLlamaTestCase alone: its 1.1B-parameter Llama takes over 9 minutes on two CPU cores
    (both sessions), seconds on a GPU, where pyvene's test puts it."""
    assert_patched_passes_wherever_stock_passes(pyvene_suite.run(tmp_path, llama=True))
