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
        _give_the_timeout_to_a_cpu_group(arguments)
    if arguments.ddp_find_unused_parameters is not None or not reft:
        return wrapped(*args, **kwargs)
    arguments.ddp_find_unused_parameters = False  # read only while the accelerator is built
    try:
        return wrapped(*args, **kwargs)
    finally:
        arguments.ddp_find_unused_parameters = None


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
