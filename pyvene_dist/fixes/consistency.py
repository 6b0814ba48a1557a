"""Every rank must train the same interventions; if not, say so at setup instead of hanging or diverging.

When ranks build different interventions (a layer chosen per rank, a rank from an environment variable
that differs), DDP either hangs in a collective that the ranks enter with different buckets, fails
with ``DDP expects same model across all ranks`` without saying which intervention differs, or, when
the shapes happen to match, trains silently wrong: gradients of different interventions averaged.

Before DDP or FSDP wraps a module that holds a pyvene model, the ranks exchange a description of
their interventions (key, type, layer, component, unit, rank, parameter shapes and dtypes); any
difference raises ``ValueError`` on every rank, naming the ranks and what differs.

Run with nccl and with gloo.
"""

from __future__ import annotations

from torch.nn.parallel.distributed import DistributedDataParallel

from .._records import Fix, Site
from ..mechanisms.same_interventions import check_same_interventions


def _wrap_ddp_init(wrapped, instance, args, kwargs):
    module = args[0] if args else kwargs["module"]
    check_same_interventions(module, kwargs.get("process_group"))
    return wrapped(*args, **kwargs)


FIX = Fix(
    __name__,
    sites=(Site((DistributedDataParallel, "__init__"), _wrap_ddp_init),),
)
