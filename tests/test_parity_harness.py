"""The parity harness's comparison itself (``assert_parity``), on records written by hand."""

import pytest
import torch

from pyvene_dist.testing import Record, Tolerance, assert_parity

BF16 = Tolerance(8 * 2**-8, "8 bf16 ulps")
LR = 0.02


def record(weight, grads, losses=(1.0, 0.9)):
    return Record("run", 1, list(losses), [{"w": torch.tensor(g)} for g in grads], {"w": torch.tensor(weight)})


#: Element 1's gradient is 1e-4 of the largest at the first step (within 8 bf16 ulps of zero), element 0's
#: is the largest at both steps.
REFERENCE = record([0.5, 0.1, -0.3], [[1.0, 1e-4, 0.5], [1.0, 0.2, 0.5]])


def test_a_weight_adam_moved_the_other_way_on_a_near_zero_gradient_is_within_the_adam_bound():
    flipped = record([0.5, 0.1 + 2 * LR, -0.3], [])
    with pytest.raises(AssertionError, match="final weight w differs"):
        assert_parity(REFERENCE, flipped, BF16, grads=False)
    assert_parity(REFERENCE, flipped, BF16, grads=False, adam_lr=LR)


def test_the_adam_bound_allows_nothing_more_where_the_gradient_was_large():
    moved = record([0.5 + 2 * LR, 0.1, -0.3], [])
    with pytest.raises(AssertionError, match=r"1 of 3 elements; the worst at \(0,\).* \(0 such steps\)"):
        assert_parity(REFERENCE, moved, BF16, grads=False, adam_lr=LR)


def test_the_adam_bound_allows_one_flip_per_near_zero_step():
    twice = record([0.5, 0.1 + 4 * LR, -0.3], [])  # two flips, one near-zero step
    with pytest.raises(AssertionError, match=r"\(1 such steps\)"):
        assert_parity(REFERENCE, twice, BF16, grads=False, adam_lr=LR)


def test_the_adam_bound_needs_the_references_gradients():
    without = record([0.5, 0.1, -0.3], [])
    with pytest.raises(AssertionError, match="adam_lr needs the reference's gradients"):
        assert_parity(without, without, BF16, grads=False, adam_lr=LR)
