"""An intervention's parametrized weight is computed once per application, not once per read.

LoReFT keeps its rotation orthogonal with ``torch.nn.utils.parametrizations.orthogonal``: every read
of ``rotate_layer.weight`` recomputes a Householder product from the raw matrix (``tril``, a norm, a
``householder_product`` of several kernels, a sign fix), and its backward is longer still.
``LoreftIntervention.forward`` reads the weight twice and ``LowRankRotateLayer`` once more, so a
four-intervention forward builds twelve rotations where four would do, and backward walks twelve
Householder graphs, each a few dozen kernel launches, in a step that is bound by launching kernels.

The fix runs pyvene's ``do_intervention`` (one intervention applied once) inside
``torch.nn.utils.parametrize.cached()``, the context PyTorch provides for this: the first read computes
the weight, later reads in the same application reuse it; a recomputation under gradient checkpointing
goes through ``do_intervention`` again and builds the same graph. Forward outputs are bit-identical
(the same arithmetic, once); gradients reach the raw matrix through one Householder backward instead of
three whose results are summed, so they agree to rounding (fp32: relative 1e-6 in tests), not bit for
bit. The weights are read afresh on every call, so an optimizer step between forwards is always seen.

PyTorch keeps that cache in module globals: a counter of open contexts and one dict keyed by the
*original* module the parametrization was registered on (the key is fixed in the property it injects
into the module's class). ``nn.DataParallel`` replicas share that class, so a replica would read
another replica's weight, on another GPU (``Expected all tensors to be on the same device``). Replicas
(``mechanisms.wrapped_models.is_replica``: torch's ``replicate`` marks them) therefore build their weights uncached,
in forward and in recomputation alike. Applications also run off the main thread (checkpointed recomputation runs on
the autograd engine's device thread), so entering and leaving the context is serialised by a lock.
"""

from __future__ import annotations

from pyvene.models import intervenable_base, modeling_utils

from .._records import Fix, Site
from ..mechanisms.parametrization_cache import cached_parametrizations
from ..mechanisms.wrapped_models import is_replica


def _wrap_with_cached_parametrizations(wrapped, instance, args, kwargs):
    intervention = args[2] if len(args) > 2 else kwargs.get("intervention")
    if is_replica(intervention):
        return wrapped(*args, **kwargs)
    with cached_parametrizations():
        return wrapped(*args, **kwargs)


FIX = Fix(
    __name__,
    sites=(
        Site((modeling_utils, "do_intervention"), _wrap_with_cached_parametrizations,
             reexported_in=(intervenable_base,)),  # star-imported there
    ),
    upstream=("pyvene",),
)
