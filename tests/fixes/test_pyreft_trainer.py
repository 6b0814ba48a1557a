"""A stock pyreft.ReftTrainer trains under HF Trainer with pyvene_dist.patch() and nothing else."""

import math

import pytest
import torch

from pyvene_dist.testing import ParityCase, assert_parity, train
from pyvene_dist.testing.hf import train_with_trainer
from pyvene_dist.testing.models import reft_model, tiny_llama

CASE = ParityCase(steps=4)


def test_reft_trainer_matches_the_harness_step_for_step(patched, tmp_path):
    # Same model, data, AdamW and weight decay split; HF Trainer clips nothing with max_grad_norm=0.
    record = train_with_trainer(CASE, str(tmp_path), max_grad_norm=0.0, optim="adamw_torch")
    reference = train(CASE, "single")
    assert len(record.losses) == CASE.steps and all(math.isfinite(loss) for loss in record.losses)
    assert_parity(reference, record, CASE.tolerance)


def test_sequence_classification_trainer_accepts_num_items_in_batch(patched, tmp_path):
    import pyreft
    from transformers import LlamaConfig, LlamaForSequenceClassification, TrainingArguments

    config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, num_labels=3, pad_token_id=0)
    torch.manual_seed(0)
    base = LlamaForSequenceClassification(config)
    model = reft_model(base, layers=(1,))
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    trainer = pyreft.ReftTrainerForSequenceClassification(model=model, args=args)
    inputs = {
        "input_ids": torch.randint(1, 97, (4, 6)),
        "attention_mask": torch.ones(4, 6, dtype=torch.long),
        "labels": torch.tensor([0, 1, 2, 1]),
        "intervention_locations": torch.full((4, 1, 1), 5),
    }
    loss = trainer.compute_loss(model, inputs, num_items_in_batch=torch.tensor(4))
    assert loss.ndim == 0 and math.isfinite(loss.item())


def test_unknown_keywords_still_fail_loudly(patched, tmp_path):
    import pyreft
    from transformers import TrainingArguments

    model = reft_model(tiny_llama())
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    trainer = pyreft.ReftTrainer(model=model, args=args)
    with pytest.raises(TypeError):
        trainer.compute_loss(model)  # inputs missing: dropping keywords must not hide real mistakes


def test_the_signature_cache_lets_go_of_functions_no_longer_used():
    """The cache of ``compute_loss`` signatures is bounded: the functions of trainer classes made and dropped
    (a sweep, a notebook) are not kept alive by it."""
    import gc
    import weakref

    from pyvene_dist.fixes.pyreft_trainer import _bound_signature

    def compute_loss(self, model, inputs, return_outputs=False):
        return None

    _bound_signature(compute_loss)
    first = weakref.ref(compute_loss)
    del compute_loss
    for _ in range(100):  # later classes' functions, each asked about once
        exec("def compute_loss(self, model, inputs):\n    return None", namespace := {})
        _bound_signature(namespace["compute_loss"])
    gc.collect()
    assert first() is None
