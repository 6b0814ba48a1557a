"""``reft_classifier_evaluate``: ``ReftTrainerForSequenceClassification.evaluate`` takes ``Trainer.evaluate``'s
arguments and evaluates every example once (sharded over ranks by HF's loader: tests/strategies/test_launchers.py)."""

import pytest

from pyvene_dist.testing import ParityCase
from pyvene_dist.testing.hf import accuracy, examples, training_arguments
from pyvene_dist.testing.models import import_pyreft

CASE = ParityCase(model="llama-cls", steps=1, batch_size=4, accumulation=1)


def test_evaluate_takes_trainer_evaluates_arguments(patched, tmp_path):
    """pyreft's ``evaluate(self, ignore_keys)``: ``trainer.evaluate()`` raised ``TypeError`` (no ``ignore_keys``), and
    given one, ``TypeError: 'LoreftIntervention' object is not subscriptable`` on pyvene 0.1.8's interventions."""
    pyreft = import_pyreft()
    rows = examples(CASE, 3)
    trainer = pyreft.ReftTrainerForSequenceClassification(
        model=CASE.build(), args=training_arguments(CASE, str(tmp_path), 1), eval_dataset=rows[:7],
        compute_metrics=accuracy)
    metrics = trainer.evaluate()
    assert metrics["eval_examples"] == 7 and 0 <= metrics["eval_accuracy"] <= 1
    other = trainer.evaluate(rows[7:], ignore_keys=[], metric_key_prefix="test")
    assert other["test_examples"] == len(rows) - 7 and "eval_accuracy" not in other
    with pytest.raises(TypeError):
        trainer.evaluate(rows, unknown=True)
