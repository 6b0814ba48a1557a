"""pyreft's own flows (its README, examples/alpaca/train_multigpu.py, classification, DPO, other interventions and
layouts, HF Trainer's options), each ``fn(folder, output_dir, strategy, checkpointing) -> Run``."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from trainer_runs import (
    GLOBAL_BATCH, HIDDEN_SIZE, LABELS, SEED, STEPS, Run, arguments, load, process_rank, reft, sentences, train,
)


def quickstart(folder, output_dir, strategy, checkpointing) -> Run:
    """pyreft's README: one LoReFT at the last prompt position, make_last_position_supervised_data_module,
    ReftTrainerForCausalLM with ``tokenizer=``, then greedy generation with the trained intervention."""
    import pyreft

    args = arguments(output_dir, strategy, checkpointing)
    tokenizer, model = load(folder)
    reft_model = reft(model, [1])
    prompts = [f"say {s} :" for s in sentences(GLOBAL_BATCH * STEPS, 3)]
    data = pyreft.make_last_position_supervised_data_module(tokenizer, model, prompts,
                                                            [f" {s}" for s in sentences(len(prompts), 2, 1)])
    trainer = pyreft.ReftTrainerForCausalLM(model=reft_model, tokenizer=tokenizer, args=args, **data)
    record = train(trainer, reft_model)
    prompt = tokenizer(prompts[0], return_tensors="pt").to(reft_model.get_device())
    last = prompt["input_ids"].shape[-1] - 1
    _, generated = reft_model.generate(prompt, unit_locations={"sources->base": (None, [[[last]]])},
                                       intervene_on_prompt=True, max_new_tokens=4, do_sample=False,
                                       eos_token_id=tokenizer.eos_token_id)
    return Run(record, {"generated": generated[0].tolist()})


def alpaca(folder, output_dir, strategy, checkpointing) -> Run:
    """pyreft's examples/alpaca/train_multigpu.py: ReftSupervisedDataset and ReftDataCollator, ``f1+l1`` at
    every layer, the DDP-wrapped model handed to ReftTrainerForCausalLM (under DDP), checkpoints saved
    during training, ``save`` on rank 0, then ``ReftModel.load`` on every rank."""
    import datasets
    import pyreft
    import torch.distributed as dist
    import transformers

    from pyvene_dist.testing.hf import deepspeed_config

    settings = {}
    if strategy == "zero3":
        # The example saves on rank 0 alone, with no gather when ZeRO-3 keeps the interventions whole: a
        # user's persistence threshold (HF's "auto", 10 x hidden size), not the harness's 0.
        settings["deepspeed"] = deepspeed_config("3")
        settings["deepspeed"]["zero_optimization"]["stage3_param_persistence_threshold"] = 10 * HIDDEN_SIZE
    args = arguments(output_dir, strategy, checkpointing, save_strategy="steps", save_steps=2, **settings)
    tokenizer, model = load(folder)
    layers = list(range(model.config.num_hidden_layers)) * 2  # "f1+l1", not shared: one per position
    reft_model = reft(model, layers)
    count = GLOBAL_BATCH * STEPS
    raw = datasets.Dataset.from_dict({"instruction": sentences(count, 3, 2), "input": [""] * count,
                                      "output": sentences(count, 2, 3)})
    dataset = pyreft.ReftSupervisedDataset("alpaca", None, tokenizer, dataset=raw, seed=SEED,
                                           input_field="input", instruction_field="instruction",
                                           output_field="output", num_interventions=len(layers),
                                           position="f1+l1", share_weights=False)
    collator = pyreft.ReftDataCollator(data_collator=transformers.DataCollatorForSeq2Seq(
        tokenizer=tokenizer, model=model, label_pad_token_id=-100, padding="longest"))
    handed = reft_model
    if strategy in ("single", "ddp"):
        if torch.cuda.is_available():  # the example puts the model on its rank's GPU before wrapping it
            reft_model.set_device(f"cuda:{torch.cuda.current_device()}")
        handed = torch.nn.parallel.DistributedDataParallel(reft_model)
    trainer = pyreft.ReftTrainerForCausalLM(model=handed, tokenizer=tokenizer, args=args,
                                            train_dataset=dataset, data_collator=collator)
    record = train(trainer, reft_model)
    saved = Path(output_dir) / "saved"
    if process_rank() == 0:
        reft_model.save(save_directory=str(saved))
    dist.barrier()
    loaded = pyreft.ReftModel.load(str(saved), load(folder)[1])
    # What pyreft saves and loads is each intervention's state_dict: LoReFT's rotation as the orthogonal
    # matrix itself (loading sets it through the parametrization, so the raw ``original`` differs) and its
    # learned source. Each comes back in the dtype it was saved in, bit for bit.
    trained, reloaded = (
        {f"{key}.{name}": value.cpu() for key, module in model.interventions.items()
         for name, value in module.state_dict().items()} for model in (reft_model, loaded))
    reloaded_as = {name: (str(trained[name].dtype), str(reloaded[name].dtype) if name in reloaded else "missing")
                   for name in trained}
    same = sorted(reloaded) == sorted(trained) and all(
        reloaded[name].dtype == trained[name].dtype and torch.equal(reloaded[name], trained[name]) for name in trained)
    checkpoints = sorted(p.name for p in Path(output_dir).glob("checkpoint-*"))
    return Run(record, {"loaded_equal": same, "checkpoints": checkpoints,
                        "reloaded_as": {n: d for n, d in reloaded_as.items() if d[0] != d[1]}})


def classification(folder, output_dir, strategy, checkpointing) -> Run:
    """ReftTrainerForSequenceClassification on a classifier loaded from the causal checkpoint, interventions
    at ``f1+l1`` (pyreft.get_intervention_locations), evaluated during training."""
    import datasets
    import pyreft
    from transformers import DataCollatorWithPadding

    args = arguments(output_dir, strategy, checkpointing, eval_strategy="steps", eval_steps=2,
                     per_device_eval_batch_size=GLOBAL_BATCH)
    tokenizer, model = load(folder, "classifier")
    reft_model = reft(model, [0, 1])

    def examples(count, offset):
        rows = {"input_ids": [], "attention_mask": [], "labels": [], "intervention_locations": []}
        generator = torch.Generator().manual_seed(SEED + offset)
        labels = torch.randint(LABELS, (count,), generator=generator).tolist()
        for text, label in zip(sentences(count, 5, offset), labels):
            ids = tokenizer(text)["input_ids"]
            rows["input_ids"].append(ids)
            rows["attention_mask"].append([1] * len(ids))
            rows["labels"].append(label)
            rows["intervention_locations"].append(pyreft.get_intervention_locations(
                last_position=len(ids), positions="f1+l1", num_interventions=2))
        return datasets.Dataset.from_dict(rows).with_format("torch")

    def accuracy(prediction):
        predicted = torch.as_tensor(prediction.predictions).argmax(-1)
        return {"accuracy": (predicted == torch.as_tensor(prediction.label_ids)).float().mean().item()}

    trainer = pyreft.ReftTrainerForSequenceClassification(
        model=reft_model, args=args, train_dataset=examples(GLOBAL_BATCH * STEPS, 4),
        eval_dataset=examples(GLOBAL_BATCH, 5), compute_metrics=accuracy,
        data_collator=pyreft.ReftDataCollator(data_collator=DataCollatorWithPadding(tokenizer, padding="longest")))
    record = train(trainer, reft_model)
    evaluations = [entry["eval_accuracy"] for entry in trainer.state.log_history if "eval_accuracy" in entry]
    return Run(record, {"eval_accuracy": evaluations})


def dpo(folder, output_dir, strategy, checkpointing, *, concatenated: bool) -> Run:
    """pyreft's examples/dpo: the policy forward on chosen and rejected (concatenated in one batch, or as two
    forwards), a ``no_grad`` reference forward through the base model (``model.model``), one backward."""
    import pyreft

    class DPOTrainer(pyreft.ReftTrainerForCausalLM):
        def compute_loss(self, model, inputs, return_outputs=False, **kwargs):
            intervenable = model.module if hasattr(model, "module") and not hasattr(model, "interventions") else model
            half = inputs["input_ids"].shape[0] // 2

            def policy(rows):
                locations = inputs["intervention_locations"][rows].permute(1, 0, 2).tolist()
                _, out = model({"input_ids": inputs["input_ids"][rows],
                                "attention_mask": inputs["attention_mask"][rows]},
                               unit_locations={"sources->base": (None, locations)})
                return _sequence_log_prob(out.logits, inputs["labels"][rows])

            if concatenated:
                both = policy(slice(None))
                chosen, rejected = both[:half], both[half:]
            else:
                chosen, rejected = policy(slice(0, half)), policy(slice(half, None))
            with torch.no_grad():
                reference = intervenable.model(input_ids=inputs["input_ids"],
                                               attention_mask=inputs["attention_mask"]).logits
                reference = _sequence_log_prob(reference, inputs["labels"])
            margin = (chosen - reference[:half]) - (rejected - reference[half:])
            loss = -torch.nn.functional.logsigmoid(0.1 * margin).mean()
            return (loss, None) if return_outputs else loss

    # DPO's first step nearly cancels chosen against rejected: on this data an element of learned_source's
    # gradient is 6e-9, below Adam's default eps (1e-8), where Adam's step lr*g/(|g|+eps) turns gradients
    # equal to 3e-7 (relative to the largest) into weights 5e-5 apart. With eps 1e-6 the step is linear in
    # such a gradient, and the weights are compared, not Adam's sensitivity to rounding.
    args = arguments(output_dir, strategy, checkpointing, adam_epsilon=1e-6)
    tokenizer, model = load(folder)
    reft_model = reft(model, [0, 1], component="block_output")
    prompts = [f"say {s} :" for s in sentences(GLOBAL_BATCH * STEPS // 2, 3, 6)]
    chosen = pyreft.make_last_position_supervised_data_module(
        tokenizer, model, prompts, [f" {s}" for s in sentences(len(prompts), 2, 7)], num_interventions=2)
    rejected = pyreft.make_last_position_supervised_data_module(
        tokenizer, model, prompts, [f" {s}" for s in sentences(len(prompts), 2, 8)], num_interventions=2)
    # Each global batch: its chosen examples, then the same prompts' rejected ones; every rank gets pairs.
    rows = []
    pairs = GLOBAL_BATCH // 2
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    share = pairs // world_size
    for step in range(STEPS):
        for rank in range(world_size):
            picked = range(step * pairs + rank * share, step * pairs + (rank + 1) * share)
            rows += [chosen["train_dataset"][i] for i in picked] + [rejected["train_dataset"][i] for i in picked]
    import datasets

    dataset = datasets.Dataset.from_list(rows)
    trainer = DPOTrainer(model=reft_model, args=args, train_dataset=dataset, data_collator=chosen["data_collator"])
    trainer.get_train_dataloader = lambda: _in_order(trainer, dataset)
    return Run(train(trainer, reft_model))


def _in_order(trainer, dataset):
    """Each rank's batches as laid out (pairs together): a sequential loader over this rank's rows."""
    from torch.utils.data import DataLoader, Subset

    world_size, rank = int(os.environ.get("WORLD_SIZE", 1)), process_rank()
    size = trainer.args.per_device_train_batch_size
    mine = [i for i in range(len(dataset)) if (i // size) % world_size == rank]
    return DataLoader(Subset(dataset, mine), batch_size=size, collate_fn=trainer.data_collator)


def _sequence_log_prob(logits, labels):
    shifted = labels[:, 1:]
    mask = shifted != -100
    picked = torch.gather(logits[:, :-1].log_softmax(-1), 2, shifted.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (picked * mask).sum(-1)


def layouts(folder, output_dir, strategy, checkpointing, *, intervention, share_weights=False,
            subspaces=False) -> Run:
    """Other interventions and layouts through make_multiple_position_supervised_data_module: NoReFT,
    DiReFT, one intervention's weights shared by the first and last positions, and subspaces."""
    import pyreft

    args = arguments(output_dir, strategy, checkpointing)
    tokenizer, model = load(folder)
    layers = [0, 1] if share_weights else [0, 1, 0, 1]
    reft_model = reft(model, layers, intervention=intervention, rank=4,
                      **({"subspace_partition": [[0, 2], [2, 4]]} if subspaces else {}))
    prompts = [f"say {s} :" for s in sentences(GLOBAL_BATCH * STEPS, 3, 9)]
    data = pyreft.make_multiple_position_supervised_data_module(
        tokenizer, model, prompts, [f" {s}" for s in sentences(len(prompts), 2, 10)], positions="f1+l1",
        num_interventions=len(layers), share_weights=share_weights)
    if subspaces:
        data["train_dataset"] = data["train_dataset"].add_column(
            "subspaces", [[[0, 1]] * len(layers)] * len(prompts))
    trainer = pyreft.ReftTrainerForCausalLM(model=reft_model, processing_class=tokenizer, args=args, **data)
    return Run(train(trainer, reft_model))


def trainer_options(folder, output_dir, strategy, checkpointing, *, dtype="float32") -> Run:
    """What users switch on in HF Trainer: gradient accumulation, a checkpoint every step with
    save_total_limit, then a fresh trainer resuming from the next-to-last checkpoint, whose last step and
    final weights must be the first run's; and bf16. (Evaluation is workload c's: ReftTrainerForCausalLM
    cannot evaluate on pyreft 0.1.0, whose compute_loss returns ``(outputs, outputs)`` where HF Trainer's
    prediction_step expects a loss.)"""
    import pyreft

    from pyvene_dist.testing import intervention_weights

    world_size = int(os.environ.get("WORLD_SIZE", 1))
    settings = dict(per_device_train_batch_size=GLOBAL_BATCH // world_size // 2, gradient_accumulation_steps=2,
                    save_strategy="steps", save_steps=1, save_total_limit=2, bf16=dtype == "bfloat16")
    prompts = [f"say {s} :" for s in sentences(GLOBAL_BATCH * STEPS, 3, 11)]
    outputs = [f" {s}" for s in sentences(len(prompts), 2, 12)]

    def trainer():
        # HF's order under ZeRO-3: the arguments before the model, which from_pretrained then partitions in
        # their precision (loaded first, under the previous workload's float32 arguments, it is refused)
        args = arguments(output_dir, strategy, checkpointing, **settings)
        tokenizer, model = load(folder)
        reft_model = reft(model, [0, 1])
        data = pyreft.make_last_position_supervised_data_module(tokenizer, model, prompts, outputs,
                                                                num_interventions=2)
        return pyreft.ReftTrainerForCausalLM(model=reft_model, processing_class=tokenizer, args=args, **data), \
            reft_model

    first, reft_model = trainer()
    record = train(first, reft_model)
    kept = sorted(p.name for p in Path(output_dir).glob("checkpoint-*"))
    second, resumed_model = trainer()
    second.train(resume_from_checkpoint=str(Path(output_dir) / f"checkpoint-{STEPS - 1}"))
    resumed_losses = [entry["loss"] for entry in second.state.log_history if "loss" in entry]
    return Run(record, {"checkpoints": kept, "resumed_losses": resumed_losses,
                        "resumed_weights": intervention_weights(resumed_model)})
