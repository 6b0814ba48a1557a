"""``model.zero_grad()`` clears the whole model (fixes.zero_grad): a head trained beside the interventions
gets each step's own gradient under HF Trainer, as under DDP, instead of the sum of every step so far."""

import pytest
import torch

from pyvene_dist.testing import models

STEPS, BATCH, LABELS, LR = 4, 4, 3, 1e-2


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return models.save_checkpoint(tmp_path_factory.mktemp("checkpoint"))


def classifier(folder):
    """pyreft's examples/loreft/train.py for GLUE with ``--allow_cls_grad``: a classifier loaded from the
    folder, LoReFT at two layers, then the classifier head made trainable beside the interventions."""
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(0)  # the new head's weights
    model = AutoModelForSequenceClassification.from_pretrained(folder, num_labels=LABELS, attn_implementation="eager")
    reft_model = models.reft_model(model, layers=(0, 1), rank=2)
    for parameter in reft_model.model.score.parameters():
        parameter.requires_grad = True
    reft_model.model.train()
    return reft_model


def classification_data(folder):
    """Sentences of two lengths, a label each, and pyreft's locations (first and last token), padded by
    pyreft's collator around HF's, as the example collates GLUE."""
    import pyreft
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    labels = torch.randint(LABELS, (STEPS * BATCH,), generator=torch.Generator().manual_seed(0)).tolist()
    rows = []
    for index, (example, label) in enumerate(zip(models.instruction_examples(STEPS * BATCH), labels)):
        ids = tokenizer(example["instruction"] + example["output"] * (index % 2))["input_ids"]
        rows.append({"input_ids": ids, "attention_mask": [1] * len(ids), "labels": label,
                     "intervention_locations": pyreft.get_intervention_locations(
                         last_position=len(ids), first_n=1, last_n=1, pad_mode="last", num_interventions=2)})
    collator = pyreft.ReftDataCollator(data_collator=transformers.DataCollatorWithPadding(tokenizer, padding="longest"))
    return tokenizer, rows, collator


def trainer_for(reft_model, folder, output_dir, callbacks=()):
    import pyreft
    from transformers import TrainingArguments

    tokenizer, rows, collator = classification_data(folder)
    args = TrainingArguments(output_dir=str(output_dir), per_device_train_batch_size=BATCH, max_steps=STEPS,
                             learning_rate=LR, lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.0,
                             optim="adamw_torch", train_sampling_strategy="sequential", report_to=[], use_cpu=True,
                             save_strategy="no", remove_unused_columns=False, disable_tqdm=True)
    return pyreft.ReftTrainerForSequenceClassification(model=reft_model, processing_class=tokenizer, args=args,
                                                        train_dataset=rows, data_collator=collator,
                                                        callbacks=list(callbacks))


def test_trainer_gives_the_head_each_steps_own_gradient(patched, checkpoint, tmp_path):
    from transformers import TrainerCallback

    class HeadGradients(TrainerCallback):
        def __init__(self):
            self.seen = []

        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            self.seen.append(model.model.score.weight.grad.clone())

    recorder = HeadGradients()
    trainer_for(classifier(checkpoint), checkpoint, tmp_path / "trainer", [recorder]).train()

    # The same steps by hand, clearing every gradient before each (nn.Module's zero_grad, as DDP's does).
    reft_model = classifier(checkpoint)
    hand = trainer_for(reft_model, checkpoint, tmp_path / "hand")  # for its data loader and pyreft's loss
    optimizer = torch.optim.AdamW([p for p in reft_model.parameters() if p.requires_grad], lr=LR, weight_decay=0.0)
    expected = []
    for batch in hand.get_train_dataloader():
        torch.nn.Module.zero_grad(reft_model)
        hand.compute_loss(reft_model, batch).backward()
        expected.append(reft_model.model.score.weight.grad.clone())
        optimizer.step()

    assert len(recorder.seen) == len(expected) == STEPS
    for step, (found, wanted) in enumerate(zip(recorder.seen, expected), start=1):
        torch.testing.assert_close(found, wanted, rtol=1e-5, atol=1e-7, msg=lambda m, step=step: f"step {step}: {m}")


def test_zero_grad_clears_the_base_model_and_the_interventions(patched):
    reft_model = models.reft_model(models.tiny_llama_classifier(), layers=(0, 1), rank=2)
    reft_model.model.score.weight.requires_grad = True
    ids = torch.randint(1, models.VOCAB_SIZE, (2, 5), generator=torch.Generator().manual_seed(0))
    trained = [reft_model.model.score.weight, *reft_model.interventions.parameters()]

    def backward():
        _, outputs = reft_model({"input_ids": ids}, unit_locations={"base": 3}, labels=torch.tensor([0, 2]))
        outputs.loss.backward()

    backward()
    assert all(parameter.grad is not None for parameter in trained)
    reft_model.zero_grad()
    assert all(parameter.grad is None for parameter in trained)

    backward()
    reft_model.zero_grad(set_to_none=False)  # nn.Module's signature
    assert all(parameter.grad is not None and not parameter.grad.any() for parameter in trained)
