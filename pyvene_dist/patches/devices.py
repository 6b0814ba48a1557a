"""Build location indices on the device of the tensor they index.

``IntervenableModel`` passes ``device=self.get_device()``, the device of the model's *first*
parameter, to ``gather_neurons`` and ``scatter_neurons``, which build their index tensors there. On a
layer that lives elsewhere (a ``device_map`` split, a ``nn.DataParallel`` replica) that fails with
``RuntimeError: Expected all tensors to be on the same device, but got index is on cuda:0, different
from other tensors on cuda:1``. Both functions already default to the indexed tensor's device when
``device`` is None; the fix drops the argument.

``intervenable_base`` star-imports both names from ``modeling_utils``, so both modules are wrapped.

Checked on pyvene 0.1.8 with torch 2.11 and 2.13.
"""

from __future__ import annotations

import functools
import inspect

SITES = (
    "pyvene.models.modeling_utils:gather_neurons",
    "pyvene.models.modeling_utils:scatter_neurons",
    "pyvene.models.intervenable_base:gather_neurons",
    "pyvene.models.intervenable_base:scatter_neurons",
)


def patch(registry) -> None:
    from pyvene.models import intervenable_base, modeling_utils

    for module in (modeling_utils, intervenable_base):
        registry.wrap(module, "gather_neurons", _wrap_index_on_tensor_device)
        registry.wrap(module, "scatter_neurons", _wrap_index_on_tensor_device)


def _wrap_index_on_tensor_device(wrapped, instance, args, kwargs):
    bound = _signature(wrapped).bind(*args, **kwargs)
    bound.arguments["device"] = None
    return wrapped(*bound.args, **bound.kwargs)


@functools.lru_cache(maxsize=None)
def _signature(function) -> inspect.Signature:
    return inspect.signature(function)
