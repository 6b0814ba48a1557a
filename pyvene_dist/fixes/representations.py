"""A representation naming a layer or module the model lacks fails at setup, saying what exists.

pyvene resolves ``{"layer": 40, "component": "block_output"}`` on a 32-layer model to
``model.layers[40]`` and fails with ``IndexError: index 40 is out of range`` (a misspelt component
path: ``AttributeError: 'LlamaModel' object has no attribute ...``), from deep inside the resolver.
The fix names the representation, the module path it resolved to, and how many layers the model has.

For an architecture pyvene has no mapping for (Phi-3, say), pyvene reads the component as a module path,
finds none, and the same error blames layer 0. The fix says that the architecture is not mapped, and how
to map it (``pyvene.type_to_module_mapping`` and ``pyvene.type_to_dimension_mapping``) or to name a
module path instead.

``intervenable_base`` star-imports ``get_module_hook`` from ``modeling_utils``: both are wrapped.
"""

from __future__ import annotations

from pyvene.models import intervenable_base, modeling_utils
from pyvene.models.intervenable_modelcard import type_to_module_mapping

from .._records import Fix, Site


def _wrap_get_module_hook(wrapped, instance, args, kwargs):
    try:
        return wrapped(*args, **kwargs)
    except (IndexError, AttributeError) as error:
        model, representation = args[0], args[1]
        if not _is_mapped(model):
            raise ValueError(_unmapped_message(model, representation)) from error
        layers = getattr(getattr(model, "config", None), "num_hidden_layers", None)
        count = f"; {type(model).__name__} has {layers} layers (0 to {layers - 1})" if layers else ""
        raise ValueError(
            f"representation layer={representation.layer} component={representation.component!r} names no module "
            f"of {type(model).__name__} ({type(error).__name__}: {error}){count}"
        ) from error


def _is_mapped(model) -> bool:
    return type(model) in type_to_module_mapping


def _unmapped_message(model, representation) -> str:
    name = f"{type(model).__module__}.{type(model).__qualname__}"
    return (
        f"representation layer={representation.layer} component={representation.component!r}: pyvene has no "
        f"mapping for the architecture {type(model).__name__}, so it cannot tell where its layers and components "
        f"are. Add one before building the model, as pyvene's own models do (pyvene/models/llama/"
        f"modelings_intervenable_llama.py):\n"
        f"    pyvene.type_to_module_mapping[{name}] = {{'block_output': ('model.layers[%s]', "
        f"pyvene.models.constants.CONST_OUTPUT_HOOK), ...}}\n"
        f"    pyvene.type_to_dimension_mapping[{name}] = {{'block_output': ('hidden_size',), ...}}\n"
        f"or name a module path as the component, e.g. component='model.layers[0].output'"
    )


FIX = Fix(
    __name__,
    sites=(
        Site((modeling_utils, "get_module_hook"), _wrap_get_module_hook,
             reexported_in=(intervenable_base,)),  # star-imported there
    ),
    upstream=("pyvene",),
)
