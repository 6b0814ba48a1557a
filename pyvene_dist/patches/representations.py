"""A representation naming a layer or module the model lacks fails at setup, saying what exists.

pyvene resolves ``{"layer": 40, "component": "block_output"}`` on a 32-layer model to
``model.layers[40]`` and fails with ``IndexError: index 40 is out of range`` (a misspelt component
path: ``AttributeError: 'LlamaModel' object has no attribute ...``), from deep inside the resolver.
The fix names the representation, the module path it resolved to, and how many layers the model has.

``intervenable_base`` star-imports ``get_module_hook`` from ``modeling_utils``: both are wrapped.
Checked on pyvene 0.1.8.
"""

from __future__ import annotations

from .._registry import Fix, Site

FIX = Fix(
    __name__,
    sites=(
        Site("pyvene.models.modeling_utils:get_module_hook", "_wrap_get_module_hook"),
        Site("pyvene.models.intervenable_base:get_module_hook", "_wrap_get_module_hook"),  # star-imported there
    ),
    upstream=("pyvene",),
    checked={"pyvene": "==0.1.8"},
)


def _wrap_get_module_hook(wrapped, instance, args, kwargs):
    try:
        return wrapped(*args, **kwargs)
    except (IndexError, AttributeError) as error:
        model, representation = args[0], args[1]
        layers = getattr(getattr(model, "config", None), "num_hidden_layers", None)
        count = f"; {type(model).__name__} has {layers} layers (0 to {layers - 1})" if layers else ""
        raise ValueError(
            f"representation layer={representation.layer} component={representation.component!r} names no module "
            f"of {type(model).__name__} ({type(error).__name__}: {error}){count}"
        ) from error
