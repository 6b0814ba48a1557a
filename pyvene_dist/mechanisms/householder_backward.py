"""The Householder product with a closed-form backward, and torch's orthogonal map built on it.

torch's backward of ``torch.linalg.householder_product`` walks the reflectors one by one (about 550 operator
calls for LoReFT's rank-4 rotation, forward and backward). ``householder_product`` is that call with another
backward. It keeps the forward (the same ``householder_product`` call, so results are bit-identical) and
computes the gradient from the compact WY form instead. With ``V`` the unit lower-trapezoidal
reflectors (n x k), ``E`` the first k columns of the identity and ``V1 = V[:k]``::

    Q = E - V M^-1 V1^T,    M = diag(1 / tau) + striu(V^T V)      (the "UT transform")

so for ``G = dL/dQ``, with ``W = M^-1 V1^T``, ``R = M^-T V^T G``, ``Z = R W^T`` and ``S = striu(Z)``::

    dL/dV   = V (S + S^T) - G W^T - [R^T; 0]        dL/dA = tril(dL/dV, -1)
    dL/dtau = -diag(Z) / tau^2

one k x k triangular inverse and seven matrix products, batched like the input: about 100 operator
calls, most of them views, whatever the rank; the rotation's forward and backward then come to about
200. It holds for any ``tau``, not only the orthogonal map's.

The closed form is used where it is exact and supported: real float32/float64 tensors that need a
gradient, without ``out=`` and without ``__torch_function__`` subclasses; every other call is torch's,
untouched. Gradients agree with torch's to rounding (float64: relative 1e-10 in tests, and with finite
differences). The backward is not itself differentiable (no double backward through the rotation).

``closed_form_orthogonal`` is torch's ``_Orthogonal.forward`` with this product (the ``householder`` fix's
eager rotation); ``reflectors`` and ``householder_product_backward`` are what the rotation's CUDA graphs
(``rotation_graphs``) capture. Nothing here changes torch: callers choose it.
"""

from __future__ import annotations

import torch


_EXACT = (torch.float32, torch.float64)


def householder_product(*args, **kwargs) -> torch.Tensor:
    """``torch.linalg.householder_product(*args, **kwargs)``, with the closed-form backward where it applies."""
    reflectors_and_tau = _closed_form_arguments(*args, **kwargs)
    if reflectors_and_tau is None:
        return torch.linalg.householder_product(*args, **kwargs)
    return _HouseholderProduct.apply(*reflectors_and_tau)


def _closed_form_arguments(input=None, tau=None, **rest):
    """``(A, tau)`` when the closed form applies to this call, else ``None`` (torch's own path)."""
    A = input
    if rest or not isinstance(A, torch.Tensor) or not isinstance(tau, torch.Tensor):
        return None
    if type(A) is not torch.Tensor or type(tau) is not torch.Tensor:  # subclasses dispatch themselves
        return None
    if not torch.is_grad_enabled() or not (A.requires_grad or tau.requires_grad):
        return None
    if A.dtype not in _EXACT or tau.dtype != A.dtype or A.dim() < 2 or tau.dim() != A.dim() - 1:
        return None
    return A, tau


class _HouseholderProduct(torch.autograd.Function):
    @staticmethod
    def forward(ctx, A, tau):
        ctx.save_for_backward(A, tau)
        return torch.linalg.householder_product(A, tau)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        A, tau = ctx.saved_tensors
        grad_A, grad_tau = householder_product_backward(A, tau, grad)
        return (grad_A if ctx.needs_input_grad[0] else None), (grad_tau if ctx.needs_input_grad[1] else None)


def householder_product_backward(A: torch.Tensor, tau: torch.Tensor, grad: torch.Tensor):
    """``(dL/dA, dL/dtau)`` of ``Q = householder_product(A, tau)`` given ``dL/dQ``, in closed form."""
    k = A.size(-1)
    V = A.tril(-1)
    V.diagonal(dim1=-2, dim2=-1).fill_(1)
    inverse_tau = tau.reciprocal()
    M = (V.mT @ V).triu_(1)
    M.diagonal(dim1=-2, dim2=-1).copy_(inverse_tau)
    identity = torch.eye(k, dtype=A.dtype, device=A.device)
    M_inverse = torch.linalg.solve_triangular(M, identity, upper=True)  # broadcast over M's batch
    W = M_inverse @ V[..., :k, :].mT
    R = M_inverse.mT @ (V.mT @ grad)
    Z = R @ W.mT
    S = Z.triu(1)
    grad_V = V @ (S + S.mT) - grad @ W.mT
    grad_V[..., :k, :] -= R.mT
    grad_tau = Z.diagonal(dim1=-2, dim2=-1) * inverse_tau.square()
    return grad_V.tril_(-1), grad_tau.neg_()


def reflectors(X):
    A = X.tril(diagonal=-1)
    tau = 2.0 / (1.0 + (A * A).sum(dim=-2))
    signs = X.diagonal(dim1=-2, dim2=-1).int().unsqueeze(-2)
    return A, tau, signs


def closed_form_orthogonal(orthogonal, X: torch.Tensor) -> torch.Tensor:
    """torch's ``_Orthogonal.forward`` for the Householder map, op for op, its product ``householder_product``'s
    (the same forward call, the closed-form backward)."""
    transposed = X.size(-2) < X.size(-1)
    if transposed:
        X = X.mT
    A, tau, signs = reflectors(X)
    Q = householder_product(A, tau) * signs
    if hasattr(orthogonal, "base"):
        Q = orthogonal.base @ Q
    return Q.mT if transposed else Q
