"""``reft_wrapped_checkpointing``: pyreft's trainers handed a wrapper of the ReFT model (pyreft's multi-GPU example
hands them a DDP wrapper) enable gradient checkpointing on the base model inside it. The example itself, on two
ranks, is tests/upstream/test_pyreft_flows.py's."""

import torch

from pyvene_dist.testing import ParityCase
from pyvene_dist.testing.hf import examples, training_arguments
from pyvene_dist.testing.models import import_pyreft

CASE = ParityCase(steps=1, batch_size=2, accumulation=1)


class Wrapper(torch.nn.Module):
    """What DDP is to the trainer: a module that holds the ReFT model and has none of its methods."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


def test_checkpointing_is_enabled_on_the_model_inside_a_wrapper(patched, tmp_path):
    """HF Trainer enabled it on the wrapper: ``AttributeError: 'Wrapper' object has no attribute
    'gradient_checkpointing_enable'`` (``'DistributedDataParallel' object`` in the example)."""
    pyreft = import_pyreft()
    model = CASE.build()
    args = training_arguments(CASE, str(tmp_path), 1, gradient_checkpointing=True)
    trainer = pyreft.ReftTrainer(model=Wrapper(model), args=args, train_dataset=examples(CASE))
    trainer.train()
    assert model.model.is_gradient_checkpointing
    assert args.gradient_checkpointing  # switched off only while Trainer.train ran
