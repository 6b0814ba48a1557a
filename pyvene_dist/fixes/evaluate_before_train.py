"""HF Trainer's ``train()`` after an ``evaluate()`` trains a pyvene model as it does on a Trainer that never evaluated.

Users evaluate before training (a baseline: ``trainer.evaluate()``, then ``trainer.train()``), and the first
``evaluate()`` of a Trainer prepares the model for evaluation. ``train()`` then took that preparation for its own:

1. DDP (and on CPUs HF's ``fsdp`` arguments, which accelerate runs as DDP there): ``evaluate()`` prepares the model
   with ``Accelerator.prepare_model(model, evaluation_mode=True)``, which wraps nothing (under ``no_grad`` nothing is
   synchronised) and marks the model prepared (``_is_accelerate_prepared``). ``train()``'s
   ``accelerator.prepare(model, optimizer)`` hands a marked model back as it is: every rank trained its own copy on
   its shard of the data, its gradients never averaged, with no error (2 CPU ranks, 2 steps: eval loss 5.65627, one
   process 5.65667).
2. DeepSpeed ZeRO-3: ``evaluate()`` builds an inference engine (no optimizer), which the Trainer keeps
   (``model_wrapped``, ``deepspeed``). ``train()`` frees the accelerator's memory, destroying that engine, then finds
   the model wrapped and prepares the optimizer alone: the first backward fails with ``AttributeError: 'NoneType'
   object has no attribute 'backward'`` (transformers#44889, open). And the evaluation's
   ``deepspeed_init(inference=True)`` deleted the config's ``optimizer`` section and filled its ``"auto"`` values for
   0 training steps: a ``train()`` after it would have run HF's optimizer in place of the config's, silently.

For a Trainer whose model holds a pyvene model, in a run of several processes: an evaluation that builds ZeRO's
inference engine leaves the DeepSpeed config as it found it; and ``train()`` (``_inner_training_loop``, before it
prepares anything) forgets what an evaluation prepared: the mark on a model no wrapper holds, and the Trainer's
references to an engine without a training optimizer. ``train()`` then prepares the model as on a fresh Trainer (DDP,
a training engine); evaluations after it use the trained wrapper, as before. Under mixed precision the evaluation's
autocast forward stays on the model and training's preparation adds its own around it (the same autocast, nested).
One process (nothing to synchronise), FSDP on GPUs (transformers 5.24 and accelerate 1.16 take an FSDP2 model
prepared for evaluation), and Trainers of other models are left as they are.

Tested on 2 CPU processes; the releases whose forms it was checked against are the fingerprints table's
(``pyvene-dist fixes``).
"""

from __future__ import annotations

import copy

from .._optional import DEEPSPEED_INSTALL, OnFirstUse
from .._records import Fix, Site
from ..mechanisms.wrapped_models import holds_intervenable_model

TRANSFORMERS = "transformers.trainer"
zero_offload = OnFirstUse("deepspeed.runtime.zero.parameter_offload", DEEPSPEED_INSTALL)  # under DeepSpeed only


def _wrap_evaluation_loop(wrapped, instance, args, kwargs):
    config = _config_before_inference(instance)
    try:
        return wrapped(*args, **kwargs)
    finally:
        if config is not None:  # the same dict accelerate's plugin and HF's config object read: put back in place
            live = instance.accelerator.state.deepspeed_plugin.hf_ds_config.config
            live.clear()
            live.update(config)


def _config_before_inference(trainer) -> dict | None:
    """A copy of the DeepSpeed config where this evaluation is the one that builds ZeRO's inference engine."""
    if not (trainer.is_deepspeed_enabled and trainer.deepspeed is None and holds_intervenable_model(trainer.model)):
        return None
    return copy.deepcopy(trainer.accelerator.state.deepspeed_plugin.hf_ds_config.config)


def _wrap_inner_training_loop(wrapped, instance, args, kwargs):
    if instance.accelerator.num_processes > 1 and holds_intervenable_model(instance.model):
        _forget_the_evaluations_preparation(instance)
    return wrapped(*args, **kwargs)


def _forget_the_evaluations_preparation(trainer) -> None:
    if trainer.is_deepspeed_enabled:
        engine = trainer.deepspeed
        if engine is not None and _inference_engine(engine):
            trainer.model_wrapped, trainer.deepspeed = trainer.model, None  # free_memory destroys the engine
        return
    model = trainer.model
    if trainer.is_fsdp_enabled or getattr(trainer, "is_distributed_loading_by_transformers", False) \
            or trainer.model_wrapped is not model or not getattr(model, "_is_accelerate_prepared", False):
        return
    del model._is_accelerate_prepared  # prepared for evaluation only: no wrapper holds it


def _inference_engine(engine) -> bool:
    """Whether a DeepSpeed engine was built without an optimizer (ZeRO-3 stands its parameter offload in for one)."""
    return engine.optimizer is None or isinstance(engine.optimizer, zero_offload.DeepSpeedZeRoOffload)


FIX = Fix(
    __name__,
    sites=(
        Site(f"{TRANSFORMERS}:Trainer.evaluation_loop", _wrap_evaluation_loop),
        Site(f"{TRANSFORMERS}:Trainer._inner_training_loop", _wrap_inner_training_loop),
    ),
)
