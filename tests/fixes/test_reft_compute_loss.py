"""``reft_compute_loss``: a stock pyreft.ReftTrainer trains under HF Trainer with pyvene_dist.patch() and nothing else;
HF Trainer's ``num_items_in_batch`` is taken or dropped, any other mistake still fails. The whole batch's mean
loss is test_reft_compute_loss_batch_mean.py's; the locations kept on the device, test_fast_path.py's."""

import gc
import math
import os
import weakref

import pytest
import torch

import helpers
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
    inputs = {"input_ids": torch.ones(1, 2, dtype=torch.long), "attention_mask": torch.ones(1, 2, dtype=torch.long),
              "labels": torch.ones(1, 2, dtype=torch.long)}
    with pytest.raises(TypeError, match=r"ReftTrainer\.compute_loss\(\).* missing .*argument: 'inputs'"):
        trainer.compute_loss(model, num_items_in_batch=torch.tensor(2))  # dropping it must not hide real mistakes
    if os.environ.get(helpers.UPSTREAM_ENV):
        return  # pyreft's compute_loss there takes **kwargs, as its main branch does
    with pytest.raises(TypeError, match=r"ReftTrainer\.compute_loss\(\): got an unexpected keyword argument 'scale'"):
        trainer.compute_loss(model, inputs, scale=2.0)  # only HF's own keyword is dropped


def test_the_signatures_read_let_go_of_functions_no_longer_used():
    """The signatures of the ``compute_loss`` methods the fix binds calls to are read once (every training step
    asks) and kept in a bounded cache: the functions of trainer classes made and dropped (a sweep, a notebook)
    are not kept alive by it."""
    from pyvene_dist.fixes.pyreft_trainer.reft_compute_loss import _declared_call

    def method():  # a trainer class's compute_loss with pyreft 0.1.0's signature, bound as a trainer calls it
        exec("def compute_loss(self, intervenable, inputs, return_outputs=False):\n    return None", namespace := {})
        return type("Trainer", (), namespace)().compute_loss

    first = method()
    call = _declared_call(first, (None, "inputs"), {"num_items_in_batch": 3})
    assert call.arguments == {"intervenable": None, "inputs": "inputs", "return_outputs": False}
    function = weakref.ref(first.__func__)
    del first, call
    for _ in range(300):  # later classes' functions, each asked about once
        _declared_call(method(), (None, "inputs"), {"num_items_in_batch": 3})
    gc.collect()
    assert function() is None
