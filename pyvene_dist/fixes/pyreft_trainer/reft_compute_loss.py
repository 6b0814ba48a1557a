"""pyreft's ``compute_loss`` answers HF Trainer's calls as HF Trainer makes and reads them.

transformers 4.46+ calls ``compute_loss(model, inputs, num_items_in_batch=...)``; pyreft 0.1.0's
``ReftTrainer.compute_loss`` and ``ReftTrainerForSequenceClassification.compute_loss`` take
``(intervenable, inputs, return_outputs=False)``: ``TypeError: ReftTrainer.compute_loss() got an unexpected keyword
argument 'num_items_in_batch'`` at the first step. So does a subclass written to that signature (pyreft's
``examples/reward/train.py``). The fix drops that keyword for a method with no place for it (it is passed on where
the method takes it or ``**kwargs``, as pyreft's git HEAD does; any other keyword fails as it would), for pyreft's
methods and for those of every subclass a trainer is made of while patched (wrapped then, put back by
``unpatch()``).

pyreft's loss is the micro-batch's own mean (the base model's, over its label tokens; the classifier's, over its
examples), and HF Trainer, seeing that ``IntervenableModel.forward`` takes no loss keywords, neither counted the
batch's items nor passed the count: under DDP the loss was the mean of per-rank means, with gradient accumulation
the mean of micro-batch means. Neither is the batch's mean when examples have different numbers of label tokens
(alpaca: 1.4e-2 off one process). Where the loss is pyreft's, HF Trainer now counts the label items of each step on
every rank (shifted for a causal LM, as HF counts them) and skips its division by the accumulation steps;
``compute_loss`` weighs the micro-batch's mean by its share of that count, times the ranks whose gradients are
averaged (HF's ``average_tokens_across_devices``, on by default): the whole batch's mean, as HF computes it for
models that take ``num_items_in_batch`` (pyvene's forward has no way to pass it to the base model's loss). One
process without accumulation trains as before, to rounding. A subclass's own ``compute_loss`` is HF's
per-micro-batch mean, divided by the accumulation steps and averaged over the ranks: the whole batch's mean only
when every micro-batch holds as many items (the reward loss: pairs), not for a short last batch. Under
``nn.DataParallel`` (``n_gpu > 1``) the loss stays each replica's mean.

``ReftTrainer.compute_loss(..., return_outputs=True)`` returned the outputs twice, where HF Trainer's evaluation
reads ``(loss, outputs)``: ``trainer.evaluate()`` failed with ``AttributeError: 'CausalLMOutputWithPast' object has
no attribute 'detach'``. It returns ``(loss, outputs)``.

The same call turned the collated ``intervention_locations``, already on the GPU, into lists with
``.permute(1, 0, 2).tolist()``: a device-to-host copy that stalls every step (see ``fixes.locations``).
``compute_loss`` now sees them through ``DeviceLocations``, which answers that call with the permuted tensor
itself; pyvene_dist's gather and scatter index with it on the device (``devices``). The loss code is pyreft's.

pyreft is patched when (and if) it is imported.
"""

from __future__ import annotations

import inspect

import torch
from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss

from ..._optional import pyreft_trainers
from ..._records import Fix, Site
from ..._registry import UNDO_LOG
from ...mechanisms.arguments import bound
from ...mechanisms.trainer_steps import AFTER_INIT, PYREFT, step_sites
from ...mechanisms.wrapped_models import holds_intervenable_model, unwrap_intervenable_model

#: HF Trainer's loss keyword, which pyreft's ``compute_loss`` lacked until after 0.1.0.
NUM_ITEMS = "num_items_in_batch"


def _wrap_compute_loss(wrapped, instance, args, kwargs):
    """pyreft's own ``compute_loss``: locations as tensors, the loss weighed by the whole batch's count of label
    items when HF Trainer counted them (``_share_of_the_batch``), and ``(loss, outputs)`` for ``return_outputs``."""
    call = _declared_call(wrapped, args, kwargs)
    inputs = call.arguments["inputs"]
    locations = inputs.get("intervention_locations") if isinstance(inputs, dict) else None
    if isinstance(locations, torch.Tensor) and locations.dim() == 3:
        call.arguments["inputs"] = {**inputs, "intervention_locations": DeviceLocations(locations)}
    result = wrapped(*call.args, **call.kwargs)
    return_outputs = call.arguments.get("return_outputs", False)
    loss, outputs = result if return_outputs else (result, None)
    if not isinstance(loss, torch.Tensor):  # ReftTrainer's gives (outputs, outputs); HF reads (loss, outputs)
        loss = loss.loss
    num_items_in_batch = kwargs.get(NUM_ITEMS)
    if num_items_in_batch is not None and instance.model_accepts_loss_kwargs:
        loss = loss * _share_of_the_batch(instance, inputs["labels"], num_items_in_batch)
    return (loss, outputs) if return_outputs else loss


def _wrap_subclass_compute_loss(wrapped, instance, args, kwargs):
    """A user's ``compute_loss`` in a subclass of pyreft's trainers, written to pyreft's old signature."""
    call = _declared_call(wrapped, args, kwargs)
    return wrapped(*call.args, **call.kwargs)


def _declared_call(wrapped, args, kwargs) -> inspect.BoundArguments:
    """The call bound to ``wrapped``, less ``num_items_in_batch`` where ``wrapped`` has no place for it."""
    call = bound(wrapped, args, {name: value for name, value in kwargs.items() if name != NUM_ITEMS})
    if NUM_ITEMS in kwargs and _takes(call.signature, NUM_ITEMS):
        call = bound(wrapped, args, kwargs)
    return call


def _takes(signature: inspect.Signature, keyword: str) -> bool:
    return keyword in signature.parameters or any(
        parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in signature.parameters.values())


def _share_of_the_batch(trainer, labels: torch.Tensor, num_items_in_batch) -> torch.Tensor:
    """What turns this micro-batch's mean loss into its part of the whole batch's mean: its label items over
    the batch's (all micro-batches of the step, on every rank where ``average_tokens_across_devices``),
    times the ranks whose gradients DDP, FSDP and DeepSpeed average, as ``Trainer.compute_loss`` does."""
    counted = labels[..., 1:] if trainer._loss_shifts_labels else labels
    share = counted.ne(-100).sum() / num_items_in_batch
    if trainer.args.average_tokens_across_devices:
        share = share * (trainer.accelerator.num_processes // trainer.get_tp_size())
    return share


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


def _count_the_batch_for_pyrefts_loss(trainer) -> None:
    """Once ``Trainer.__init__`` has run: old signatures of the trainer's own classes wrapped, and where the loss
    is pyreft's, HF Trainer told to count the label items of each step (on every rank), pass the count to
    ``compute_loss`` and no longer divide the loss by the accumulation steps: the loss is the whole batch's mean,
    as HF computes it for models that take loss keywords."""
    _adopt_old_signatures(type(trainer))
    if holds_intervenable_model(trainer.model) and _runs_pyrefts_loss(type(trainer)) and trainer.args.n_gpu <= 1:
        trainer.model_accepts_loss_kwargs = True
        trainer._loss_shifts_labels = _runs_causal_lm_loss(type(trainer), trainer.model)


def _adopt_old_signatures(trainer_class) -> None:
    """Wrap each ``compute_loss`` that a subclass of pyreft's trainers defines without a place for
    ``num_items_in_batch`` (pyreft's own signature until 0.1.0, which its examples copy), so that HF
    Trainer's keyword is dropped for it too; ``unpatch()`` puts them back."""
    ReftTrainer = pyreft_trainers.ReftTrainer
    for owner in trainer_class.__mro__:
        if owner.__module__ == ReftTrainer.__module__ or not issubclass(owner, ReftTrainer):
            continue
        function = vars(owner).get("compute_loss")
        if inspect.isfunction(function) and not _takes(inspect.signature(function), NUM_ITEMS):
            UNDO_LOG.wrap(owner, "compute_loss", _wrap_subclass_compute_loss)


def _runs_pyrefts_loss(trainer_class) -> bool:
    """Whether ``compute_loss`` is pyreft's own for this class (not a subclass's override)."""
    return _defining_class(trainer_class, "compute_loss") in (pyreft_trainers.ReftTrainer,
                                                              pyreft_trainers.ReftTrainerForSequenceClassification)


def _runs_causal_lm_loss(trainer_class, model) -> bool:
    """Whether the loss is a causal LM's, whose labels are shifted: ``ReftTrainer.compute_loss`` returns the
    base model's loss, and HF Trainer's rule (``Trainer.__init__``) says which, asked of that model."""
    base = unwrap_intervenable_model(model).model
    return (_defining_class(trainer_class, "compute_loss") is pyreft_trainers.ReftTrainer
            and LOSS_MAPPING.get(getattr(base, "loss_type", None)) is ForCausalLMLoss
            and not getattr(base.config, "is_encoder_decoder", False))


def _defining_class(cls, attribute: str):
    return next(owner for owner in cls.__mro__ if attribute in vars(owner))


FIX = Fix(
    __name__,
    sites=(
        Site(f"{PYREFT}:ReftTrainer.compute_loss", _wrap_compute_loss),
        Site(f"{PYREFT}:ReftTrainerForSequenceClassification.compute_loss", _wrap_compute_loss),
        *step_sites(AFTER_INIT, __name__, _count_the_batch_for_pyrefts_loss),
    ),
    # pyreft's locations are passed on as tensors, which that fix indexes with
    requires=("devices",),
    upstream=("pyreft",),
    relies_on=("transformers.trainer:Trainer.compute_loss",),  # the loss share is its
)
