"""The slower tier: real launchers (torchrun) with the scripts users write."""

from pathlib import Path

import pytest

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
