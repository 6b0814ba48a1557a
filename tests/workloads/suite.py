"""pyreft's own flows, each trained by a stock pyreft trainer on a checkpoint folder loaded with ``Auto*``.

    python tests/workloads/suite.py [--strategies ddp,zero2] [--table OUT.md]

runs every workload in one process (the reference) and under each strategy (one spawned world of 2 ranks
per strategy, which runs every workload with checkpointing off and on) and prints the largest deviation
of each workload x strategy x checkpointing from the reference without checkpointing. The tests in
``test_workloads.py`` make the same worlds once per session and assert parity case by case.

A workload is ``fn(folder, output_dir, strategy, checkpointing) -> Run``. The training loop is always
HF Trainer's, through a pyreft trainer class; strategies are what users switch on: a process group
(DDP), ``deepspeed=`` (ZeRO-2/3), ``fsdp=`` (FSDP2, which HF Trainer runs on GPUs only).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1]))  # helpers, also in the spawned ranks

STRATEGIES = ("ddp", "fsdp2", "zero2", "zero3")
CHECKPOINTING = (False, True)
STEPS, GLOBAL_BATCH, SEED, LR = 3, 4, 0, 2e-2
#: Sentences draw 1 to n of these words, and some words split into several tokens: the examples of a
#: workload differ in length and in their number of label tokens, so batches are padded and the ranks
#: hold different numbers of label tokens (as real data does; equal lengths hide loss-normalisation bugs).
WORDS = ("red green blue cat dog bird runs jumps sits big small fast slow tree house river stone light "
         "dark warm cold").split()
RARE_WORDS = "riverbank stonewall greenhouse".split()  # not in the tokenizer's corpus whole: several tokens
LABELS = 3  # classes of the classification workloads
HIDDEN_SIZE = 32  # of the checkpoint's tiny Llama
EVALUATED = 2  # examples of loreft's generation-based evaluation (greedy)
#: A chat template for pyreft's ReftRewardDataset (``apply_chat_template``).
CHAT_TEMPLATE = "{% for message in messages %}{{ message['role'] }} : {{ message['content'] }} </s> {% endfor %}"

#: Cases that need another branch's fix: ``(workload, strategy, checkpointing)``, ``None`` for any.
#: The tests skip them with this reason and the worlds do not run them (some hang); remove an entry
#: once its fix is merged.
NEEDS_FIX: dict[tuple[str, str | None, bool | None], str] = {
}


@dataclasses.dataclass
class Run:
    """One workload's record (``pyvene_dist.testing.Record``) and what else it produced: generated token
    ids, evaluation metrics, whether its rank-0 save loaded back."""

    record: object
    extras: dict = dataclasses.field(default_factory=dict)


def needs_fix(workload: str, strategy: str, checkpointing: bool) -> str | None:
    for (name, on, ckpt), reason in NEEDS_FIX.items():
        if name == workload and on in (None, strategy) and ckpt in (None, checkpointing):
            return reason
    return None


# --- the checkpoint folder ---------------------------------------------------------------------------

def make_checkpoint(folder: Path) -> Path:
    """A tiny Llama saved with ``save_pretrained`` beside a BPE tokenizer trained with ``tokenizers``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from pyreft.dataset import prompt_no_input

    from tokenizers import processors

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.Whitespace()
    corpus = [" ".join(WORDS), prompt_no_input, "say : user assistant the correct answer is 0 1 2 3 4 5 6 7 8 9"] * 20
    bpe.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=["<pad>", "<unk>", "<s>", "</s>"]))
    # A BOS first, as Llama's tokenizers do: loreft's generation-based evaluation finds the left padding by it
    bpe.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B",
                                                       special_tokens=[("<s>", bpe.token_to_id("<s>"))])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                        unk_token="<unk>", model_max_length=128, padding_side="right")
    tokenizer.chat_template = CHAT_TEMPLATE
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=HIDDEN_SIZE, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    torch.manual_seed(SEED)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    write_data(folder / "data")
    return folder


def write_data(folder: Path) -> None:
    """The scripts' data files, in the formats their readers take (``load_dataset("json", ...)``):
    loreft's ``<task>/{train,test}.json`` and alpaca's ``alpaca_data.json``."""
    import json

    count = GLOBAL_BATCH * STEPS
    answers = [str(n) for n in torch.randint(100, (count,), generator=torch.Generator().manual_seed(SEED)).tolist()]
    files = {
        "commonsense/train.json": [{"instruction": i, "answer": a} for i, a in
                                   zip(sentences(count, 6, 20), sentences(count, 2, 21))],
        "math/train.json": [{"instruction": i, "output": f"{o} so the answer is {a}", "answer": a} for i, o, a in
                            zip(sentences(count, 4, 22), sentences(count, 5, 23), answers)],
        "alpaca_data.json": [{"instruction": i, "input": x if n % 2 else "", "output": o} for n, (i, x, o) in
                             enumerate(zip(sentences(count, 4, 24), sentences(count, 3, 25), sentences(count, 5, 26)))],
    }
    for task in ("commonsense", "math"):  # the generation-based evaluation's examples: their first EVALUATED
        files[f"{task}/test.json"] = files[f"{task}/train.json"][:EVALUATED]
    for name, rows in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(json.dumps(rows))


def load(folder: Path, kind: str = "causal", num_labels: int = LABELS):
    """``AutoTokenizer`` and ``AutoModelFor*`` from ``folder``, as users load a checkpoint."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    torch.manual_seed(SEED)  # the classifier's new head is drawn from it, the same on every rank
    if kind == "classifier":
        model = AutoModelForSequenceClassification.from_pretrained(folder, num_labels=num_labels,
                                                                   attn_implementation="eager")
    else:
        model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager")
    return tokenizer, model


def sentences(count: int, length: int, offset: int = 0) -> list[str]:
    """``count`` sentences of 1 to ``length`` words (see WORDS), the same on every rank."""
    generator = torch.Generator().manual_seed(SEED + offset)
    vocabulary = WORDS + RARE_WORDS
    picks = torch.randint(len(vocabulary), (count, length), generator=generator)
    lengths = torch.randint(1, length + 1, (count,), generator=generator)
    return [" ".join(vocabulary[i] for i in row[:n]) for row, n in zip(picks.tolist(), lengths.tolist())]


def reft(model, layers, *, intervention="LoreftIntervention", rank=4, component="block_output", **representation):
    import pyreft

    torch.manual_seed(SEED + 1)
    hidden = model.config.hidden_size
    representations = [{
        "layer": layer, "component": component, "low_rank_dimension": rank, **representation,
        "intervention": getattr(pyreft, intervention)(embed_dim=hidden, low_rank_dimension=rank,
                                                      dtype=model.dtype, add_bias=True),
    } for layer in layers]
    return pyreft.get_reft_model(model, pyreft.ReftConfig(representations=representations))


# --- what users switch on ----------------------------------------------------------------------------

def arguments(output_dir: str, strategy: str, checkpointing: bool, **overrides):
    from transformers import TrainingArguments

    from pyvene_dist.testing.hf import deepspeed_config

    world_size = int(os.environ.get("WORLD_SIZE", 1))
    flag = "activation_checkpointing" if hasattr(TrainingArguments, "activation_checkpointing") else \
        "gradient_checkpointing"
    settings = dict(
        output_dir=output_dir, per_device_train_batch_size=GLOBAL_BATCH // world_size, max_steps=STEPS,
        learning_rate=LR, lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.0, optim="adamw_torch",
        logging_steps=1, save_strategy="no", report_to=[], seed=SEED, data_seed=SEED,
        train_sampling_strategy="sequential", use_cpu=not torch.cuda.is_available(), disable_tqdm=True,
        remove_unused_columns=False, **{flag: checkpointing},
    )
    if strategy.startswith("zero"):
        settings["deepspeed"] = deepspeed_config(strategy.removeprefix("zero"))
    elif strategy == "fsdp2":
        settings.update(fsdp=True, fsdp_config={"version": 2})
    settings.update(overrides)
    return TrainingArguments(**settings)


def train(trainer, model, resume_from_checkpoint=None) -> object:
    """``trainer.train()``, recorded as the parity harness records a run. A base-model parameter the flow
    trains beside the interventions (a classifier or score head) is recorded with them, as ``head.NAME``:
    its gradient is what HF Trainer's ``model.zero_grad()`` must clear between steps."""
    from transformers import TrainerCallback

    from pyvene_dist.testing import Record, intervention_weights
    from pyvene_dist.testing.hf import InterventionGradients

    class HeadGradients(TrainerCallback):
        def __init__(self):
            self.steps, self.left_over = [], []

        def on_step_begin(self, args, state, control, **kwargs):
            # What the previous step left in the heads' gradients: nothing, if it was cleared. (Runs that
            # keep summing do so alike in one process and under DDP, where parity alone cannot see it.)
            if not args.deepspeed:
                self.left_over.append(max((0.0 if p.grad is None else p.grad.abs().max().item()
                                           for p in _heads(model).values()), default=0.0))

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            if not args.deepspeed:  # as InterventionGradients: DeepSpeed has stepped inside backward
                self.steps.append({name: parameter.grad.detach().float().cpu().clone()
                                   for name, parameter in _heads(model).items()})

    gradients, heads = InterventionGradients(model), HeadGradients()
    trainer.add_callback(gradients)
    trainer.add_callback(heads)
    trainer.train(resume_from_checkpoint=resume_from_checkpoint)
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    grads = [{**interventions, **head} for interventions, head in zip(gradients.steps, heads.steps)]
    return Record(type(trainer).__name__, world_size, losses, grads,
                  {**intervention_weights(model), **head_weights(model)},
                  metrics={"head_gradient_left_over": max(heads.left_over, default=0.0)})


def _heads(model) -> dict:
    return {f"head.{name}": parameter for name, parameter in model.model.named_parameters() if parameter.requires_grad}


def head_weights(model) -> dict:
    """CPU copies of the base model's trainable parameters, whole also under ZeRO-3 (a collective)."""
    weights = {}
    for name, parameter in _heads(model).items():
        if hasattr(parameter, "ds_id"):
            from deepspeed.utils import safe_get_full_fp32_param

            parameter = safe_get_full_fp32_param(parameter)
        weights[name] = parameter.detach().float().cpu().clone()
    return weights


def _rank() -> int:
    return int(os.environ.get("RANK", 0))


# --- the workloads -----------------------------------------------------------------------------------

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
    if _rank() == 0:
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

    world_size, rank = int(os.environ.get("WORLD_SIZE", 1)), _rank()
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


# --- pyreft's example scripts (examples/loreft, examples/alpaca/train.py, examples/reward) -----------------

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


def _partial(fn, **bound):
    def run(folder, output_dir, strategy, checkpointing):
        return fn(folder, output_dir, strategy, checkpointing, **bound)

    run.__doc__ = fn.__doc__
    return run


WORKLOADS = {
    "a-quickstart": quickstart,
    "b-alpaca": alpaca,
    "c-classification": classification,
    "d-dpo-concatenated": _partial(dpo, concatenated=True),
    "d-dpo-two-forwards": _partial(dpo, concatenated=False),
    "e-noreft": _partial(layouts, intervention="NoreftIntervention"),
    "e-direft": _partial(layouts, intervention="DireftIntervention"),
    "e-shared-weights": _partial(layouts, intervention="LoreftIntervention", share_weights=True),
    "e-subspaces": _partial(layouts, intervention="LoreftIntervention", subspaces=True),
    "f-trainer-options": trainer_options,
    "f-trainer-options-bf16": _partial(trainer_options, dtype="bfloat16"),
    "g-loreft-commonsense": _partial(loreft, task="commonsense"),
    "g-loreft-math": _partial(loreft, task="math"),
    "g-loreft-glue": loreft_glue,
    "h-alpaca-train": alpaca_train,
    "i-reward": reward,
}
#: The example scripts' flows run as the scripts do: checkpointing off, and ZeRO-3 only where the script
#: takes a DeepSpeed config (loreft's and alpaca's TrainingArguments). The others run under every strategy,
#: checkpointing off and on.
SCOPE: dict[str, tuple[tuple[str, ...], tuple[bool, ...]]] = {
    **{name: (("ddp", "zero3"), (False,)) for name in ("g-loreft-commonsense", "g-loreft-math", "g-loreft-glue",
                                                         "h-alpaca-train")},
    "i-reward": (("ddp",), (False,)),
}


def in_scope(workload: str, strategy: str, checkpointing: bool) -> bool:
    strategies, checkpointing_options = SCOPE.get(workload, (STRATEGIES, CHECKPOINTING))
    return strategy in ("single", *strategies) and checkpointing in checkpointing_options
#: The workloads a GPU run compares with checkpointing on and off (``--gpu``).
GPU_WORKLOADS = ("a-quickstart", "b-alpaca", "c-classification", "d-dpo-concatenated", "d-dpo-two-forwards")


# --- one world per strategy --------------------------------------------------------------------------

def run_world(folder: str, output: str, strategy: str, cases: list[tuple[str, bool]]) -> None:
    """In every rank: each case in turn, each in its own output folder; rank 0 saves ``{case: Run or error}``.

    A workload that raises is recorded as its traceback and the next one runs: one broken workload names
    itself instead of hiding the others (if it left a collective half done, the world's timeout says so).
    """
    import warnings

    import helpers

    warnings.filterwarnings("ignore")
    helpers.patch()
    results = {}
    for workload, checkpointing in cases:
        scratch = Path(output).parent / f"{workload}-{'checkpointing' if checkpointing else 'plain'}"
        try:
            results[(workload, checkpointing)] = WORKLOADS[workload](Path(folder), str(scratch), strategy,
                                                                     checkpointing)
        except Exception:  # noqa: BLE001 -- recorded, compared (and reported) per case in the parent
            results[(workload, checkpointing)] = traceback.format_exc()
    if _rank() == 0:
        torch.save(results, output)


def world(folder: Path, strategy: str, cases, *, timeout: float = 900.0) -> dict:
    """Spawn ``strategy``'s world (1 rank for ``single``, else 2), run ``cases``, return rank 0's results."""
    from pyvene_dist.testing import spawn

    backend = "nccl" if torch.cuda.is_available() else "gloo"  # accelerate gathers CUDA tensors, even alone
    with tempfile.TemporaryDirectory(prefix=f"workloads-{strategy}-") as scratch:
        output = Path(scratch) / "results.pt"
        outcome = spawn(run_world, world_size=1 if strategy == "single" else 2, backend=backend, timeout=timeout,
                        workdir=scratch, args=(str(folder), str(output), strategy, list(cases)))
        if outcome.failed:
            raise RuntimeError(f"the {strategy} world failed:\n{outcome.report()}")
        return torch.load(output, weights_only=False)


def cases_for(strategy: str, workloads=WORKLOADS, checkpointing=CHECKPOINTING) -> list[tuple[str, bool]]:
    return [(w, c) for w in workloads for c in checkpointing
            if in_scope(w, strategy, c) and needs_fix(w, strategy, c) is None]


def tolerance(workload: str, strategy: str):
    from pyvene_dist.testing import TOLERANCES
    from pyvene_dist.testing.parity import DEEPSPEED_BF16

    if workload.endswith("bf16"):
        # Final weights, besides: Adam steps an element by about lr whatever its gradient's size, so where
        # the reference's gradient was within bf16's noise, DeepSpeed's rounding may have stepped it the other
        # way (ZeRO-2, CPU: one rotation element with gradient 1.1e-3 of its tensor's largest, +3.1e-5 in one
        # process and -2.3e-5 under ZeRO-2 at step 1, ends 0.041 = 2 x lr off; see DEEPSPEED_BF16)
        return dataclasses.replace(DEEPSPEED_BF16, adam_lr=LR) if strategy.startswith("zero") else \
            TOLERANCES[torch.bfloat16]
    return TOLERANCES[torch.float32]


def table(reference: dict, worlds: dict[str, dict], workloads=tuple(WORKLOADS)) -> str:
    """Markdown: one row per workload x checkpointing, one column per strategy, each cell the largest
    relative deviation from the reference without checkpointing (loss, gradients, weights), or why not
    ("-": not run there, see SCOPE)."""
    from pyvene_dist.testing import differences

    strategies = list(worlds)
    lines = ["| workload | checkpointing | " + " | ".join(strategies) + " |",
             "|---|---|" + "---|" * len(strategies)]
    for workload in workloads:
        for checkpointing in SCOPE.get(workload, (STRATEGIES, CHECKPOINTING))[1]:
            cells = []
            for strategy in strategies:
                expected = reference.get((workload, False))
                found = worlds[strategy].get((workload, checkpointing))
                reason = needs_fix(workload, strategy, checkpointing)
                if not in_scope(workload, strategy, checkpointing):
                    cells.append("-")
                elif reason:
                    cells.append(f"skip: {reason.split('(')[0].split(':')[0].strip()}")
                elif not isinstance(expected, Run):
                    cells.append("reference failed: " + (expected or "not run").strip().splitlines()[-1][:60])
                elif not isinstance(found, Run):
                    cells.append("error: " + (found or "not run").strip().splitlines()[-1][:60])
                else:
                    d = differences(expected.record, found.record)
                    cells.append(f"{max(d.loss, d.grad, d.weight):.1e}")
            lines.append(f"| {workload} | {'on' if checkpointing else 'off'} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--workloads", help="comma-separated (default: all; with --gpu, the GPU workloads)")
    parser.add_argument("--gpu", action="store_true", help=f"workloads {', '.join(GPU_WORKLOADS)} on one GPU, "
                                                          "checkpointing on against off")
    parser.add_argument("--table", help="also write the table (markdown) here")
    options = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if not torch.cuda.is_available() else "cuda")
    with tempfile.TemporaryDirectory(prefix="workloads-") as scratch:
        folder = make_checkpoint(Path(scratch) / "checkpoint")
        workloads = options.workloads.split(",") if options.workloads else GPU_WORKLOADS if options.gpu else list(WORKLOADS)
        reference = world(folder, "single", cases_for("single", workloads))
        worlds = {"single": reference} if options.gpu else {
            strategy: world(folder, strategy, cases_for(strategy, workloads))
            for strategy in options.strategies.split(",")}
    for strategy, results in {"single": reference, **worlds}.items():
        for (workload, checkpointing), found in results.items():
            if isinstance(found, str):  # a traceback: the table shows its last line
                print(f"--- {workload} under {strategy}, checkpointing {checkpointing}:\n{found}", file=sys.stderr)
    text = table(reference, worlds, workloads)
    print(text)
    if options.table:
        Path(options.table).write_text(text + "\n")


if __name__ == "__main__":
    main()
