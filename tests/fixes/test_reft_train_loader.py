"""``reft_train_loader``: pyreft's causal-LM trainers load their training data with HF Trainer's loader, in the order
``train_sampling_strategy`` asks (one process here; tests/strategies/test_launchers.py's torchrun runs shard it)."""

import pytest
import torch

from pyvene_dist.testing import ParityCase
from pyvene_dist.testing.hf import examples, training_arguments
from pyvene_dist.testing.models import import_pyreft

CASE = ParityCase(steps=4, batch_size=2, accumulation=1)


@pytest.mark.parametrize("trainer_class", ["ReftTrainerForCausalLM", "ReftTrainerForCausalLMDistributed"])
def test_training_data_come_in_the_order_the_arguments_ask(patched, tmp_path, trainer_class):
    """pyreft's loaders shuffled whatever the arguments said (``ReftTrainerForCausalLM``), or needed a process
    group for their ``DistributedSampler`` (``ValueError: Default process group has not been initialized``)."""
    pyreft = import_pyreft()
    rows = examples(CASE)  # train_sampling_strategy="sequential" in the arguments
    trainer = getattr(pyreft, trainer_class)(model=CASE.build(), args=training_arguments(CASE, str(tmp_path), 1),
                                             train_dataset=rows)
    seen = torch.cat([batch["input_ids"] for batch in trainer.get_train_dataloader()])
    assert torch.equal(seen, torch.stack([row["input_ids"] for row in rows]))
