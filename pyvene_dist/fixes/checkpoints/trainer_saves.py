"""``ReftTrainer`` saves on every rank, and saves and loads the pyvene model inside whatever wraps it.

- ``ReftTrainer.save_model`` saves on rank 0 only, which is right for whole weights and deadlocks for partitioned
  ones (ZeRO-3). Every rank now calls ``save_intervention``, which gathers what is partitioned and writes on rank 0
  (``intervention_files``). ``ReftTrainerForCausalLMDistributed`` overrides ``save_model`` to call it on rank 0
  alone, which then waits forever for the other ranks; it now calls it on every rank too.
- ``ReftTrainer.save_model`` (and ``_load_best_model``) called ``save_intervention`` on ``trainer.model``: pyreft's
  multi-GPU example hands the trainer a ``DistributedDataParallel`` wrapper, and the first checkpoint failed with
  ``AttributeError: 'DistributedDataParallel' object has no attribute 'save_intervention'``. They now reach the
  pyvene model inside whatever wraps it.

Replaces ``pyreft.reft_trainer.ReftTrainer.save_model`` and ``ReftTrainerForCausalLMDistributed.save_model``, wraps
``ReftTrainer._load_best_model``.
"""

from __future__ import annotations

import os

import torch.distributed as dist
from transformers.utils import logging

from ..._optional import hf_trainer, pyreft_trainers
from ..._records import Fix, Site
from ...gather import is_main_process
from ...mechanisms.arguments import bound
from ...mechanisms.saved_files import INTERVENTIONS_DIR
from ...mechanisms.wrapped_models import unwrap_intervenable_model


def _wrap_save_model(wrapped, instance, args, kwargs):
    # Bound to HF's signature, whose output_dir defaults to the trainer's args.output_dir (pyreft's requires it).
    output_dir = bound(hf_trainer.Trainer.save_model, (instance, *args), kwargs).arguments["output_dir"]
    target = os.path.join(output_dir or instance.args.output_dir, INTERVENTIONS_DIR)
    skip = [is_main_process() and os.path.isdir(target) and bool(os.listdir(target))]
    if dist.is_available() and dist.is_initialized():
        dist.broadcast_object_list(skip, src=0)  # every rank must agree: saving may gather
    if skip[0]:
        logging.get_logger(__name__).warning(f"{target} already holds files; not overwriting them (as pyreft)")
        return
    unwrap_intervenable_model(instance.model).save_intervention(save_directory=target, include_model=True)


def _wrap_save_model_on_every_rank(wrapped, instance, args, kwargs):
    return pyreft_trainers.ReftTrainer.save_model(instance, *args, **kwargs)  # writes once, on rank 0, itself


def _wrap_load_best_model(wrapped, instance, args, kwargs):
    best = instance.state.best_model_checkpoint
    logging.get_logger(__name__).warning(f"Loading best model from {best} (score: {instance.state.best_metric}).")
    unwrap_intervenable_model(instance.model).load_intervention(os.path.join(best, INTERVENTIONS_DIR),
                                                               include_model=True)


FIX = Fix(
    __name__,
    sites=(
        Site("pyreft.reft_trainer:ReftTrainer.save_model", _wrap_save_model, kind="replace"),
        Site("pyreft.reft_trainer:ReftTrainerForCausalLMDistributed.save_model", _wrap_save_model_on_every_rank,
             kind="replace"),
        Site("pyreft.reft_trainer:ReftTrainer._load_best_model", _wrap_load_best_model),
    ),
    # intervention_files: what every rank's save_intervention gathers and rank 0 alone writes.
    requires=("intervention_files",),
    upstream=("pyreft",),
)
