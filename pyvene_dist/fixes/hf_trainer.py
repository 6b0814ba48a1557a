"""HF Trainer keeps pyreft's columns and skips DDP's unused-parameter search for pyvene models.

1. With ``remove_unused_columns=True`` (the default) HF Trainer keeps only the columns named in
   ``model.forward``'s signature; ``IntervenableModel.forward(base, sources, unit_locations, ...)``
   names none of pyreft's, so ``compute_loss`` fails with ``KeyError: 'input_ids'``. The fix adds the
   columns pyreft's trainers read to the kept ones, for models that hold a pyvene ``IntervenableModel``.
2. HF Trainer sets DDP's ``find_unused_parameters=True`` unless told otherwise, which costs a graph
   traversal every step. Every parameter of a ReFT model that trains is used in every forward, so for
   pyvene models it defaults to ``False`` (``ddp_find_unused_parameters`` still overrides).

3. On CPU (``use_cpu``) HF's ``TrainingArguments`` make the gloo process group without ``ddp_timeout`` (they pass
   it on GPUs only), so a rank that stops leaves the others waiting gloo's default 30 minutes, whatever
   ``--ddp_timeout`` says. Where the arguments set another ``ddp_timeout`` than the default, it is given to the
   process group when the trainer is made (``torch.distributed``'s ``_set_pg_timeout``): the collective that
   waits raises after it, naming the operation that timed out.
4. Launched as several processes (``torchrun``, ``deepspeed``) on a machine with no GPU, without ``use_cpu``,
   HF's ``TrainingArguments`` join the launcher's gloo process group and then take each process for the only one
   (accelerate reads the CPU as a world only with ``use_cpu``): every rank trained alone on all the data and wrote
   the same files (``trainer_state.json`` corrupt), with exit 0. Where the process group has several ranks but the
   arguments see one process on the CPU, they find their devices again as ``use_cpu=True`` does (the one device
   there is the CPU), before the accelerator is built, with one warning on rank 0: the ranks train as one world,
   as the same command does on GPUs. Arguments that still see one process are refused, naming ``--use_cpu``.

All act on ``transformers.Trainer`` (pyreft's trainers and a plain Trainer alike) and only for models
holding a pyvene model. pyreft's ``hf_trainer.diff`` does the same in ``ReftTrainer``, so with it upstream a
plain Trainer needs pyvene_dist for these (docs/upstreaming.md). Split from the ``trainer`` fix, whose other
items are ``pyreft_trainer``'s. ``transformers.trainer`` is patched when (and if) it is imported.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging

import torch.distributed as dist
from torch.distributed import distributed_c10d

from .._records import Fix, Site
from ..mechanisms.wrapped_models import holds_intervenable_model

TRANSFORMERS = "transformers.trainer"
#: The batch keys pyreft's trainers read in ``compute_loss``.
PYREFT_COLUMNS = ("input_ids", "attention_mask", "labels", "intervention_locations", "subspaces")


def _wrap_set_signature_columns(wrapped, instance, args, kwargs):
    wrapped(*args, **kwargs)
    if holds_intervenable_model(instance.model):
        missing = [column for column in PYREFT_COLUMNS if column not in instance._signature_columns]
        instance._signature_columns += missing


def _wrap_create_accelerator(wrapped, instance, args, kwargs):
    arguments, reft = instance.args, holds_intervenable_model(instance.model)
    if reft:
        _set_up_the_cpu_group(arguments)
    if arguments.ddp_find_unused_parameters is not None or not reft:
        return wrapped(*args, **kwargs)
    arguments.ddp_find_unused_parameters = False  # read only while the accelerator is built
    try:
        return wrapped(*args, **kwargs)
    finally:
        arguments.ddp_find_unused_parameters = None


def _set_up_the_cpu_group(arguments) -> None:
    _join_the_launched_world(arguments)
    _give_the_timeout_to_a_cpu_group(arguments)


def _join_the_launched_world(arguments) -> None:
    """Where the launcher's process group has several ranks but ``arguments``, made without ``use_cpu`` on a machine
    with no GPU, see one process on the CPU: ``use_cpu=True``, and the devices found again (a cached_property)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1 \
            or arguments.world_size != 1 or arguments.device.type != "cpu":
        return
    launched, rank = dist.get_world_size(), dist.get_rank()
    arguments.use_cpu = True
    arguments.__dict__.pop("_setup_devices", None)  # a cached_property: found again by .device
    if arguments.device.type != "cpu" or arguments.world_size != launched:  # a release that finds them elsewhere
        raise RuntimeError(
            f"rank {rank}: {launched} processes were launched on a machine with no GPU, but these TrainingArguments "
            f"see {arguments.world_size} process(es) even with use_cpu=True: every rank would train alone on all the "
            "data and write the same files. Pass --use_cpu (TrainingArguments(use_cpu=True)) when making them")
    if rank == 0:
        logging.getLogger("pyvene_dist").warning(
            "%d processes were launched on a machine with no GPU, and TrainingArguments made without use_cpu took "
            "each for the only one (HF Trainer would train each alone on all the data); training them as one world "
            "over gloo, as use_cpu=True does. Pass --use_cpu to have the arguments see the %d processes from the "
            "start", launched, launched)


def _give_the_timeout_to_a_cpu_group(arguments) -> None:
    """``ddp_timeout``, where the arguments set one, for the process group HF made on CPU without it."""
    default = next(field.default for field in dataclasses.fields(type(arguments)) if field.name == "ddp_timeout")
    if not getattr(arguments, "use_cpu", False) or arguments.ddp_timeout == default \
            or not (dist.is_available() and dist.is_initialized()):
        return
    set_timeout = getattr(distributed_c10d, "_set_pg_timeout", None)
    if set_timeout is None:
        logging.getLogger("pyvene_dist").warning(
            "ddp_timeout=%s does not reach the CPU process group (this torch has no _set_pg_timeout): a stopped rank "
            "leaves the others waiting gloo's own timeout", arguments.ddp_timeout)
        return
    set_timeout(datetime.timedelta(seconds=arguments.ddp_timeout))


FIX = Fix(
    __name__,
    sites=(
        Site(f"{TRANSFORMERS}:Trainer._set_signature_columns_if_needed", _wrap_set_signature_columns),
        Site(f"{TRANSFORMERS}:Trainer.create_accelerator_and_postprocess", _wrap_create_accelerator),
    ),
    upstream=("pyreft",),
)
