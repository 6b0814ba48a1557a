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
#: Sentences are words the tokenizer holds whole, so every example of a workload has the same length:
#: no padding, the same number of label tokens on every rank, and the ranks' mean loss is the batch's.
WORDS = ("red green blue cat dog bird runs jumps sits big small fast slow tree house river stone light "
         "dark warm cold").split()
LABELS = 3  # classes of workload c
HIDDEN_SIZE = 32  # of the checkpoint's tiny Llama

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

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.Whitespace()
    corpus = [" ".join(WORDS), prompt_no_input, "say :"] * 20
    bpe.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=["<pad>", "<unk>", "<s>", "</s>"]))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                        unk_token="<unk>", model_max_length=128, padding_side="right")
    if len({len(tokenizer(word)["input_ids"]) for word in WORDS}) != 1:
        raise AssertionError("the tokenizer splits some of WORDS: examples would differ in length")
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=HIDDEN_SIZE, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    torch.manual_seed(SEED)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def load(folder: Path, kind: str = "causal"):
    """``AutoTokenizer`` and ``AutoModelFor*`` from ``folder``, as users load a checkpoint."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    torch.manual_seed(SEED)  # the classifier's new head is drawn from it, the same on every rank
    if kind == "classifier":
        model = AutoModelForSequenceClassification.from_pretrained(folder, num_labels=LABELS,
                                                                   attn_implementation="eager")
    else:
        model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager")
    return tokenizer, model


def sentences(count: int, length: int, offset: int = 0) -> list[str]:
    generator = torch.Generator().manual_seed(SEED + offset)
    picks = torch.randint(len(WORDS), (count, length), generator=generator)
    return [" ".join(WORDS[i] for i in row) for row in picks.tolist()]


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
    """``trainer.train()``, recorded as the parity harness records a run."""
    from pyvene_dist.testing import Record
    from pyvene_dist.testing.hf import InterventionGradients
    from pyvene_dist.testing.parity import intervention_weights

    gradients = InterventionGradients(model)
    trainer.add_callback(gradients)
    trainer.train(resume_from_checkpoint=resume_from_checkpoint)
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    return Record(type(trainer).__name__, world_size, losses, gradients.steps, intervention_weights(model))


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
    # learned source. pyreft 0.1.0's ReftModel.load builds them in bfloat16 (docs/limits.md): equal within
    # bfloat16's rounding (2**-8 relative, twice: saved and loaded).
    trained, reloaded = (
        {f"{key}.{name}": value.float().cpu() for key, module in model.interventions.items()
         for name, value in module.state_dict().items()} for model in (reft_model, loaded))
    same = sorted(reloaded) == sorted(trained) and all(
        torch.allclose(reloaded[name], trained[name], rtol=2 ** -7, atol=2 ** -7 * trained[name].abs().max().item())
        for name in trained)
    checkpoints = sorted(p.name for p in Path(output_dir).glob("checkpoint-*"))
    return Run(record, {"loaded_equal": same, "checkpoints": checkpoints})


def classification(folder, output_dir, strategy, checkpointing) -> Run:
    """ReftTrainerForSequenceClassification on a classifier loaded from the causal checkpoint, interventions
    at ``f1+l1`` (pyreft.get_intervention_locations), evaluated during training."""
    import datasets
    import pyreft

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
        data_collator=pyreft.ReftDataCollator(data_collator=_stack))
    record = train(trainer, reft_model)
    evaluations = [entry["eval_accuracy"] for entry in trainer.state.log_history if "eval_accuracy" in entry]
    return Run(record, {"eval_accuracy": evaluations})


def _stack(instances):
    return {key: torch.stack([torch.as_tensor(instance[key]) for instance in instances]) for key in instances[0]}


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

    args = arguments(output_dir, strategy, checkpointing)
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

    from pyvene_dist.testing.parity import intervention_weights

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
}
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
    return [(w, c) for w in workloads for c in checkpointing if needs_fix(w, strategy, c) is None]


def tolerance(workload: str, strategy: str):
    from pyvene_dist.testing import TOLERANCES
    from pyvene_dist.testing.parity import DEEPSPEED_BF16

    if workload.endswith("bf16"):
        return DEEPSPEED_BF16 if strategy.startswith("zero") else TOLERANCES[torch.bfloat16]
    return TOLERANCES[torch.float32]


def table(reference: dict, worlds: dict[str, dict], workloads=tuple(WORKLOADS)) -> str:
    """Markdown: one row per workload x checkpointing, one column per strategy, each cell the largest
    relative deviation from the reference without checkpointing (loss, gradients, weights), or why not."""
    from pyvene_dist.testing import differences

    strategies = list(worlds)
    lines = ["| workload | checkpointing | " + " | ".join(strategies) + " |",
             "|---|---|" + "---|" * len(strategies)]
    for workload in workloads:
        for checkpointing in CHECKPOINTING:
            cells = []
            for strategy in strategies:
                expected = reference.get((workload, False))
                found = worlds[strategy].get((workload, checkpointing))
                reason = needs_fix(workload, strategy, checkpointing)
                if reason:
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
