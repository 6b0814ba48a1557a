"""HF Trainer decays ordinary intervention weights, and never a parametrization's ``original``.

Today HF Trainer decays *nothing* in a pyvene model: ``get_decay_parameter_names`` builds names like
``interventions.<key>.learned_source.weight`` while pyvene's ``named_parameters`` yielded
``<key>.learned_source.weight``, so no name matched and ``weight_decay`` silently did nothing. Once
names are standard (``fixes.parameters``), LoReFT's rotation ``...rotate_layer.parametrizations.
weight.original`` would be decayed, and one AdamW step makes the rotation exactly zero (see
``pyvene_dist.optim``). The fix drops parametrization originals from the decay list of any model that
holds a pyvene ``IntervenableModel``; other models keep HF Trainer's behaviour untouched.
"""

from __future__ import annotations

from .._records import Fix, Site
from ..optim import parametrization_original_names
from ..mechanisms.wrapped_models import holds_intervenable_model

MODULE = "transformers.trainer"


def _wrap_get_decay_parameter_names(wrapped, instance, args, kwargs):
    names = wrapped(*args, **kwargs)
    model = args[0] if args else kwargs["model"]
    if not holds_intervenable_model(model):
        return names
    never_decay = parametrization_original_names(model)
    return [name for name in names if name not in never_decay]


FIX = Fix(
    __name__,
    sites=(Site(f"{MODULE}:Trainer.get_decay_parameter_names", _wrap_get_decay_parameter_names),),
    requires=("parameters",),  # names parametrizations' originals by nn.Module's standard names
    upstream=("pyreft",),
)
