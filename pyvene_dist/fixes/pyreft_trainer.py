"""pyreft's trainers work with HF Trainer as it is today, under torchrun too.

1. transformers 4.46+ calls ``compute_loss(model, inputs, num_items_in_batch=...)``; pyreft 0.1.0's
   ``ReftTrainer.compute_loss`` and ``ReftTrainerForSequenceClassification.compute_loss`` take
   ``(intervenable, inputs, return_outputs=False)``: ``TypeError: ReftTrainer.compute_loss() got an
   unexpected keyword argument 'num_items_in_batch'`` at the first step. So does a subclass written to that
   signature (pyreft's ``examples/reward/train.py``). The fix passes on only the keywords a method declares
   (all of them where it takes ``**kwargs``, as pyreft's git HEAD does), for pyreft's methods and for those
   of every subclass made into a trainer while patched (wrapped then, put back by ``unpatch()``).
   pyreft's loss is the micro-batch's own mean (the base model's, over its label tokens; the classifier's,
   over its examples), and HF Trainer, seeing that ``IntervenableModel.forward`` takes no loss keywords,
   neither counted the batch's items nor passed the count: under DDP the loss was the mean of per-rank
   means, with gradient accumulation the mean of micro-batch means. Neither is the batch's mean when
   examples have different numbers of label tokens (alpaca: 1.4e-2 off one process). Where the loss is
   pyreft's, HF Trainer now counts the label items of each step on every rank (shifted for a causal LM, as
   HF counts them) and skips its division by the accumulation steps; ``compute_loss`` weighs the
   micro-batch's mean by its share of that count, times the ranks whose gradients are averaged (HF's
   ``average_tokens_across_devices``, on by default): the whole batch's mean, as HF computes it for models
   that take ``num_items_in_batch`` (pyvene's forward has no way to pass it to the base model's loss). One
   process without accumulation trains as before, to rounding. A subclass's own ``compute_loss`` is HF's
   per-micro-batch mean, divided by the accumulation steps and averaged over the ranks: the whole batch's
   mean only when every micro-batch holds as many items (the reward loss: pairs), not for a short last
   batch. Under ``nn.DataParallel`` (``n_gpu > 1``) the loss stays each replica's mean.
   ``ReftTrainer.compute_loss(..., return_outputs=True)`` returned the outputs twice, where HF Trainer's
   evaluation reads ``(loss, outputs)``: ``trainer.evaluate()`` failed with ``AttributeError:
   'CausalLMOutputWithPast' object has no attribute 'detach'``. It returns ``(loss, outputs)``.
2. ``ReftTrainerForCausalLM.get_train_dataloader`` (the README's default) returns a plain shuffled
   ``DataLoader``: under torchrun every rank silently trains on the whole dataset, and
   ``train_sampling_strategy``, ``dataloader_drop_last`` and the data seed are ignored.
   ``ReftTrainerForCausalLMDistributed``'s ``DistributedSampler`` never sets its epoch (the same order
   every epoch) and ignores them too. The fix is HF Trainer's own ``get_train_dataloader``.
3. ``ReftTrainerForSequenceClassification.evaluate(self, ignore_keys)`` requires ``ignore_keys``
   (``trainer.evaluate()`` raises ``TypeError``), calls ``v[0].eval()`` on interventions that pyvene
   0.1.8 no longer keeps in tuples (``TypeError: 'LoreftIntervention' object is not subscriptable``),
   and has every rank evaluate the whole set. The fix evaluates with HF Trainer's sharded eval loader,
   gathers predictions with ``accelerator.gather_for_metrics`` (dropping the samples a shard repeats),
   and accepts ``eval_dataset``, ``ignore_keys`` and ``metric_key_prefix`` like ``Trainer.evaluate``.
4. ``compute_loss`` turns the collated ``intervention_locations``, already on the GPU, into lists with
   ``.permute(1, 0, 2).tolist()``: a device-to-host copy that stalls every step (see ``fixes.locations``).
   ``compute_loss`` now sees them through ``DeviceLocations``, which answers that call with the permuted
   tensor itself; pyvene_dist's gather and scatter index with it on the device. The loss code is pyreft's.
5. pyreft's README and examples pass ``tokenizer=`` to its trainers; transformers 5 renamed that keyword
   ``processing_class`` (4.46 to 4.x took both) and fails with ``TypeError: Trainer.__init__() got an
   unexpected keyword argument 'tokenizer'``. pyreft's trainers (``ReftTrainer`` and its subclasses, not
   HF Trainer for anyone else) take ``tokenizer=`` as ``processing_class`` where ``Trainer`` lacks it.
6. pyreft's ``examples/alpaca/train_multigpu.py`` wraps the ReFT model in DDP itself and hands the wrapper
   to ``ReftTrainerForCausalLM``. With ``--gradient_checkpointing``, ``Trainer.train`` enables it on the
   model it holds, the wrapper: ``AttributeError: 'DistributedDataParallel' object has no attribute
   'gradient_checkpointing_enable'``. pyreft's trainers (``ReftTrainer.train``, added) enable it on the
   pyvene model inside a wrapper that has no enabler of its own, with the arguments' checkpointing
   keywords, and switch the arguments' flag off while ``Trainer.train`` runs (then back on), so that HF
   does not ask the wrapper. Both names of the flag are switched (``activation_checkpointing``, which
   transformers 5.24 reads, and its alias ``gradient_checkpointing``); checked on 5.24 only.
7. Under ZeRO-3, ``from_pretrained`` partitions the model in the precision of the DeepSpeed config of the
   ``TrainingArguments`` alive when it runs: float32 if that config has no ``"bf16"`` section, or if those
   arguments are an earlier run's (a notebook, two runs in one script, loading before making the
   arguments). DeepSpeed casts nothing already partitioned and silently mixes the precisions: a bf16 run
   trained its first step in float32, and resuming it from its own checkpoint ended 3.4e-5 off. pyreft's
   trainers refuse it at ``train``, naming both dtypes and what avoids it.
8. pyreft's ``examples/alpaca/train_multigpu.py`` sets ``logging_steps = 1`` on rank 0 only. HF Trainer
   gathers across ranks when it logs (the loss, the FLOs) and saves (the FLOs; pyreft's ``save_model`` then
   agrees whether to save, as it may gather), so rank 0's collectives met other ones on rank 1: the run hung
   at the first checkpoint, or went on with another collective's data (the issue saw ``RuntimeError:
   Parent directory .../checkpoint-2 does not exist`` in 2 of 3 runs). pyreft's trainers compare the
   arguments that schedule those collectives across ranks at ``train`` and raise on every rank, naming each
   argument and each rank's value. The ranks' numbers of training examples are compared with them: ranks that
   read different data files ran different numbers of steps, and failed at the end with gloo's ``Received data
   size doesn't match expected size``.
9. A script that starts its ranks itself (``mp.spawn``, as an early version of that example did) and joins
   the process group with ``init_process_group(rank=..., world_size=...)`` leaves ``RANK``, ``LOCAL_RANK`` and
   ``WORLD_SIZE`` unset. HF's ``TrainingArguments`` read those (through accelerate), so every rank took itself
   for the only process: each saved every checkpoint into the same folder (``RuntimeError: Parent directory
   OUT/checkpoint-2 does not exist`` in 3 of 4 runs) and trained on the whole data set. pyreft's trainers
   take the ranks from the process group where the variables are missing (the local rank from the ranks'
   host names), set them, and have the arguments find their devices again, with one warning.

pyreft is patched when (and if) it is imported.
Checked on pyreft 0.1.0 with transformers 5.17 and 5.24.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os

import torch

from .._records import Fix, Site
from ..mechanisms.wrapped_models import holds_intervenable_model, unwrap_intervenable_model

PYREFT = "pyreft.reft_trainer"
FIX = Fix(
    __name__,
    sites=(
        Site(f"{PYREFT}:ReftTrainer.compute_loss", "_wrap_compute_loss"),
        Site(f"{PYREFT}:ReftTrainerForSequenceClassification.compute_loss", "_wrap_compute_loss"),
        Site(f"{PYREFT}:ReftTrainerForCausalLM.get_train_dataloader", "_wrap_trainers_train_dataloader",
             kind="replace"),
        Site(f"{PYREFT}:ReftTrainerForCausalLMDistributed.get_train_dataloader", "_wrap_trainers_train_dataloader",
             kind="replace"),
        Site(f"{PYREFT}:ReftTrainerForSequenceClassification.evaluate", "_wrap_evaluate", kind="replace"),
        Site(f"{PYREFT}:ReftTrainer.__init__", "_reft_trainer_init", kind="add"),
        Site(f"{PYREFT}:ReftTrainer.train", "_reft_trainer_train", kind="add"),
    ),
    # devices: pyreft's locations are passed on as tensors, which that fix indexes with;
    # wrapper_attributes: the checkpointing enablers of the pyvene model inside a wrapper.
    requires=("devices", "wrapper_attributes"),
    upstream=("pyreft",),
    # the checkpointing enablers, the loss share, and the evaluate it replaces
    relies_on=(
        "transformers.trainer:Trainer.train",
        "transformers.trainer:Trainer.compute_loss",
        "transformers.trainer:Trainer.evaluate",
    ),
)
#: ``Trainer.train`` calls the first of these the model has (transformers 5.2x; before, only the second).
CHECKPOINTING_ENABLERS = ("activation_checkpointing_enable", "gradient_checkpointing_enable")
#: The ``TrainingArguments`` flag that makes ``Trainer.train`` call it, and its deprecated alias (kept equal).
CHECKPOINTING_FLAGS = ("activation_checkpointing", "gradient_checkpointing")


def _wrap_compute_loss(wrapped, instance, args, kwargs):
    """pyreft's own ``compute_loss``: declared keywords only, locations as tensors, and the loss weighed by
    the whole batch's count of label items when HF Trainer counted them (``_share_of_the_batch``), and
    ``(loss, outputs)`` for ``return_outputs``, as HF Trainer reads it."""
    num_items_in_batch = kwargs.get("num_items_in_batch")
    bound = _declared(wrapped, args, kwargs)
    inputs = bound.arguments.get("inputs")
    locations = inputs.get("intervention_locations") if isinstance(inputs, dict) else None
    if isinstance(locations, torch.Tensor) and locations.dim() == 3:
        bound.arguments["inputs"] = {**inputs, "intervention_locations": DeviceLocations(locations)}
    result = wrapped(*bound.args, **bound.kwargs)
    return_outputs = bound.arguments.get("return_outputs", False)
    loss, outputs = result if return_outputs else (result, None)
    if not isinstance(loss, torch.Tensor):  # ReftTrainer's gives (outputs, outputs); HF reads (loss, outputs)
        loss = loss.loss
    if num_items_in_batch is not None and instance.model_accepts_loss_kwargs:
        loss = loss * _share_of_the_batch(instance, inputs["labels"], num_items_in_batch)
    return (loss, outputs) if return_outputs else loss


def _wrap_subclass_compute_loss(wrapped, instance, args, kwargs):
    """A user's ``compute_loss`` in a subclass of pyreft's trainers, written to pyreft's old signature."""
    bound = _declared(wrapped, args, kwargs)
    return wrapped(*bound.args, **bound.kwargs)


def _declared(wrapped, args, kwargs) -> inspect.BoundArguments:
    """``args`` and ``kwargs`` bound to ``wrapped``, less the keywords it does not declare (all of them kept
    where it takes ``**kwargs``)."""
    function = getattr(wrapped, "__func__", None)  # a bound method, as a trainer calls it
    signature = _bound_signature(function) if function is not None else inspect.signature(wrapped)
    if not _takes_any_keyword(signature):
        kwargs = {name: value for name, value in kwargs.items() if name in signature.parameters}
    return signature.bind(*args, **kwargs)


def _takes_any_keyword(signature: inspect.Signature) -> bool:
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values())


def _share_of_the_batch(trainer, labels: torch.Tensor, num_items_in_batch) -> torch.Tensor:
    """What turns this micro-batch's mean loss into its part of the whole batch's mean: its label items over
    the batch's (all micro-batches of the step, on every rank where ``average_tokens_across_devices``),
    times the ranks whose gradients DDP, FSDP and DeepSpeed average, as ``Trainer.compute_loss`` does."""
    counted = labels[..., 1:] if trainer._loss_shifts_labels else labels
    share = counted.ne(-100).sum() / num_items_in_batch
    if trainer.args.average_tokens_across_devices:
        share = share * (trainer.accelerator.num_processes // trainer.get_tp_size())
    return share


@functools.lru_cache(maxsize=32)
def _bound_signature(function) -> inspect.Signature:
    """The signature of ``function`` called as a bound method (``self`` left out), read once: every
    training step asks for it. Bounded: the functions asked about are pyreft's two ``compute_loss`` and those
    of the user's subclasses, a handful, and an unbounded cache kept every one alive with its module (trainer
    classes made per run, in a notebook or a sweep); a weak map would be process-wide state of its own."""
    signature = inspect.signature(function)
    return signature.replace(parameters=list(signature.parameters.values())[1:])


class DeviceLocations:
    """What pyreft's ``compute_loss`` reads of the collated locations, answered with tensors:
    ``.dim()``, and ``.permute(...).tolist()`` returning the permuted tensor instead of lists."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def dim(self) -> int:
        return self.tensor.dim()

    def permute(self, *dims) -> "_Listed":
        return _Listed(self.tensor.permute(*dims))


class _Listed:
    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def tolist(self) -> torch.Tensor:
        return self.tensor


def _reft_trainer_init(self, *args, **kwargs):
    """``Trainer.__init__``, taking pyreft's ``tokenizer=`` as ``processing_class`` where Trainer has no
    ``tokenizer``; then the loss normalised over the whole batch where the loss is pyreft's."""
    from pyreft.reft_trainer import ReftTrainer

    if "tokenizer" in kwargs and not _trainer_takes_tokenizer():
        if kwargs.get("processing_class") is not None:
            raise TypeError(f"{type(self).__name__}: pass tokenizer= or processing_class=, not both")
        kwargs["processing_class"] = kwargs.pop("tokenizer")
    _take_ranks_from_the_process_group(kwargs["args"] if "args" in kwargs else args[1] if len(args) > 1 else None)
    _adopt_old_signatures(type(self))
    super(ReftTrainer, self).__init__(*args, **kwargs)
    if holds_intervenable_model(self.model) and _runs_pyrefts_loss(type(self)) and self.args.n_gpu <= 1:
        # HF Trainer now counts the label items of each step (on every rank), passes the count to
        # compute_loss, and no longer divides the loss by the accumulation steps: the loss is the whole
        # batch's mean, as HF computes it for models that take loss keywords.
        self.model_accepts_loss_kwargs = True
        self._loss_shifts_labels = _runs_causal_lm_loss(type(self), self.model)


#: What torchrun sets in each rank's environment, and HF's TrainingArguments (through accelerate) read.
RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")


def _take_ranks_from_the_process_group(arguments) -> None:
    """Where a process group of several ranks exists but ``RANK``/``LOCAL_RANK``/``WORLD_SIZE`` are unset (ranks
    started with ``mp.spawn``), set them from the group and have ``arguments`` find their devices again: HF's
    arguments read the variables, and without them every rank is process 0 of 1. A collective (the ranks'
    host names, for the local rank), on every rank: each makes its trainer."""
    import socket

    import torch.distributed as dist

    if arguments is None or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1 \
            or all(name in os.environ for name in RANK_VARIABLES[:3]):
        return
    hosts = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, socket.gethostname())
    rank = dist.get_rank()
    found = {"RANK": rank, "LOCAL_RANK": hosts[:rank].count(hosts[rank]), "WORLD_SIZE": len(hosts),
             "LOCAL_WORLD_SIZE": hosts.count(hosts[rank])}
    missing = [name for name in RANK_VARIABLES if name not in os.environ]
    for name in missing:
        os.environ[name] = str(found[name])
    # a cached_property, found as one process: found again now, before Trainer.__init__ builds its Accelerator
    # (finding them resets accelerate's state, the Accelerator's included)
    arguments.__dict__.pop("_setup_devices", None)
    if arguments.device is not None and arguments.world_size != len(hosts):  # a release that caches it elsewhere
        raise RuntimeError(
            f"rank {rank}: the process group has {len(hosts)} ranks but these TrainingArguments see "
            f"{arguments.world_size} process(es): {'/'.join(missing)} were not set when they were made (ranks "
            "started with mp.spawn?), and every rank would act as the main process. Set RANK, LOCAL_RANK and "
            "WORLD_SIZE in each rank's environment before making the TrainingArguments, or start the ranks with "
            "torchrun")
    logging.getLogger("pyvene_dist").warning(
        "rank %d: the process group has %d ranks but %s %s not set (ranks started with mp.spawn?); HF Trainer read "
        "this process as the only one, so every rank saved as the main process. Set them from the group: %s",
        rank, len(hosts), "/".join(missing), "was" if len(missing) == 1 else "were",
        ", ".join(f"{name}={found[name]}" for name in missing))


def _runs_pyrefts_loss(trainer_class) -> bool:
    """Whether ``compute_loss`` is pyreft's own for this class (not a subclass's override)."""
    from pyreft.reft_trainer import ReftTrainer, ReftTrainerForSequenceClassification

    return _defining_class(trainer_class, "compute_loss") in (ReftTrainer, ReftTrainerForSequenceClassification)


def _runs_causal_lm_loss(trainer_class, model) -> bool:
    """Whether the loss is a causal LM's, whose labels are shifted: ``ReftTrainer.compute_loss`` returns the
    base model's loss, and HF Trainer's rule (``Trainer.__init__``) says which, asked of that model."""
    from pyreft.reft_trainer import ReftTrainer
    from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss

    base = unwrap_intervenable_model(model).model
    return (_defining_class(trainer_class, "compute_loss") is ReftTrainer
            and LOSS_MAPPING.get(getattr(base, "loss_type", None)) is ForCausalLMLoss
            and not getattr(base.config, "is_encoder_decoder", False))


def _adopt_old_signatures(trainer_class) -> None:
    """Wrap each ``compute_loss`` that a subclass of pyreft's trainers defines without a place for
    ``num_items_in_batch`` (pyreft's own signature until 0.1.0, which its examples copy), so that HF
    Trainer's keyword is dropped for it too; ``unpatch()`` puts them back."""
    from pyreft.reft_trainer import ReftTrainer

    from .._registry import UNDO_LOG

    for owner in trainer_class.__mro__:
        if owner.__module__ == ReftTrainer.__module__ or not issubclass(owner, ReftTrainer):
            continue
        function = vars(owner).get("compute_loss")
        if inspect.isfunction(function) and not _takes_any_keyword(inspect.signature(function)) \
                and "num_items_in_batch" not in inspect.signature(function).parameters:
            UNDO_LOG.wrap(owner, "compute_loss", _wrap_subclass_compute_loss)


def _defining_class(cls, attribute: str):
    return next(owner for owner in cls.__mro__ if attribute in vars(owner))


def _reft_trainer_train(self, *args, **kwargs):
    """``Trainer.train``, with gradient checkpointing enabled on the pyvene model inside a wrapper handed to
    the trainer (pyreft's multi-GPU example hands it a DDP wrapper), which HF would ask instead."""
    from pyreft.reft_trainer import ReftTrainer

    train = super(ReftTrainer, self).train
    _refuse_a_partition_in_another_dtype(self)
    _refuse_schedules_that_differ_between_ranks(self)
    flags = [name for name in CHECKPOINTING_FLAGS if getattr(self.args, name, None)]
    if not flags or any(hasattr(self.model, name) for name in CHECKPOINTING_ENABLERS) \
            or not holds_intervenable_model(self.model):
        return train(*args, **kwargs)
    _enable_checkpointing(unwrap_intervenable_model(self.model), self.args)
    for name in flags:
        setattr(self.args, name, False)
    try:
        return train(*args, **kwargs)
    finally:
        for name in flags:
            setattr(self.args, name, True)


#: The ``TrainingArguments`` that decide at which steps HF Trainer runs a collective: logging gathers the loss
#: and the FLOs, saving the FLOs (and ``save_model`` may gather), evaluating gathers predictions, each step may
#: gather the label count; the step count and accumulation decide how many of each there are.
SCHEDULE_ARGUMENTS = (
    "logging_strategy", "logging_steps", "logging_first_step", "save_strategy", "save_steps", "eval_strategy",
    "eval_steps", "max_steps", "num_train_epochs", "gradient_accumulation_steps", "average_tokens_across_devices",
)


def _refuse_schedules_that_differ_between_ranks(trainer) -> None:
    """Raise on every rank if the ranks' arguments schedule HF Trainer's collectives differently.

    pyreft's ``examples/alpaca/train_multigpu.py`` sets ``logging_steps = 1`` on rank 0 only: rank 0 then
    gathers the loss and the FLOs at every step, rank 1 does not, and each collective meets another one on
    the other rank. The run hung at the first checkpoint (rank 0 gathering FLOs for its log, rank 1
    agreeing whether to save), or went on with another collective's data.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    schedule = {name: getattr(getattr(trainer.args, name, None), "value", getattr(trainer.args, name, None))
                for name in SCHEDULE_ARGUMENTS}  # an enum's value: "steps", not IntervalStrategy.STEPS
    schedule[EXAMPLES] = _length(trainer.train_dataset)
    schedules = [None] * dist.get_world_size()
    dist.all_gather_object(schedules, schedule)
    if any(other[EXAMPLES] != schedule[EXAMPLES] for other in schedules):
        counts = ", ".join(f"{other[EXAMPLES]} on rank {rank}" for rank, other in enumerate(schedules))
        raise ValueError(
            f"{type(trainer).__name__}.train: the ranks' training data differ: {EXAMPLES} is {counts}. Each rank "
            "trains on its share of one data set, and ranks with different data run different numbers of steps "
            "(the run ends in a collective of another size). Give every rank the same data (the same file, read "
            "the same way).")
    differing = [name for name in SCHEDULE_ARGUMENTS if any(other[name] != schedule[name] for other in schedules)]
    if differing:
        values = "; ".join(f"{name} is " + ", ".join(f"{other[name]!r} on rank {rank}"
                                                     for rank, other in enumerate(schedules))
                           for name in differing)
        raise ValueError(
            f"{type(trainer).__name__}.train: the ranks' TrainingArguments differ: {values}. HF Trainer gathers "
            "across ranks when it logs, saves and evaluates, so ranks on different schedules wait on each other's "
            "collectives (a hang, or another collective's data). Give every rank the same values (pyreft's "
            "examples/alpaca/train_multigpu.py sets logging_steps=1 on rank 0 only: pass --logging_steps 1).")


EXAMPLES = "len(train_dataset)"


def _length(dataset) -> int | None:
    try:
        return len(dataset)
    except TypeError:  # an IterableDataset, or none
        return None


def _refuse_a_partition_in_another_dtype(trainer) -> None:
    """Raise if ZeRO-3 partitioned the model (``zero.Init``) in another floating dtype than the arguments train in.

    ``from_pretrained`` runs ``zero.Init`` in the precision of the DeepSpeed config of the ``TrainingArguments``
    alive at the time, as those arguments filled it in: float32 when the config has no ``"bf16"`` section
    (accelerate adds one later, when the trainer is made), or when the arguments are an earlier run's.
    DeepSpeed casts nothing it finds partitioned, so the run mixes the two precisions (its first step is
    the float32 run's) and resuming it from its own checkpoint does not give the same result. Parameters a
    model keeps in float32 under bf16 (``_keep_in_fp32_modules``) do not trip the check: it asks only that
    some partitioned parameter has the arguments' dtype.
    """
    arguments = trainer.args
    if not getattr(arguments, "deepspeed", None) or not holds_intervenable_model(trainer.model):
        return
    found = {p.ds_tensor.dtype for p in unwrap_intervenable_model(trainer.model).parameters()
             if getattr(p, "ds_tensor", None) is not None and p.ds_tensor.is_floating_point()}
    expected = torch.bfloat16 if arguments.bf16 else torch.float16 if arguments.fp16 else torch.float32
    if found and expected not in found:
        flag = "bf16=True" if arguments.bf16 else "fp16=True" if arguments.fp16 else "neither bf16 nor fp16"
        section = "bf16" if arguments.bf16 else "fp16" if arguments.fp16 else "bf16 and fp16"
        raise ValueError(
            f"{type(trainer).__name__}.train: DeepSpeed ZeRO-3 partitioned the model in "
            f"{', '.join(sorted(map(str, found)))} when it was loaded, but its TrainingArguments ({flag}) train in "
            f"{expected}; DeepSpeed casts nothing already partitioned and would mix the two. from_pretrained "
            "partitions in the precision of the DeepSpeed config of the TrainingArguments alive at the time: give "
            f"the config a \"{section}\" section ({{\"enabled\": \"auto\"}}), make the TrainingArguments before "
            "loading the model (HF's order under ZeRO-3), and let no earlier run's arguments be alive then "
            "(del its trainer and arguments, gc.collect()).")


def _enable_checkpointing(model, arguments) -> None:
    """What ``Trainer.train`` does with the checkpointing arguments, done to ``model``: keywords for
    ``torch.utils.checkpoint``, and ``every_n_layers`` and ``offload`` for the enabler itself."""
    options = dict(getattr(arguments, "activation_checkpointing_kwargs", None)
                   or getattr(arguments, "gradient_checkpointing_kwargs", None) or {})
    layout = {key: options.pop(key) for key in ("every_n_layers", "offload") if key in options}
    newer, older = CHECKPOINTING_ENABLERS
    enable = getattr(model, newer) if hasattr(model, newer) else getattr(model, older)  # as Trainer.train chooses
    enable(options or None, **layout)


def _trainer_takes_tokenizer() -> bool:
    from transformers import Trainer

    return "tokenizer" in inspect.signature(Trainer.__init__).parameters


def _wrap_trainers_train_dataloader(wrapped, instance, args, kwargs):
    from transformers import Trainer

    return Trainer.get_train_dataloader(instance, *args, **kwargs)


def _wrap_evaluate(wrapped, instance, args, kwargs):
    return _evaluate_sequence_classification(instance, *args, **kwargs)


def _evaluate_sequence_classification(trainer, eval_dataset=None, ignore_keys=None, metric_key_prefix="eval"):
    """pyreft's evaluation (intervened logits, ``compute_metrics`` on float32 CPU tensors), sharded."""
    import torch
    from transformers.trainer_utils import EvalPrediction, denumpify_detensorize

    trainer._memory_tracker.start()
    dataloader = trainer.get_eval_dataloader(eval_dataset)
    model = trainer.model_wrapped
    model.eval()
    predictions, labels = [], []
    with torch.no_grad():
        for inputs in dataloader:
            inputs = trainer._prepare_inputs(inputs)
            locations = inputs["intervention_locations"].permute(1, 0, 2)  # a tensor: see fixes.locations
            _, outputs = model(
                {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"]},
                unit_locations={"sources->base": (None, locations)},
            )
            predictions.append(trainer.accelerator.gather_for_metrics(outputs.logits))
            labels.append(trainer.accelerator.gather_for_metrics(inputs["labels"]))
    metrics = trainer.compute_metrics(EvalPrediction(
        predictions=torch.cat(predictions).cpu().to(torch.float32),
        label_ids=torch.cat(labels).cpu().to(torch.float32),
    ))
    metrics = denumpify_detensorize(metrics)
    for key in list(metrics):
        if not key.startswith(f"{metric_key_prefix}_"):
            metrics[f"{metric_key_prefix}_{key}"] = metrics.pop(key)
    trainer.log(metrics)
    trainer.control = trainer.callback_handler.on_evaluate(trainer.args, trainer.state, trainer.control, metrics)
    trainer._memory_tracker.stop_and_update_metrics(metrics)
    return metrics
