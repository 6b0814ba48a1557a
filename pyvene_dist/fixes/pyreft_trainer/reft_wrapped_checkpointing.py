"""pyreft's trainers enable gradient checkpointing on the pyvene model inside a DDP wrapper they are handed.

pyreft's ``examples/alpaca/train_multigpu.py`` wraps the ReFT model in DDP itself and hands the wrapper to
``ReftTrainerForCausalLM``. With ``--gradient_checkpointing``, ``Trainer.train`` enables it on the model it holds,
the wrapper: ``AttributeError: 'DistributedDataParallel' object has no attribute 'gradient_checkpointing_enable'``.
pyreft's trainers (``ReftTrainer.train``, added) enable it on the pyvene model inside a wrapper that has no enabler
of its own, with the arguments' checkpointing keywords, and switch the arguments' flag off while ``Trainer.train``
runs (then back on), so that HF does not ask the wrapper. Both names of the flag are switched
(``activation_checkpointing``, which transformers 5.24 reads, and its alias ``gradient_checkpointing``).

pyreft is patched when (and if) it is imported.
"""

from __future__ import annotations

import contextlib

from ..._records import Fix
from ...mechanisms.trainer_steps import AROUND_TRAIN, step_sites
from ...mechanisms.wrapped_models import holds_intervenable_model, unwrap_intervenable_model

#: ``Trainer.train`` calls the first of these the model has (transformers 5.2x; before, only the second).
CHECKPOINTING_ENABLERS = ("activation_checkpointing_enable", "gradient_checkpointing_enable")
#: The ``TrainingArguments`` flag that makes ``Trainer.train`` call it, and its deprecated alias (kept equal).
CHECKPOINTING_FLAGS = ("activation_checkpointing", "gradient_checkpointing")


@contextlib.contextmanager
def _checkpointing_inside_a_wrapper(trainer):
    """While ``Trainer.train`` runs: checkpointing enabled on the pyvene model inside a wrapper handed to the
    trainer (pyreft's multi-GPU example hands it a DDP wrapper), which HF would ask instead."""
    flags = [name for name in CHECKPOINTING_FLAGS if getattr(trainer.args, name, None)]
    if not flags or any(hasattr(trainer.model, name) for name in CHECKPOINTING_ENABLERS) \
            or not holds_intervenable_model(trainer.model):
        yield
        return
    _enable_checkpointing(unwrap_intervenable_model(trainer.model), trainer.args)
    for name in flags:
        setattr(trainer.args, name, False)
    try:
        yield
    finally:
        for name in flags:
            setattr(trainer.args, name, True)


def _enable_checkpointing(model, arguments) -> None:
    """What ``Trainer.train`` does with the checkpointing arguments, done to ``model``: keywords for
    ``torch.utils.checkpoint``, and ``every_n_layers`` and ``offload`` for the enabler itself."""
    options = dict(getattr(arguments, "activation_checkpointing_kwargs", None)
                   or getattr(arguments, "gradient_checkpointing_kwargs", None) or {})
    layout = {key: options.pop(key) for key in ("every_n_layers", "offload") if key in options}
    newer, older = CHECKPOINTING_ENABLERS
    enable = getattr(model, newer) if hasattr(model, newer) else getattr(model, older)  # as Trainer.train chooses
    enable(options or None, **layout)


FIX = Fix(
    __name__,
    sites=step_sites(AROUND_TRAIN, __name__, _checkpointing_inside_a_wrapper),
    # the checkpointing enablers of the pyvene model inside a wrapper
    requires=("wrapper_attributes",),
    upstream=("pyreft",),
    relies_on=("transformers.trainer:Trainer.train",),  # the enabler it calls, and the flags it reads
)
