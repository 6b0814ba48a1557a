"""HF Trainer resumes from a ``ReftTrainer`` checkpoint, exactly.

Resuming HF Trainer from a ``ReftTrainer`` checkpoint fails with ``ValueError: Can't find a valid checkpoint at
.../checkpoint-N`` (pyreft writes ``intervenable_model/`` there, HF Trainer looks for ``model.safetensors``). It
now loads ``intervenable_model/`` through ``load_intervention``, which prefers the exact states file
(``intervention_files``), so that the resumed run continues exactly where the optimizer's state left it.

Wraps ``transformers.trainer.Trainer._load_from_checkpoint``.
"""

from __future__ import annotations

import os

from ..._records import Fix, Site
from ...mechanisms.arguments import bound
from ...mechanisms.saved_files import INTERVENTIONS_DIR
from ...mechanisms.wrapped_models import holds_intervenable_model, unwrap_intervenable_model


def _wrap_load_from_checkpoint(wrapped, instance, args, kwargs):
    arguments = bound(wrapped, args, kwargs).arguments
    model = arguments["model"] or instance.model
    directory = os.path.join(arguments["resume_from_checkpoint"], INTERVENTIONS_DIR)
    if not (holds_intervenable_model(model) and os.path.isdir(directory)):
        return wrapped(*args, **kwargs)
    unwrap_intervenable_model(model).load_intervention(directory, include_model=True)
    return None


FIX = Fix(
    __name__,
    sites=(Site("transformers.trainer:Trainer._load_from_checkpoint", _wrap_load_from_checkpoint),),
    # intervention_files: the exact states file load_intervention reads (pyreft's compact form is not exact).
    requires=("intervention_files",),
    upstream=("pyreft",),
)
