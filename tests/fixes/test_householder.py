"""fixes.householder: torch's Householder product with a closed-form backward, for pyvene's rotations only.

``householder.householder_product`` is the closed-form call; the references are finite differences
(``gradcheck``) and torch's own backward on the same inputs; the forward must stay torch's, bit for
bit. Patched, ``torch.linalg.householder_product`` is torch's own, and LoReFT's rotation in a model
built while patched uses the closed form.
"""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import helpers
import pyvene_dist
from pyvene_dist.mechanisms import householder_backward as householder
from pyvene_dist.testing import models

TORCHS = torch.linalg.householder_product


def _inputs(batch, n, k, *, orthogonal_tau, dtype=torch.float64, seed=0):
    generator = torch.Generator().manual_seed(seed)
    A = torch.randn(*batch, n, k, generator=generator, dtype=dtype) / n**0.5
    if orthogonal_tau:  # as torch's orthogonal parametrization builds it: a reflection per column
        tau = 2.0 / (1.0 + (A.tril(-1) ** 2).sum(dim=-2))
    else:
        tau = 0.5 + torch.rand(*batch, k, generator=generator, dtype=dtype)
    grad = torch.randn(*batch, n, k, generator=generator, dtype=dtype)
    return A.requires_grad_(), tau.requires_grad_(), grad


def _product_and_grads(A, tau, grad, product=TORCHS):
    Q = product(A, tau)
    return (Q.detach(), *torch.autograd.grad(Q, (A, tau), grad))


@given(
    batch=st.lists(st.integers(1, 3), max_size=2),
    k=st.integers(1, 6),
    extra_rows=st.integers(0, 9),
    orthogonal_tau=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_gradients_equal_torchs_and_the_product_is_torchs(batch, k, extra_rows, orthogonal_tau, seed):
    A, tau, grad = _inputs(batch, k + extra_rows, k, orthogonal_tau=orthogonal_tau, seed=seed)
    stock = _product_and_grads(A, tau, grad)
    closed_form = _product_and_grads(A, tau, grad, householder.householder_product)
    assert torch.equal(closed_form[0], stock[0])
    for name, got, expected in zip(("A", "tau"), closed_form[1:], stock[1:]):
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize("shape", [(7, 3), (5, 5), (6, 1), (2, 6, 2)])
def test_gradients_match_finite_differences(shape):
    A, tau, _ = _inputs(shape[:-2], *shape[-2:], orthogonal_tau=False)
    assert type(householder.householder_product(A, tau).grad_fn).__name__ == "_HouseholderProductBackward"
    assert torch.autograd.gradcheck(householder.householder_product, (A, tau))


@pytest.mark.gpus(1)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_on_a_gpu_gradients_equal_torchs(dtype):
    """On CUDA the closed form runs on cuBLAS (a triangular inverse, small products); torch's on its
    own kernels. Batched, with the orthogonal map's tau and at LoReFT's shape."""
    tolerance = {"rtol": 1e-10, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-6}
    for batch, n, k in (((), 2048, 4), ((3,), 40, 7)):
        A, tau, grad = (t.detach().to("cuda", dtype).requires_grad_(t.requires_grad)
                        for t in _inputs(batch, n, k, orthogonal_tau=True))
        stock = _product_and_grads(A, tau, grad)
        closed_form = _product_and_grads(A, tau, grad, householder.householder_product)
        assert torch.equal(closed_form[0], stock[0])
        for name, got, expected in zip(("A", "tau"), closed_form[1:], stock[1:]):
            torch.testing.assert_close(got, expected, **tolerance, msg=f"{name} of {(*batch, n, k)}")


def test_float32_rotation_gradients_agree_with_torchs_to_rounding():
    """LoReFT's rotation as pyreft builds it (float32, the orthogonal parametrization), through a loss.
    Built while patched, as pyvene_dist is used: pyvene's model adopts the rotation then."""
    with pyvene_dist.patched():
        reft = models.reft_model(models.tiny_llama(hidden=64), layers=(0,), seed=1)
    rotation = next(iter(reft.interventions.values())).rotate_layer
    original = rotation.parametrizations.weight.original  # (hidden, rank): reflectors under the diagonal
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():  # move the reflectors away from zero, where most terms vanish; the diagonal
        original.add_(0.1 * torch.randn(original.shape, generator=generator).tril(-1))  # holds signs, read by .int()
    target = torch.randn(rotation.weight.shape, generator=generator)

    def grad_of_original():
        rotation.parametrizations.weight.original.grad = None
        ((rotation.weight - target) ** 2).sum().backward()
        return rotation.parametrizations.weight.original.grad

    expected = grad_of_original()
    with pyvene_dist.patched():
        got = grad_of_original()
        assert "_HouseholderProductBackward" in helpers.backward_names(rotation.weight.grad_fn)
    assert expected.abs().max() > 0.1
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


class _CountOperators(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def _backward_operators(rank: int) -> int:
    A, tau, grad = _inputs((), 64, rank, orthogonal_tau=True, dtype=torch.float32)
    Q = householder.householder_product(A, tau)
    with _CountOperators() as counter:
        Q.backward(grad)
    return counter.count


def test_the_backward_does_not_loop_over_reflectors():
    """torch's backward applies the reflectors one by one, so its operator count grows with the rank
    (per call: one operator per kernel the host issues); the closed form's stays fixed."""
    counts = {rank: _backward_operators(rank) for rank in (2, 4, 16)}
    assert counts[2] == counts[4] == counts[16], counts


@pytest.mark.parametrize("case", ["no grad", "bfloat16", "out", "keywords"])
def test_other_calls_are_torchs(case):
    """The closed-form call gives torch's own wherever the closed form does not apply; patched,
    ``torch.linalg.householder_product`` itself is torch's for every call."""
    A, tau, _ = _inputs((), 6, 3, orthogonal_tau=True, dtype=torch.float32)
    if case == "bfloat16":
        A, tau = A.detach().bfloat16().requires_grad_(), tau.detach().bfloat16().requires_grad_()

    def call(product=TORCHS):
        if case == "no grad":
            with torch.no_grad():
                return product(A, tau)
        if case == "out":
            out = torch.empty(6, 3)
            return product(A.detach(), tau.detach(), out=out)
        if case == "keywords":
            return product(input=A, tau=tau)
        return product(A, tau)

    with pyvene_dist.patched():
        assert torch.linalg.householder_product is TORCHS
    try:
        stock = call()
    except (NotImplementedError, RuntimeError) as error:  # no half-precision kernel on CPU
        with pytest.raises(type(error)):
            call(householder.householder_product)
        return
    got = call(householder.householder_product)
    assert torch.equal(got, stock)
    if case == "keywords":  # a gradient is needed and the closed form applies
        assert type(got.grad_fn).__name__ == "_HouseholderProductBackward"
    else:
        assert type(got.grad_fn) is type(stock.grad_fn)


def _closed_form_backwards(monkeypatch) -> int:
    """How many times the closed-form backward runs in one backward of a LoReFT intervention built now."""
    calls = []
    backward = householder._HouseholderProduct.backward
    monkeypatch.setattr(householder._HouseholderProduct, "backward",
                        staticmethod(lambda ctx, grad: calls.append(grad.shape) or backward(ctx, grad)))
    reft = models.reft_model(models.tiny_llama(hidden=64), layers=(0,), seed=1)
    intervention = next(iter(reft.interventions.values()))
    base = torch.randn(2, 64, generator=torch.Generator().manual_seed(3))
    intervention(base).square().sum().backward()
    assert intervention.rotate_layer.parametrizations.weight.original.grad.abs().max() > 0
    return len(calls)


def test_a_loreft_backward_takes_the_closed_form(patched, monkeypatch):
    """The path the fix takes on the CPU (on a GPU the rotation's graphs take the closed form whatever is applied):
    a LoReFT intervention's backward runs the closed form, through orthogonal's eager rotation. It fails
    under PYVENE_DIST_TEST_WITHOUT=householder, where the next test's torch backward runs instead."""
    assert _closed_form_backwards(monkeypatch) > 0


def test_without_the_fix_a_loreft_backward_is_torchs(monkeypatch):
    with pyvene_dist.patched(exclude=["householder"]):
        assert _closed_form_backwards(monkeypatch) == 0
