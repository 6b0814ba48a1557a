"""HF Trainer and pyreft's trainers work together with no extra arguments.

1. transformers 4.46+ calls ``compute_loss(model, inputs, num_items_in_batch=...)``; pyreft 0.1.0's
   ``ReftTrainer.compute_loss`` and ``ReftTrainerForSequenceClassification.compute_loss`` take
   ``(intervenable, inputs, return_outputs=False)``: ``TypeError: ReftTrainer.compute_loss() got an
   unexpected keyword argument 'num_items_in_batch'`` at the first step. The fix passes on only the
   keywords the installed method declares (all of them where it takes ``**kwargs``, as pyreft's git
   HEAD does). Dropping ``num_items_in_batch`` is exact: pyreft's loss is the model's own per-batch
   mean, and HF Trainer, seeing that ``IntervenableModel.forward`` takes no loss keywords, divides it
   by the accumulation steps itself.
2. With ``remove_unused_columns=True`` (the default) HF Trainer keeps only the columns named in
   ``model.forward``'s signature; ``IntervenableModel.forward(base, sources, unit_locations, ...)``
   names none of pyreft's, so ``compute_loss`` fails with ``KeyError: 'input_ids'``. The fix adds the
   columns pyreft's trainers read to the kept ones, for models that hold a pyvene ``IntervenableModel``.

pyreft and ``transformers.trainer`` are patched when (and if) they are imported.
Checked on pyreft 0.1.0 with transformers 5.17 and 5.24.
"""

from __future__ import annotations

import functools
import inspect

from ._models import holds_intervenable_model

PYREFT = "pyreft.reft_trainer"
TRANSFORMERS = "transformers.trainer"
SITES = (
    f"{PYREFT}:ReftTrainer.compute_loss",
    f"{PYREFT}:ReftTrainerForSequenceClassification.compute_loss",
    f"{TRANSFORMERS}:Trainer._set_signature_columns_if_needed",
)
#: The batch keys pyreft's trainers read in ``compute_loss``.
PYREFT_COLUMNS = ("input_ids", "attention_mask", "labels", "intervention_locations", "subspaces")


def patch(registry) -> None:
    registry.when_imported(PYREFT, functools.partial(_patch_pyreft, registry))
    registry.when_imported(TRANSFORMERS, functools.partial(_patch_transformers, registry))


def _patch_pyreft(registry, module) -> None:
    registry.wrap(module.ReftTrainer, "compute_loss", _wrap_declared_keywords_only)
    registry.wrap(module.ReftTrainerForSequenceClassification, "compute_loss", _wrap_declared_keywords_only)


def _patch_transformers(registry, module) -> None:
    registry.wrap(module.Trainer, "_set_signature_columns_if_needed", _wrap_set_signature_columns)


def _wrap_declared_keywords_only(wrapped, instance, args, kwargs):
    parameters = inspect.signature(wrapped).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        kwargs = {name: value for name, value in kwargs.items() if name in parameters}
    return wrapped(*args, **kwargs)


def _wrap_set_signature_columns(wrapped, instance, args, kwargs):
    wrapped(*args, **kwargs)
    if holds_intervenable_model(instance.model):
        missing = [column for column in PYREFT_COLUMNS if column not in instance._signature_columns]
        instance._signature_columns += missing
