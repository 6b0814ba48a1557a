"""``ReftTrainer`` saves on every rank, and reaches the pyvene model inside whatever wraps it
(fixes.checkpoints.trainer_saves)."""

import os
import types

import pytest
import torch
import torch.distributed as dist

import helpers
from pyvene_dist.testing import ParityCase, models

CASE = ParityCase(steps=4)


def test_a_wrapped_model_is_saved_and_its_best_loaded(patched, tmp_path):
    """pyreft's multi-GPU example hands the trainer a wrapped model: ``save_model`` failed with ``AttributeError:
    'DataParallel' object has no attribute 'save_intervention'`` (DDP's wrapper the same), ``_load_best_model``
    likewise."""
    pyreft = models.import_pyreft()
    model = CASE.build()
    trainer = object.__new__(pyreft.ReftTrainer)  # save_model reads model and args; _load_best_model state
    trainer.model, trainer.args = torch.nn.DataParallel(model), types.SimpleNamespace(output_dir=str(tmp_path))
    trainer.save_model(str(tmp_path / "best"))
    assert "intervention_states.bin" in os.listdir(tmp_path / "best" / "intervenable_model")
    saved = {name: value.clone() for name, value in model.interventions.state_dict().items()}
    with torch.no_grad():
        for parameter in model.interventions.parameters():
            parameter.add_(1.0)
    trainer.state = types.SimpleNamespace(best_model_checkpoint=str(tmp_path / "best"), best_metric=0.5)
    trainer._load_best_model()
    for name, value in saved.items():
        assert torch.equal(model.interventions.state_dict()[name], value), name


@pytest.mark.world_size(2, timeout=120)
def test_distributed_causal_lm_trainer_saves_without_hanging(tmp_path):
    """pyreft's ReftTrainerForCausalLMDistributed.save_model saves on rank 0 alone; saving waits for
    every rank (it may gather), so rank 0 used to wait forever."""
    import types

    helpers.patch()
    pyreft = models.import_pyreft()
    trainer = object.__new__(pyreft.ReftTrainerForCausalLMDistributed)  # save_model reads model and args
    trainer.model, trainer.args = CASE.build(), types.SimpleNamespace(output_dir=str(tmp_path))
    trainer.save_model(str(tmp_path / "out"))
    dist.barrier()
    if dist.get_rank() == 0:
        assert sorted(os.listdir(tmp_path / "out" / "intervenable_model"))
