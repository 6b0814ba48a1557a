"""pyreft's causal-LM trainers load training data as HF Trainer does: sharded over the ranks, in its order.

``ReftTrainerForCausalLM.get_train_dataloader`` (the README's default) returns a plain shuffled ``DataLoader``:
under torchrun every rank silently trains on the whole dataset, and ``train_sampling_strategy``,
``dataloader_drop_last`` and the data seed are ignored. ``ReftTrainerForCausalLMDistributed``'s
``DistributedSampler`` never sets its epoch (the same order every epoch) and ignores them too. The fix is HF
Trainer's own ``get_train_dataloader``.

pyreft is patched when (and if) it is imported.
"""

from __future__ import annotations

from ..._optional import hf_trainer
from ..._records import Fix, Site
from ...mechanisms.trainer_steps import PYREFT


def _wrap_train_dataloader(wrapped, instance, args, kwargs):
    return hf_trainer.Trainer.get_train_dataloader(instance, *args, **kwargs)


FIX = Fix(
    __name__,
    sites=(
        Site(f"{PYREFT}:ReftTrainerForCausalLM.get_train_dataloader", _wrap_train_dataloader, kind="replace"),
        Site(f"{PYREFT}:ReftTrainerForCausalLMDistributed.get_train_dataloader", _wrap_train_dataloader,
             kind="replace"),
    ),
    upstream=("pyreft",),
)
