"""The parity harness through HF Trainer and a stock pyreft trainer, as users train.

``train_with_trainer(case, output_dir)`` builds ``case``'s model and examples, trains them with
``pyreft.ReftTrainer`` (or another pyreft trainer class) and returns the same ``Record`` as
``parity.train``: the loss HF Trainer logs at every step (already averaged over ranks), the
intervention gradients as the optimizer sees them (after clipping), and the final weights.
Launched by torchrun, the same call is the distributed run: HF Trainer shards the data itself.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import torch
import transformers
# accelerate, optional elsewhere, is HF Trainer's own requirement; TrainingArguments imports it already.
from accelerate import Accelerator
from accelerate.state import PartialState
from accelerate.utils import DistributedType
from torch.utils.data import DataLoader
from transformers import TrainerCallback, TrainingArguments

from ..optim import param_groups
from .case import ParityCase, Record
from .comparison import intervention_grads, intervention_weights
from .models import import_pyreft
from .strategies import deepspeed_config  # noqa: F401 -- HF Trainer's config, named here too


def examples(case: ParityCase, steps: int | None = None) -> list[dict[str, torch.Tensor]]:
    """``case.batches()`` as a flat list of pyreft examples, in order: micro-batch ``k`` is ``[k*B, (k+1)*B)``."""
    rows = []
    for batch in case.batches(steps):
        for i, input_ids in enumerate(batch["input_ids"]):
            rows.append({
                "input_ids": input_ids,
                "attention_mask": batch["attention_mask"][i],
                "labels": batch["labels"][i],
                "intervention_locations": batch["locations"][:, i],
            })
    return rows


def accuracy(prediction) -> dict[str, float]:
    """``compute_metrics`` for the classifier cases: accuracy, and the number of examples seen."""
    predicted = prediction.predictions.argmax(-1)
    return {"accuracy": (predicted == prediction.label_ids).float().mean().item(), "examples": len(predicted)}


class InterventionGradients(TrainerCallback):
    """Keeps a CPU copy of every intervention gradient just before each optimizer step.

    Not under DeepSpeed: accelerate's DeepSpeed backward already steps the engine, so no gradient is
    left to read when this event fires.
    """

    def __init__(self, model=None) -> None:
        self.model = model  # the ReFT model, when the trainer was handed a wrapper of it (DDP)
        self.steps: list[dict[str, torch.Tensor]] = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if not args.deepspeed:
            self.steps.append(intervention_grads(self.model or model))


def training_arguments(case: ParityCase, output_dir: str, world_size: int, **overrides: Any) -> TrainingArguments:
    # Under a launcher (WORLD_SIZE set) each process drives one device; without one, HF Trainer wraps
    # nn.DataParallel over every visible GPU.
    launched = "WORLD_SIZE" in os.environ
    devices = world_size if launched else max(1, torch.cuda.device_count())
    if case.batch_size % devices:
        raise ValueError(f"batch_size {case.batch_size} does not split evenly over {devices} devices")
    arguments = dict(
        output_dir=output_dir,
        per_device_train_batch_size=case.batch_size // devices,
        max_steps=case.steps,
        gradient_accumulation_steps=case.accumulation,
        learning_rate=case.lr,
        weight_decay=case.weight_decay,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=case.seed,
        train_sampling_strategy="sequential",
        use_cpu=not torch.cuda.is_available(),
        disable_tqdm=True,
    )
    arguments.update(overrides)
    return TrainingArguments(**arguments)


def train_with_trainer(
    case: ParityCase,
    output_dir: str,
    *,
    trainer_class: str = "ReftTrainer",
    eval_examples: int = 0,
    resume_from_checkpoint: str | None = None,
    **overrides: Any,
) -> Record:
    """Train ``case`` with a pyreft trainer; with ``eval_examples``, then evaluate on that many new examples.

    With ``resume_from_checkpoint`` the losses include those logged before the checkpoint (HF Trainer
    restores its log) and the gradients only the steps run after it.
    """
    pyreft = import_pyreft()
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    # Arguments first, as users write it: with a ZeRO-3 DeepSpeed config, the model is then built
    # partitioned (deepspeed.zero.Init), as from_pretrained would build it.
    arguments = training_arguments(case, output_dir, world_size, **overrides)
    model = case.build()
    gradients = InterventionGradients()
    trainer = getattr(pyreft, trainer_class)(
        model=model,
        args=arguments,
        train_dataset=examples(case),
        eval_dataset=examples(case, case.steps + 1)[-eval_examples:] if eval_examples else None,
        compute_metrics=accuracy if eval_examples else None,
        callbacks=[gradients],
    )
    trainer.train(resume_from_checkpoint=resume_from_checkpoint)
    metrics = trainer.evaluate() if eval_examples else {}
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    weights = intervention_weights(model)
    return Record(f"{trainer_class} x{world_size}", world_size, losses, gradients.steps, weights, metrics=metrics)


def train_with_accelerate(case: ParityCase, accelerator=None) -> Record:
    """Train ``case`` as accelerate's docs do: ``accelerator.prepare(model, optimizer, dataloader)``, one
    forward and backward per ``accelerator.accumulate(model)``, ``case.accumulation`` micro-batches a step.

    Without an ``accelerator``, ``Accelerator(gradient_accumulation_steps=case.accumulation)``, its other
    settings from ``accelerate launch``; one given must accumulate as many micro-batches as ``case``.
    Each process loads ``batch_size / num_processes`` examples per micro-batch; accelerate shards the loader.

    pyvene's loss is the micro-batch's mean over this process's labels, and ``accumulate`` divides it by
    the accumulation steps while DDP averages the ranks: a mean of means, not the step's mean when
    micro-batches hold different numbers of labels. As accelerate's guide to accumulating samples of
    variable size says, each micro-batch's summed loss (its mean times its labels) is divided by the labels
    of the whole step, counted on every process before the step's first forward, times the accumulation
    steps and the processes that the division and the average undo. The recorded loss is the step's mean.
    """
    accelerator = accelerator or Accelerator(gradient_accumulation_steps=case.accumulation)
    _check_accumulation(accelerator, case)
    if case.batch_size % accelerator.num_processes:
        raise ValueError(f"batch_size {case.batch_size} does not split over {accelerator.num_processes} processes")
    model = case.build()
    model.train()
    optimizer = torch.optim.AdamW(param_groups(model, case.weight_decay), lr=case.lr)
    loader = DataLoader(examples(case), batch_size=case.batch_size // accelerator.num_processes)
    wrapped, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    _check_accumulation(accelerator, case)  # a DeepSpeed config's own gradient_accumulation_steps wins in prepare
    # accelerate's DeepSpeed backward also steps the engine: no gradient is left to read after it.
    record_grads = accelerator.distributed_type != "DEEPSPEED"
    scale = case.accumulation * accelerator.num_processes
    losses, grads = [], []
    # The whole loader is read first, so that each step's labels are counted on every process before its first
    # forward. (accelerate's guide reads one step ahead; reading the last step ahead ends accumulate()'s step at
    # the loader's end, after that step's first micro-batch.)
    for micro_batches in case.steps_of(list(loader)):
        labels = accelerator.reduce(torch.tensor(case.labels_in(micro_batches), device=accelerator.device), "sum")
        step_loss = torch.zeros((), device=accelerator.device)
        for inputs in micro_batches:
            with accelerator.accumulate(wrapped):
                locations = inputs["intervention_locations"].permute(1, 0, 2).tolist()
                _, outputs = wrapped(
                    {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"]},
                    unit_locations={"sources->base": (None, locations)},
                    labels=inputs["labels"],
                )
                loss = outputs.loss * case.labels_in([inputs]) / labels
                accelerator.backward(loss * scale)
                step_loss += loss.detach()
                if record_grads and accelerator.sync_gradients:
                    grads.append(intervention_grads(model))
                optimizer.step()
                optimizer.zero_grad()
        losses.append(accelerator.reduce(step_loss, "sum").item())
    weights = intervention_weights(model)
    return Record("accelerate", accelerator.num_processes, losses, grads, weights)


def _check_accumulation(accelerator, case: ParityCase) -> None:
    if accelerator.gradient_accumulation_steps != case.accumulation:
        raise ValueError(f"the accelerator accumulates gradient_accumulation_steps="
                         f"{accelerator.gradient_accumulation_steps} micro-batches, the case accumulation="
                         f"{case.accumulation}: make it with Accelerator(gradient_accumulation_steps="
                         f"{case.accumulation})")


def fsdp_on_cpu() -> Callable[[], None]:
    """Make accelerate apply HF Trainer's FSDP plugin on CPU: ``AcceleratorState`` takes it only in a GPU world
    type, which it copies from ``PartialState`` when made. That type reads as ``MULTI_GPU`` while HF Trainer makes
    its accelerator (the device stays the CPU), and as before after. With it, HF Trainer (under torchrun or
    ``accelerate launch --config_file docs/configs/accelerate-fsdp2.yaml``) shards, mixes precision, saves and
    resumes as on GPUs: accelerate's ``fsdp2_prepare_model``, DCP checkpoints. Sets ``PYVENE_DIST_FSDP_ON_CPU``,
    which tells sharded loading that FSDP shards here (without it, FSDP flags on a CPU machine load whole, since
    accelerate would train DDP). Returns a function that undoes both (a process that trains again without FSDP)."""
    make = transformers.Trainer.create_accelerator_and_postprocess  # transformers.trainer: imported here, when used

    def create_accelerator_and_postprocess(self, *args, **kwargs):
        shared = PartialState._shared_state
        world_type, shared["distributed_type"] = shared["distributed_type"], DistributedType.MULTI_GPU
        try:
            return make(self, *args, **kwargs)
        finally:
            shared["distributed_type"] = world_type

    transformers.Trainer.create_accelerator_and_postprocess = create_accelerator_and_postprocess
    before = os.environ.get("PYVENE_DIST_FSDP_ON_CPU")
    os.environ["PYVENE_DIST_FSDP_ON_CPU"] = "1"  # fixes/sharded_loading.py: FSDP_ON_CPU

    def undo() -> None:
        transformers.Trainer.create_accelerator_and_postprocess = make
        if before is None:
            os.environ.pop("PYVENE_DIST_FSDP_ON_CPU", None)
        else:
            os.environ["PYVENE_DIST_FSDP_ON_CPU"] = before
    return undo
