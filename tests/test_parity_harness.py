"""The parity harness's comparison itself (``assert_parity``), on records written by hand."""

import dataclasses

import pytest
import torch

from pyvene_dist.testing import Record, Tolerance, assert_parity

BF16 = Tolerance(8 * 2**-8, "8 bf16 ulps")
LR = 0.02


def record(weight, grads, losses=(1.0, 0.9)):
    return Record("run", 1, list(losses), [{"w": torch.tensor(g)} for g in grads], {"w": torch.tensor(weight)})


#: Element 1's gradient is 1e-4 of the largest at the first step (within 8 bf16 ulps of zero).
REFERENCE = record([0.5, 0.1, -0.3], [[1.0, 1e-4, 0.5], [1.0, 0.2, 0.5]])


def test_a_weight_adam_moved_the_other_way_on_a_near_zero_gradient_is_not_excused_by_the_plain_bound():
    """A full Adam step the other way (2 x lr) at an element whose gradient was near zero. The plain bound
    does not excuse it: an earlier case of this shape was a run that trained its first step in float32
    (a model ZeRO-3 partitioned in another precision, now refused)."""
    flipped = record([0.5, 0.1 + 2 * LR, -0.3], [])
    with pytest.raises(AssertionError, match="final weight w differs"):
        assert_parity(REFERENCE, flipped, BF16, grads=False)
    with pytest.raises(TypeError, match="adam_lr"):
        assert_parity(REFERENCE, flipped, BF16, grads=False, adam_lr=LR)


def test_a_bound_with_adam_lr_excuses_2_lr_per_step_of_noise_at_that_element_only():
    """DeepSpeed's bf16 against plain bf16 (``Tolerance.adam_lr``): element 1's gradient was within the bound
    of zero at one step, so it may be 2 x lr off; element 0, whose gradient was the largest, may not, and
    element 1 not by more."""
    bound = dataclasses.replace(BF16, adam_lr=LR)
    assert_parity(REFERENCE, record([0.5, 0.1 + 2 * LR, -0.3], []), bound, grads=False)
    for weight in ([0.5 + 2 * LR, 0.1, -0.3], [0.5, 0.1 + 4 * LR, -0.3]):
        with pytest.raises(AssertionError, match="final weight w differs"):
            assert_parity(REFERENCE, record(weight, []), bound, grads=False)
