"""pyreft's example scripts as flows (examples/loreft on commonsense, math and GLUE, examples/alpaca/train.py,
examples/reward), each ``fn(folder, output_dir, strategy, checkpointing) -> Run``, run as the scripts run."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from trainer_runs import GLOBAL_BATCH, SEED, STEPS, Run, arguments, load, reft, sentences, train


def _script_arguments(output_dir, strategy, **overrides):
    """The scripts' gradient accumulation (2 micro-batches per step) over the suite's global batch."""
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    return arguments(output_dir, strategy, False, per_device_train_batch_size=GLOBAL_BATCH // world_size // 2,
                     gradient_accumulation_steps=2, **overrides)


def _loreft_datasets():
    """examples/loreft/dataset.py's readers for the tasks the suite runs (commonsense, math, GLUE), on
    pyreft's ReftDataset, which adds the intervention positions, the sink padding token and the masks."""
    import pyreft
    from pyreft.dataset import prompt_no_input

    class LoReftSupervisedDataset(pyreft.ReftDataset):
        #: task_config.py: the prompt template and the trigger tokens the evaluation splits generations at
        templates = {"commonsense": ("%s\n", "the correct answer is "), "math": (prompt_no_input, "### Response:")}

        def preprocess(self, kwargs):
            self.original_data_split = self.data_split
            self.task_prompt_template, self.trigger_tokens = self.templates[self.task]
            self.data_path = os.path.join(self.data_path, self.data_split + ".json")

        def postprocess(self, kwargs):
            self.raw_dataset = self.task_dataset

        def tokenize(self, item):
            prompt = self.task_prompt_template % item["instruction"]
            answer = self.trigger_tokens + item["answer"] if self.task == "commonsense" else item["output"]
            prompt_ids = self._ids(prompt)
            if self.original_data_split != "train":
                return {"input_ids": prompt_ids}, len(prompt_ids)
            input_ids = self._ids(prompt + answer + self.tokenizer.eos_token)
            labels = input_ids.clone()
            labels[:len(prompt_ids)] = -100
            return {"input_ids": input_ids, "labels": labels}, len(prompt_ids)

        def _ids(self, text):
            return self.tokenizer(text, max_length=self.tokenizer.model_max_length, truncation=True,
                                  return_tensors="pt")["input_ids"][0]

    class LoReftGLUEDataset(pyreft.ReftDataset):
        def preprocess(self, kwargs):
            self.pad_mode, self.fields_to_pad = "last", ["input_ids"]  # the sink token at the end; labels are classes

        def tokenize(self, item):
            input_ids = self.tokenizer(item["sentence"], max_length=self.tokenizer.model_max_length,
                                       truncation=True, return_tensors="pt")["input_ids"][0]
            return {"input_ids": input_ids, "labels": item["label"]}, len(input_ids)

    return LoReftSupervisedDataset, LoReftGLUEDataset


def _eval_mode(reft_model) -> str | None:
    """The scripts' "ensure everything is in eval mode" after training, with their idiom ``v[0].eval()``;
    returns what the idiom raised, if it did. The flow then goes on with pyvene 0.1.8's own way (its
    interventions are no longer tuples), so that its evaluation is still compared."""
    reft_model.model.eval()
    try:
        for _, value in reft_model.interventions.items():
            _ = value[0].eval()
    except TypeError as error:
        for value in reft_model.interventions.values():
            value.eval()
        return f"{type(error).__name__}: {error}"
    return None


def loreft(folder, output_dir, strategy, checkpointing, *, task) -> Run:
    """examples/loreft/train.py on a causal LM task: its LoReftSupervisedDataset read from ``<task>/train.json``,
    positions ``f2+l2`` with one intervention per position (commonsense) or ``f1+l1`` shared (math), every
    layer, ReftTrainerForCausalLM with gradient accumulation; then compute_metrics' generation-based
    evaluation: left padding, locations shifted by the BOS's position, greedy generation, exact match."""
    import pyreft
    import transformers

    supervised, _ = _loreft_datasets()
    args = _script_arguments(output_dir, strategy)
    tokenizer, model = load(folder)
    share_weights = task == "math"
    position = "f1+l1" if share_weights else "f2+l2"
    layers = [0, 1] if share_weights else [0, 1] * 2
    reft_model = reft(model, layers)
    data = {"num_interventions": len(layers), "position": position, "share_weights": share_weights}
    train_dataset = supervised(task, str(folder / "data" / task), tokenizer, data_split="train", seed=SEED,
                               test_split="test", **data)
    collator = pyreft.ReftDataCollator(data_collator=transformers.DataCollatorForSeq2Seq(
        tokenizer=tokenizer, model=model, label_pad_token_id=-100, padding="longest"))
    reft_model.model.train()
    trainer = pyreft.ReftTrainerForCausalLM(model=reft_model, tokenizer=tokenizer, args=args,
                                            train_dataset=train_dataset, data_collator=collator)
    record = train(trainer, reft_model)
    idiom = _eval_mode(reft_model)
    evaluated = supervised(task, str(folder / "data" / task), tokenizer, data_split="test", seed=SEED, **data)
    tokenizer.padding_side = "left"
    inputs = collator([evaluated[i] for i in range(len(evaluated))])
    locations = inputs["intervention_locations"].permute(1, 0, 2)  # [interventions, batch, positions]
    bos = (inputs["input_ids"] == tokenizer.bos_token_id).nonzero(as_tuple=True)[1]
    locations = (locations + bos.reshape(1, -1, 1) - 1).tolist()  # the left padding, less the sink token
    device = reft_model.get_device()
    with torch.no_grad():
        _, generated = reft_model.generate(
            {"input_ids": inputs["input_ids"].to(device), "attention_mask": inputs["attention_mask"].to(device)},
            unit_locations={"sources->base": (None, locations)}, intervene_on_prompt=True,
            eos_token_id=tokenizer.eos_token_id, max_new_tokens=4, do_sample=False)
    texts = tokenizer.batch_decode(generated, skip_special_tokens=True)
    trigger = evaluated.trigger_tokens
    outputs = [text[text.find(trigger) + len(trigger):].strip() if trigger in text else "" for text in texts]
    answers = [item["answer"].strip() for item in evaluated.raw_dataset]
    return Run(record, {"generated": generated.tolist(), "eval_idiom_error": idiom,
                        "exact_match": sum(o == a for o, a in zip(outputs, answers)) / len(answers)})


def loreft_glue(folder, output_dir, strategy, checkpointing) -> Run:
    """examples/loreft/train.py on GLUE with ``-allow_cls_grad``: LoReftGLUEDataset, position ``f1`` at every
    layer, the classifier head trained beside the interventions (Llama's ``score``; the script names
    RoBERTa's ``classifier``), DataCollatorWithPadding, gradient accumulation, evaluation during training,
    then the final evaluation's argmax predictions."""
    import datasets
    import pyreft
    from transformers import DataCollatorWithPadding

    _, glue = _loreft_datasets()
    args = _script_arguments(output_dir, strategy, eval_strategy="steps", eval_steps=2,
                             per_device_eval_batch_size=GLOBAL_BATCH)
    tokenizer, model = load(folder, "classifier", num_labels=2)
    layers = [0, 1]
    reft_model = reft(model, layers)
    for parameter in reft_model.model.score.parameters():
        parameter.requires_grad = True

    def split(count, offset):
        labels = torch.randint(2, (count,), generator=torch.Generator().manual_seed(SEED + offset)).tolist()
        raw = datasets.Dataset.from_dict({"sentence": sentences(count, 6, offset), "label": labels})
        return glue("glue", "sst2", tokenizer, dataset=raw, seed=SEED, num_interventions=len(layers), position="f1")

    def accuracy(prediction):
        predicted = torch.as_tensor(prediction.predictions).argmax(-1)
        return {"accuracy": (predicted == torch.as_tensor(prediction.label_ids)).float().mean().item()}

    collator = pyreft.ReftDataCollator(data_collator=DataCollatorWithPadding(tokenizer, padding="longest"))
    evaluated = split(GLOBAL_BATCH, 28)
    reft_model.model.train()
    trainer = pyreft.ReftTrainerForSequenceClassification(
        model=reft_model, tokenizer=tokenizer, args=args, train_dataset=split(GLOBAL_BATCH * STEPS, 27),
        eval_dataset=evaluated, data_collator=collator, compute_metrics=accuracy)
    record = train(trainer, reft_model)
    idiom = _eval_mode(reft_model)
    inputs = collator([evaluated[i] for i in range(len(evaluated))])
    device = reft_model.get_device()
    with torch.no_grad():
        _, outputs = reft_model({"input_ids": inputs["input_ids"].to(device),
                                 "attention_mask": inputs["attention_mask"].to(device)},
                                unit_locations={"sources->base": (None, inputs["intervention_locations"].permute(
                                    1, 0, 2).tolist())})
    history = [entry["eval_accuracy"] for entry in trainer.state.log_history if "eval_accuracy" in entry]
    return Run(record, {"eval_accuracy": history, "predictions": outputs.logits.argmax(-1).tolist(),
                        "eval_idiom_error": idiom})


def alpaca_train(folder, output_dir, strategy, checkpointing) -> Run:
    """examples/alpaca/train.py: ReftSupervisedDataset read from ``alpaca_data.json`` (with and without
    inputs), ``f1+l1`` at every layer, the pad token set to ``unk``, pyreft's base ReftTrainer (HF Trainer's
    own data loading) with gradient accumulation, then ``save_state`` and ``save_model``."""
    import pyreft
    import transformers

    args = _script_arguments(output_dir, strategy)
    tokenizer, model = load(folder)
    tokenizer.pad_token = tokenizer.unk_token
    layers = [0, 1] * 2
    reft_model = reft(model, layers)
    dataset = pyreft.ReftSupervisedDataset(
        "alpaca", str(folder / "data" / "alpaca_data.json"), tokenizer, data_split="train", seed=SEED,
        input_field="input", instruction_field="instruction", output_field="output",
        num_interventions=len(layers), position="f1+l1", share_weights=False)
    collator = pyreft.ReftDataCollator(data_collator=transformers.DataCollatorForSeq2Seq(
        tokenizer=tokenizer, model=model, label_pad_token_id=-100, padding="longest"))
    trainer = pyreft.ReftTrainer(model=reft_model, tokenizer=tokenizer, args=args, train_dataset=dataset,
                                 data_collator=collator)
    record = train(trainer, reft_model)
    trainer.save_state()
    trainer.save_model(output_dir=output_dir)
    saved = sorted(p.name for p in (Path(output_dir) / "intervenable_model").glob("*"))
    return Run(record, {"saved": saved})


def reward(folder, output_dir, strategy, checkpointing) -> Run:
    """examples/reward/train.py: ReftRewardDataset (chat-templated conversation pairs, swapped so the
    better-rated is chosen) and ReftRewardCollator, a one-label classifier whose ``score`` head trains beside
    LoReFT at ``f1+l1`` on every layer, and the script's trainer, which overrides ``compute_loss`` with
    HF's old signature (no ``num_items_in_batch``) and ``prediction_step``; then its evaluation."""
    import datasets
    import pyreft

    class ReftTrainerForRewardModelling(pyreft.ReftTrainer):
        def compute_loss(self, intervenable, inputs, return_outputs=False):
            rewards = intervenable({"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"]},
                                   unit_locations={"sources->base": (
                                       None, inputs["intervention_locations"].permute(1, 0, 2).tolist())},
                                   subspaces=None)
            chosen = torch.arange(inputs["input_ids"].shape[0]) % 2 == 0  # the collator interleaves the pairs
            chosen_rewards, rejected_rewards = rewards[-1].logits[chosen], rewards[-1].logits[~chosen]
            loss = -torch.nn.functional.logsigmoid(chosen_rewards - rejected_rewards).mean()
            if return_outputs:
                return loss, {"rewards_chosen": chosen_rewards, "rewards_rejected": rejected_rewards}
            return loss

        def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
            loss, rewards = self.compute_loss(model, inputs, return_outputs=True)
            margins = (rewards["rewards_chosen"] - rewards["rewards_rejected"]).detach().cpu()
            return loss.detach().cpu(), margins, torch.ones_like(margins)

    def accuracy(prediction):
        return {"accuracy": float((prediction.predictions.reshape(-1) > 0).mean())}

    args = arguments(output_dir, strategy, checkpointing, per_device_eval_batch_size=2)
    tokenizer, model = load(folder, "classifier", num_labels=1)
    tokenizer.pad_token = tokenizer.unk_token
    model.config.pad_token_id = tokenizer.pad_token_id
    layers = [0, 1] * 2
    reft_model = reft(model, layers)
    for parameter in reft_model.model.score.parameters():
        parameter.requires_grad = True

    def pairs(count, offset):
        prompts, first, second = (sentences(count, 4, offset + n) for n in range(3))
        ratings = torch.rand(2, count, generator=torch.Generator().manual_seed(SEED + offset)).tolist()
        raw = datasets.Dataset.from_dict({
            "conv_A": [[{"role": "user", "content": p}, {"role": "assistant", "content": a}]
                       for p, a in zip(prompts, first)],
            "conv_B": [[{"role": "user", "content": p}, {"role": "assistant", "content": b}]
                       for p, b in zip(prompts, second)],
            "conv_A_rating": ratings[0], "conv_B_rating": ratings[1]})
        return pyreft.ReftRewardDataset(
            "reward", "all", tokenizer, dataset=raw, data_split="train", seed=SEED, num_interventions=len(layers),
            position="f1+l1", share_weights=False, conv_A_field="conv_A", conv_B_field="conv_B",
            conv_A_reward_field="conv_A_rating", conv_B_reward_field="conv_B_rating")

    trainer = ReftTrainerForRewardModelling(
        model=reft_model, tokenizer=tokenizer, args=args, train_dataset=pairs(GLOBAL_BATCH * STEPS, 30),
        eval_dataset=pairs(GLOBAL_BATCH, 33), compute_metrics=accuracy,
        data_collator=pyreft.ReftRewardCollator(tokenizer=tokenizer, padding=True,
                                                max_length=tokenizer.model_max_length))
    record = train(trainer, reft_model)
    idiom = _eval_mode(reft_model)
    metrics = trainer.evaluate()
    return Run(record, {"eval_accuracy": [metrics["eval_accuracy"]], "eval_loss": metrics["eval_loss"],
                        "eval_idiom_error": idiom})
