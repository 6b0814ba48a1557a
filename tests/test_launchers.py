"""The slower tier: real launchers (torchrun) with the scripts users write."""

from pathlib import Path

import pytest
import torch

from launchers import run_launcher
from pyvene_dist.testing import ParityCase, assert_parity

SCRIPTS = Path(__file__).parent / "scripts"
pytestmark = pytest.mark.slow


def launch(tmp_path, nproc, *script_args):
    from pyvene_dist.testing.launch import free_port

    torchrun = ["-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port", str(free_port()),
                str(SCRIPTS / "train_with_trainer.py")]
    return run_launcher(tmp_path, torchrun, script_args)


TRAINERS = [
    pytest.param(("ReftTrainer",), id="ReftTrainer"),
    pytest.param(("ReftTrainerForCausalLM",), id="ReftTrainerForCausalLM"),
    pytest.param(("ReftTrainerForSequenceClassification", "--model", "llama-cls", "--eval-examples", "7"),
                 id="ReftTrainerForSequenceClassification+evaluate"),
]


@pytest.mark.parametrize("trainer", TRAINERS)
def test_torchrun_pyreft_trainer_matches_one_process(tmp_path, trainer):
    single = launch(tmp_path, 1, "--trainer", *trainer)
    double = launch(tmp_path, 2, "--trainer", *trainer)
    print(f"{trainer[0]} losses, 1 process:  ", single.losses, single.metrics)
    print(f"{trainer[0]} losses, 2 processes:", double.losses, double.metrics)
    assert len(double.losses) == ParityCase().steps
    assert_parity(single, double, ParityCase().tolerance)
    assert double.metrics == single.metrics
    if "--eval-examples" in trainer:
        assert single.metrics["eval_examples"] == 7


@pytest.mark.parametrize("strategy", [pytest.param((), id="ddp"), pytest.param(("--deepspeed", "3"), id="zero3")])
def test_torchrun_resume_from_checkpoint_continues_exactly(tmp_path, strategy):
    """Under ZeRO-3 the checkpoint is DeepSpeed's own (each rank's partitions of weights and optimizer state)."""
    whole = launch(tmp_path, 2, "--steps", "4", *strategy)
    launch(tmp_path, 2, "--steps", "4", "--output-dir", str(tmp_path / "first"), "--save-steps", "2", *strategy)
    if strategy:
        assert list((tmp_path / "first" / "checkpoint-2").glob("global_step2/*optim_states.pt")), "not DeepSpeed's"
    resumed = launch(tmp_path, 2, "--steps", "4", "--output-dir", str(tmp_path / "second"),
                     "--resume-from", str(tmp_path / "first" / "checkpoint-2"), *strategy)
    print("uninterrupted:", whole.losses, "\nresumed:      ", resumed.losses)
    assert len(resumed.grads) == (0 if strategy else 2)  # two steps ran after the checkpoint (no reading under ZeRO)
    assert len(resumed.losses) == 4  # the log holds the first two too, restored from the checkpoint
    torch.testing.assert_close(torch.tensor(resumed.losses[2:]), torch.tensor(whole.losses[2:]), rtol=1e-6, atol=0)
    for name, value in whole.weights.items():
        torch.testing.assert_close(resumed.weights[name], value, rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.gpus(2)
@pytest.mark.parametrize("version", [2, 1])
def test_torchrun_hf_trainer_fsdp_matches_one_process(tmp_path, version):
    import transformers
    from packaging.version import Version

    if version == 1 and Version(transformers.__version__) >= Version("5.20"):
        pytest.skip("HF Trainer dropped FSDP1 in transformers 5.20")
    single = launch(tmp_path, 1)
    sharded = launch(tmp_path, 2, "--fsdp", str(version))
    print(f"HF Trainer FSDP{version}: 1 process {single.losses}\n2 processes {sharded.losses}")
    assert_parity(single, sharded, ParityCase().tolerance)
