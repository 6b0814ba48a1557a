"""HF Trainer resumes from a ``ReftTrainer`` checkpoint and continues exactly (fixes.checkpoints.hf_resume).

Before: ``ValueError: Can't find a valid checkpoint at .../checkpoint-N`` (pyreft writes ``intervenable_model/``
there, HF Trainer looks for ``model.safetensors``).
"""

import torch

from pyvene_dist.testing import ParityCase
from pyvene_dist.testing.hf import train_with_trainer

CASE = ParityCase(steps=4)


def test_resume_from_a_trainer_checkpoint_continues_exactly(patched, tmp_path):
    whole = train_with_trainer(CASE, str(tmp_path / "whole"))
    train_with_trainer(CASE, str(tmp_path / "first"), save_strategy="steps", save_steps=2)
    resumed = train_with_trainer(CASE, str(tmp_path / "second"),
                                 resume_from_checkpoint=str(tmp_path / "first" / "checkpoint-2"))
    print("uninterrupted:", whole.losses, "\nresumed:      ", resumed.losses)
    assert len(resumed.grads) == 2  # two steps ran after the checkpoint; the log holds the first two too
    torch.testing.assert_close(torch.tensor(resumed.losses[2:]), torch.tensor(whole.losses[2:]), rtol=1e-6, atol=0)
    for name, value in whole.weights.items():
        torch.testing.assert_close(resumed.weights[name], value, rtol=1e-6, atol=1e-7, msg=name)
