"""LoReFT's orthogonal rotation works when a framework casts it to bf16 or fp16.

pyreft keeps LoReFT's rotation in float32, but DeepSpeed's ``bf16`` (and ``fp16``) mode casts every
parameter of the model, the rotation's raw matrix included (not the float32 ``base`` buffer the
parametrization multiplies by), and ``torch.linalg.householder_product`` has no half-precision kernel:
``NotImplementedError: "orgqr_cpu" not implemented for 'BFloat16'`` at the first forward.

The fix computes the orthogonal parametrization of a half-precision matrix in float32 and returns it in
the matrix's dtype; float32 matrices are untouched. It lives in torch's ``_Orthogonal.forward``, which
pyvene and pyreft do not own: this concern has no upstream diff (``docs/upstreaming.md``).

Checked with torch 2.11 and 2.13 and deepspeed 0.19.8.
"""

from __future__ import annotations

import torch

SITES = ("torch.nn.utils.parametrizations:_Orthogonal.forward",)

_HALF = (torch.bfloat16, torch.float16)


def patch(registry) -> None:
    from torch.nn.utils.parametrizations import _Orthogonal

    registry.wrap(_Orthogonal, "forward", _wrap_orthogonal_in_float32)


def _wrap_orthogonal_in_float32(wrapped, instance, args, kwargs):
    (X,) = args
    if X.dtype not in _HALF:
        return wrapped(X)
    return wrapped(X.float()).to(X.dtype)
