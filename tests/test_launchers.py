"""The slower tier: real launchers (torchrun) with the scripts users write."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pyvene_dist.testing import ParityCase, Record, assert_parity

SCRIPTS = Path(__file__).parent / "scripts"
pytestmark = pytest.mark.slow


def launch(tmp_path, nproc, *script_args, timeout=420):
    out = tmp_path / f"record-{nproc}-{script_args[1] if len(script_args) > 1 else 'default'}.pt"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
               "--master_port", str(_free_port()), str(SCRIPTS / "train_with_trainer.py"), str(out), *script_args]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"torchrun with {nproc} processes ran past {timeout}s:\n{output}")
    assert process.returncode == 0, f"torchrun with {nproc} processes failed:\n{output}"
    return Record(**torch.load(out))


def _free_port():
    from pyvene_dist.testing.launch import free_port

    return free_port()


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
