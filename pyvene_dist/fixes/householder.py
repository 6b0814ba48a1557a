"""The Householder product behind LoReFT's rotation gets a closed-form backward.

LoReFT keeps its rotation orthogonal with ``torch.nn.utils.parametrizations.orthogonal``, which for a
tall matrix is ``torch.linalg.householder_product(A, tau)`` of the reflectors under the diagonal. The
forward is one LAPACK/cuSOLVER call; torch's backward (``householder_product_backward``) walks the
reflectors one by one: the rank-4 rotation's forward and backward came to about 550 operator calls
(profiler events), against LoRA's few per adapter. A ReFT training step can be bound by the host
issuing kernels, and four such backwards were most of what it issued beyond LoRA's step
(docs/benchmarks.md).

The fix keeps the forward (the same ``householder_product`` call, so results are bit-identical) and computes
the gradient from the compact WY form instead (``mechanisms.householder_backward`` has the closed form): one
k x k triangular inverse and seven matrix products, about 100 operator calls whatever the rank; the rotation's
forward and backward then come to about 200. Gradients agree with torch's to rounding (float64: relative 1e-10
in tests, and with finite differences); real float32/float64 tensors that need a gradient only, every other
call is torch's. The backward is not itself differentiable (no double backward through the rotation).

Only pyvene's interventions get it: ``torch.linalg.householder_product`` stays torch's for every caller.
The fix has no site and no code of its own: it is the ``orthogonal`` fix's choice of backward for its eager
rotation, taken while this fix is applied (``_registry.applied`` says so), so ``orthogonal`` names it in ``after``.
The dependency runs one way: this record requires nothing, and applied without ``orthogonal`` it changes
nothing (pyvene's rotations are then torch's). A user's own orthogonal layer in the same process keeps torch's
forward and backward, double backward included.

The slow backward is torch's (``householder_product_backward``), which pyvene and pyreft do not own:
this concern has no upstream diff (``docs/upstreaming.md``).
"""

from __future__ import annotations

from .._records import Fix

FIX = Fix(
    __name__,
    # No site: the orthogonal fix's ReftOrthogonal takes this backward for its eager rotation where this fix is
    # applied (its record names this one in `after`); the code is mechanisms.householder_backward.
    sites=(),
)
