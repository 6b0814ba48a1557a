"""pyreft's sequence-classification trainer evaluates as ``Trainer.evaluate`` does, sharded over the ranks.

``ReftTrainerForSequenceClassification.evaluate(self, ignore_keys)`` requires ``ignore_keys``
(``trainer.evaluate()`` raises ``TypeError``), calls ``v[0].eval()`` on interventions that pyvene 0.1.8 no longer
keeps in tuples (``TypeError: 'LoreftIntervention' object is not subscriptable``), and has every rank evaluate the
whole set. The fix evaluates with HF Trainer's sharded eval loader, gathers predictions with
``accelerator.gather_for_metrics`` (dropping the samples a shard repeats), and accepts ``eval_dataset``,
``ignore_keys`` and ``metric_key_prefix`` like ``Trainer.evaluate``. It passes the locations to pyvene as a tensor
(``devices`` indexes with it on the device), where pyreft copied them to the host as lists.

pyreft is patched when (and if) it is imported.
"""

from __future__ import annotations

import torch
from transformers.trainer_utils import EvalPrediction, denumpify_detensorize

from ..._records import Fix, Site
from ...mechanisms.trainer_steps import PYREFT


def _wrap_evaluate(wrapped, instance, args, kwargs):
    return _evaluate_sequence_classification(instance, *args, **kwargs)


def _evaluate_sequence_classification(trainer, eval_dataset=None, ignore_keys=None, metric_key_prefix="eval"):
    """pyreft's evaluation (intervened logits, ``compute_metrics`` on float32 CPU tensors), sharded."""
    trainer._memory_tracker.start()
    dataloader = trainer.get_eval_dataloader(eval_dataset)
    model = trainer.model_wrapped
    model.eval()
    predictions, labels = [], []
    with torch.no_grad():
        for inputs in dataloader:
            inputs = trainer._prepare_inputs(inputs)
            locations = inputs["intervention_locations"].permute(1, 0, 2)  # a tensor: see fixes.locations
            _, outputs = model(
                {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"]},
                unit_locations={"sources->base": (None, locations)},
            )
            predictions.append(trainer.accelerator.gather_for_metrics(outputs.logits))
            labels.append(trainer.accelerator.gather_for_metrics(inputs["labels"]))
    metrics = trainer.compute_metrics(EvalPrediction(
        predictions=torch.cat(predictions).cpu().to(torch.float32),
        label_ids=torch.cat(labels).cpu().to(torch.float32),
    ))
    metrics = denumpify_detensorize(metrics)
    for key in list(metrics):
        if not key.startswith(f"{metric_key_prefix}_"):
            metrics[f"{metric_key_prefix}_{key}"] = metrics.pop(key)
    trainer.log(metrics)
    trainer.control = trainer.callback_handler.on_evaluate(trainer.args, trainer.state, trainer.control, metrics)
    trainer._memory_tracker.stop_and_update_metrics(metrics)
    return metrics


FIX = Fix(
    __name__,
    sites=(Site(f"{PYREFT}:ReftTrainerForSequenceClassification.evaluate", _wrap_evaluate, kind="replace"),),
    requires=("devices",),
    upstream=("pyreft",),
    relies_on=("transformers.trainer:Trainer.evaluate",),  # the arguments it takes and the metrics it logs
)
