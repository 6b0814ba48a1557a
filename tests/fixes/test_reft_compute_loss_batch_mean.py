"""``reft_compute_loss``: pyreft's trainers average the loss over the whole batch, as HF Trainer does for models that take
``num_items_in_batch``: under DDP and with gradient accumulation, on examples with different numbers of
label tokens, every step's loss, gradients and the weights equal one process training on the whole batch.

Before, the loss was each micro-batch's own mean: the mean of per-rank token means under DDP, of
micro-batch means with accumulation; neither is the batch's token mean when examples differ in length.
"""

import os

import pytest
import torch
import torch.distributed as dist

import helpers
from pyreft_setup import PROMPT, SENTENCES, build_folder, load, loreft

#: fp32, whole batch against its parts: the sums differ only in their order.
TOLERANCE = dict(rtol=1e-5, atol=1e-5)
STEPS = 3
#: 3 steps of 4 examples. Taken in order: a step's micro-batches (and ranks) get answers of different lengths.
QUESTIONS, ANSWERS = SENTENCES[0::2] * STEPS, SENTENCES[1::2] * STEPS


def gradient_recorder():
    """A callback keeping, per step, the trainable parameters' gradients as the optimizer sees them
    (all-reduced under DDP, summed over the micro-batches of an accumulated step)."""
    from transformers import TrainerCallback

    class GradientRecorder(TrainerCallback):
        def __init__(self):
            self.gradients = []

        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            self.gradients.append({name: p.grad.detach().clone() for name, p in model.named_parameters()
                                   if p.requires_grad})

    return GradientRecorder()


def train_causal_lm(folder, output_dir, batch_size, accumulation=1, adjust=None):
    """pyreft's README flow on variable-length answers: returns per-step losses and gradients, and the weights."""
    import pyreft

    from pyreft_setup import arguments

    model, tokenizer = load(folder)
    reft_model = pyreft.get_reft_model(model, loreft(model, [0, 1]))
    data_module = pyreft.make_last_position_supervised_data_module(
        tokenizer, model, [PROMPT % q for q in QUESTIONS], ANSWERS, num_interventions=2)
    recorder = gradient_recorder()
    args = arguments(output_dir, max_steps=STEPS, per_device_train_batch_size=batch_size,
                     gradient_accumulation_steps=accumulation, train_sampling_strategy="sequential",
                     max_grad_norm=0.0)
    trainer = pyreft.ReftTrainerForCausalLM(model=reft_model, processing_class=tokenizer, args=args,
                                            callbacks=[recorder], **data_module)
    if adjust is not None:
        adjust(trainer)
    trainer.train()
    return {
        "losses": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry],
        "gradients": recorder.gradients,
        "weights": {name: p.detach().clone() for name, p in reft_model.named_parameters() if p.requires_grad},
    }


def assert_same_run(candidate, reference, **tolerance):
    assert len(candidate["losses"]) == len(reference["losses"]) == STEPS
    torch.testing.assert_close(torch.tensor(candidate["losses"]), torch.tensor(reference["losses"]), **tolerance,
                               msg=lambda m: f"per-step loss: {m}")
    for step, (found, expected) in enumerate(zip(candidate["gradients"], reference["gradients"], strict=True)):
        for name, gradient in expected.items():
            torch.testing.assert_close(found[name], gradient, **tolerance, msg=lambda m: f"step {step}, {name}: {m}")
    for name, weight in reference["weights"].items():
        torch.testing.assert_close(candidate["weights"][name], weight, **tolerance, msg=lambda m: f"{name}: {m}")


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    return build_folder(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def whole_batch(model_folder, tmp_path_factory):
    """One process, all 4 examples of a step in one batch: the reference."""
    import pyvene_dist

    helpers.patch()
    try:
        return train_causal_lm(model_folder, tmp_path_factory.mktemp("whole"), batch_size=4)
    finally:
        pyvene_dist.unpatch()


def test_one_process_without_accumulation_trains_as_before(patched, model_folder, whole_batch, tmp_path):
    """The whole batch's loss is its own mean: counting its tokens changes nothing but rounding."""
    def as_before(trainer):  # the micro-batch's own mean, divided by 1 accumulation step
        trainer.model_accepts_loss_kwargs = False

    assert_same_run(whole_batch, train_causal_lm(model_folder, tmp_path, batch_size=4, adjust=as_before))


def test_gradient_accumulation_matches_the_whole_batch(patched, model_folder, whole_batch, tmp_path):
    assert_same_run(train_causal_lm(model_folder, tmp_path, batch_size=2, accumulation=2), whole_batch, **TOLERANCE)


def test_evaluation_loss_is_the_batch_token_mean(patched, model_folder, whole_batch, tmp_path):
    """HF Trainer's evaluation loop reads ``(loss, outputs)`` from ``compute_loss``; ReftTrainer returned the
    outputs twice: ``AttributeError: 'CausalLMOutputWithPast' object has no attribute 'detach'``. Before any
    step, the first batch's evaluation loss is the first logged training loss (same weights, same batch)."""
    def evaluate_first(trainer):
        metrics = trainer.evaluate(trainer.train_dataset.select(range(4)))
        assert metrics["eval_loss"] == pytest.approx(whole_batch["losses"][0], rel=1e-6)

    train_causal_lm(model_folder, tmp_path, batch_size=4, adjust=evaluate_first)


@pytest.mark.world_size(2)
def test_ddp_matches_one_process_with_the_whole_batch(model_folder, whole_batch, tmp_path):
    helpers.patch()
    candidate = train_causal_lm(model_folder, tmp_path / f"rank{dist.get_rank()}", batch_size=2)
    assert_same_run(candidate, whole_batch, **TOLERANCE)


def train_classifier(folder, output_dir, batch_size, accumulation=1):
    """ReftTrainerForSequenceClassification (the GLUE flow) on 6 sentences a step."""
    import datasets
    import pyreft
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding

    from pyreft_setup import arguments

    tokenizer = AutoTokenizer.from_pretrained(folder, padding_side="right")
    torch.manual_seed(0)  # the classifier head is new: the same one in every run
    model = AutoModelForSequenceClassification.from_pretrained(folder, num_labels=3, attn_implementation="eager")
    reft_model = pyreft.get_reft_model(model, loreft(model, [1]))
    encoded = [tokenizer(sentence)["input_ids"] for sentence in SENTENCES[:6]]
    dataset = datasets.Dataset.from_dict({
        "input_ids": encoded, "labels": [i % 3 for i in range(6)],
        "intervention_locations": [[[len(ids) - 1]] for ids in encoded],
    })
    collator = pyreft.ReftDataCollator(data_collator=DataCollatorWithPadding(tokenizer, padding="longest"))
    recorder = gradient_recorder()
    args = arguments(output_dir, max_steps=STEPS, per_device_train_batch_size=batch_size, max_grad_norm=0.0,
                     gradient_accumulation_steps=accumulation, train_sampling_strategy="sequential")
    trainer = pyreft.ReftTrainerForSequenceClassification(
        model=reft_model, processing_class=tokenizer, args=args, train_dataset=dataset, data_collator=collator,
        callbacks=[recorder])
    trainer.train()
    return {
        "losses": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry],
        "gradients": recorder.gradients,
        "weights": {name: p.detach().clone() for name, p in reft_model.named_parameters() if p.requires_grad},
    }


def test_classification_with_accumulation_over_unequal_micro_batches_matches_the_whole_batch(
        patched, model_folder, tmp_path):
    """6 examples a step as micro-batches of 4 and 2: the loss is their examples' mean, not the mean of the two
    micro-batch means."""
    reference = train_classifier(model_folder, tmp_path / "whole", batch_size=6)
    assert_same_run(train_classifier(model_folder, tmp_path / "parts", batch_size=4, accumulation=2), reference,
                    **TOLERANCE)


# -- a subclass with its own compute_loss: pyreft's examples/reward/train.py ------------------------------


def reward_trainer_class():
    """pyreft's ``examples/reward/train.py`` trainer: its ``compute_loss`` has pyreft 0.1.0's signature, which
    HF Trainer calls with ``num_items_in_batch=`` (``TypeError`` unless the patch drops it for subclasses too)."""
    import pyreft

    class ReftTrainerForRewardModelling(pyreft.ReftTrainer):
        def compute_loss(self, intervenable, inputs, return_outputs=False):
            # reward
            rewards = intervenable(
                {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"]},
                unit_locations={"sources->base": (None, inputs["intervention_locations"].permute(1, 0, 2).tolist())},
                subspaces=None,
            )
            # masks
            chosen_mask = torch.arange(inputs["input_ids"].shape[0]) % 2 == 0
            rejected_mask = ~chosen_mask
            # compute reward diff, maximise gap
            rewards_chosen = rewards[-1].logits[chosen_mask]
            rewards_rejected = rewards[-1].logits[rejected_mask]
            loss = -torch.nn.functional.logsigmoid(rewards_chosen - rewards_rejected).mean()
            if return_outputs:
                return loss, {"rewards_chosen": rewards_chosen, "rewards_rejected": rewards_rejected}
            return loss

    return ReftTrainerForRewardModelling


CHAT_TEMPLATE = "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"


@pytest.fixture(scope="module")
def reward_folder(tmp_path_factory):
    """The tiny Llama's folder, its tokenizer given a chat template (pyreft's reward data applies it)."""
    from transformers import AutoTokenizer

    folder = build_folder(tmp_path_factory.mktemp("tiny-llama-chat"))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    return folder


def clear_every_gradient():
    """A callback that clears all gradients after each step, as DDP's wrapper does: pyvene's own
    ``zero_grad`` clears only the interventions', so one process keeps summing the score head's
    (issue 27, item 1: fixed on its own). Without it the runs compared here would differ for that alone."""
    from transformers import TrainerCallback

    class ClearEveryGradient(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            torch.nn.Module.zero_grad(model)

    return ClearEveryGradient()


def train_reward_model(folder, output_dir, trainer_class, pairs, accumulation=1):
    """examples/reward/train.py's setup: a 1-label sequence classifier, LoReFT at ``f1+l1`` of every layer,
    the score head trainable, pyreft's reward dataset and collator; pairs of answers of different lengths."""
    import datasets
    import pyreft
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from pyreft_setup import arguments

    tokenizer = AutoTokenizer.from_pretrained(folder, padding_side="right")
    tokenizer.pad_token = tokenizer.unk_token
    torch.manual_seed(0)  # the score head is new: the same one in every run
    model = AutoModelForSequenceClassification.from_pretrained(folder, num_labels=1, attn_implementation="eager")
    model.config.pad_token_id = tokenizer.pad_token_id
    layers = list(range(model.config.num_hidden_layers)) * 2  # "+" in the position, weights not shared
    reft_model = pyreft.get_reft_model(model, loreft(model, layers, rank=1))
    for parameter in reft_model.model.score.parameters():
        parameter.requires_grad = True
    answers = SENTENCES[1::2]
    rows = [{"conv_A": [{"role": "user", "content": q}, {"role": "assistant", "content": answers[i % 4]}],
             "conv_B": [{"role": "user", "content": q}, {"role": "assistant", "content": answers[(i + 1) % 4]}],
             "conv_A_rating": 1.0, "conv_B_rating": 0.0} for i, q in enumerate(QUESTIONS)]
    train_dataset = pyreft.ReftRewardDataset(
        "reward", None, tokenizer, dataset=datasets.Dataset.from_list(rows), data_split="train", seed=0,
        num_interventions=len(layers), position="f1+l1", share_weights=False,
        conv_A_field="conv_A", conv_B_field="conv_B", conv_A_reward_field="conv_A_rating",
        conv_B_reward_field="conv_B_rating")
    collator = pyreft.ReftRewardCollator(tokenizer=tokenizer, padding=True, max_length=tokenizer.model_max_length)
    recorder = gradient_recorder()
    args = arguments(output_dir, max_steps=STEPS, per_device_train_batch_size=pairs, max_grad_norm=0.0,
                     gradient_accumulation_steps=accumulation, train_sampling_strategy="sequential",
                     remove_unused_columns=False)
    trainer = trainer_class(model=reft_model, tokenizer=tokenizer, args=args, train_dataset=train_dataset,
                            data_collator=collator, callbacks=[recorder, clear_every_gradient()])
    trainer.train()
    assert any(name.startswith("model.score.") for name in recorder.gradients[0])
    return {
        "losses": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry],
        "gradients": recorder.gradients,
        "weights": {name: p.detach().clone() for name, p in reft_model.named_parameters() if p.requires_grad},
    }


@pytest.fixture(scope="module")
def reward_whole_batch(reward_folder, tmp_path_factory):
    """One process, 4 pairs a step in one batch."""
    import pyvene_dist

    helpers.patch()
    try:
        return train_reward_model(reward_folder, tmp_path_factory.mktemp("reward"), reward_trainer_class(), 4)
    finally:
        pyvene_dist.unpatch()


def test_a_subclass_made_before_patch_with_the_old_signature_trains_with_accumulation(
        reward_folder, reward_whole_batch, tmp_path):
    """The reward example's trainer crashed patched: ``TypeError: ... compute_loss() got an unexpected keyword
    argument 'num_items_in_batch'``. Its loss is its own mean over the pairs of a micro-batch, which HF Trainer
    divides by the accumulation steps: equal to the whole batch's where micro-batches hold as many pairs."""
    import pyvene_dist

    trainer_class = reward_trainer_class()
    original = vars(trainer_class)["compute_loss"]
    helpers.patch()
    try:
        run = train_reward_model(reward_folder, tmp_path, trainer_class, 2, accumulation=2)
    finally:
        pyvene_dist.unpatch()
    if not os.environ.get(helpers.UPSTREAM_ENV):  # there pyreft wraps it when the class is made
        assert vars(trainer_class)["compute_loss"] is original  # unpatch() put it back
    assert_same_run(run, reward_whole_batch, **TOLERANCE)


@pytest.mark.world_size(2)
def test_a_subclass_made_after_patch_with_the_old_signature_trains_under_ddp(reward_folder, reward_whole_batch,
                                                                            tmp_path):
    helpers.patch()
    trainer_class = reward_trainer_class()
    run = train_reward_model(reward_folder, tmp_path / f"rank{dist.get_rank()}", trainer_class, 2)
    assert_same_run(run, reward_whole_batch, **TOLERANCE)
