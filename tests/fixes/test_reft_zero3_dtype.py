"""``reft_zero3_dtype``: pyreft's trainers refuse, at ``train``, a model ZeRO-3 partitioned in another precision than
the run trains in. The flows that end so (an earlier run's arguments alive, a config without ``"bf16"``) are
tests/upstream/test_pyreft_flows.py's, under DeepSpeed."""

from types import SimpleNamespace

import pytest
import torch

from pyvene_dist.testing.models import import_pyreft, reft_model, tiny_llama

STEP = "_pyvene_dist_check_train_reft_zero3_dtype"


def partitioned_trainer(dtype: torch.dtype):
    """A ReftTrainerForCausalLM whose model carries ZeRO-3's partitions (``ds_tensor``) in ``dtype``, for a bf16 run."""
    pyreft = import_pyreft()
    model = reft_model(tiny_llama())
    for parameter in model.model.parameters():
        parameter.ds_tensor = torch.zeros(1, dtype=dtype)  # what zero.Init leaves on each parameter
    trainer = object.__new__(pyreft.ReftTrainerForCausalLM)  # train checks before it reads anything else
    trainer.model, trainer.args = model, SimpleNamespace(deepspeed={"zero_optimization": {"stage": 3}}, bf16=True,
                                                         fp16=False)
    return trainer


def test_a_model_partitioned_in_float32_is_refused_for_a_bf16_run(patched):
    """DeepSpeed casts nothing already partitioned: the run's first step was float32's, and it resumed 3.4e-5 off."""
    with pytest.raises(ValueError, match=r"ReftTrainerForCausalLM\.train: DeepSpeed ZeRO-3 partitioned the model in "
                                         r"torch\.float32 .* \(bf16=True\) train in torch\.bfloat16; .* \"bf16\" section"):
        partitioned_trainer(torch.float32).train()


def test_a_model_partitioned_in_the_runs_precision_passes(patched):
    getattr(partitioned_trainer(torch.bfloat16), STEP)()


def test_left_out_it_adds_no_step_to_the_shared_train():
    """``ReftTrainer.train`` is added by each fix that acts there; one left out adds no step, and ``unpatch()``
    deletes the method and every step."""
    import pyvene_dist

    trainer_class = import_pyreft().ReftTrainer
    with pyvene_dist.patched(exclude=["reft_zero3_dtype"]):
        assert "train" in vars(trainer_class) and STEP not in vars(trainer_class)
    with pyvene_dist.patched(only=["reft_zero3_dtype"]):
        assert "train" in vars(trainer_class) and STEP in vars(trainer_class)
    assert "train" not in vars(trainer_class) and STEP not in vars(trainer_class)
