"""pyreft's ``examples/alpaca/train.py`` itself, unchanged, run through docs/examples/run_pyreft_example.py
as docs/pyreft_examples.md says: in one process and under torchrun with 2 ranks (gloo on CPU), on the
suite's checkpoint folder and its ``alpaca_data.json``, with gradient accumulation. The script is pyreft's,
not this project's: the test runs where ``PYREFT_REPO`` names a checkout of stanfordnlp/pyreft and skips
otherwise.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import suite

pytestmark = pytest.mark.slow

ROOT = Path(__file__).parents[2]
WRAPPER = ROOT / "docs" / "examples" / "run_pyreft_example.py"


@pytest.fixture(scope="module")
def alpaca_train():
    repo = os.environ.get("PYREFT_REPO")
    script = Path(repo or ".") / "examples" / "alpaca" / "train.py"
    if not repo or not script.is_file():
        pytest.skip("set PYREFT_REPO to a checkout of stanfordnlp/pyreft to run its example scripts")
    return script


def _train(script, checkpoint, output_dir, nproc):
    from pyvene_dist.testing.launch import free_port

    launcher = ["-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port", str(free_port())] \
        if nproc > 1 else []
    arguments = ["--model_name_or_path", str(checkpoint), "--data_path", str(checkpoint / "data" / "alpaca_data.json"),
                 "--output_dir", str(output_dir), "--layers", "0;1", "--rank", "4", "--position", "f1+l1",
                 "--num_train_epochs", "1", "--per_device_train_batch_size", str(4 // nproc),
                 "--gradient_accumulation_steps", "2", "--save_strategy", "no", "--learning_rate", "2e-3",
                 "--logging_steps", "1", "--report_to", "none", "--use_cpu", "True", "--model_max_length", "128"]
    result = subprocess.run([sys.executable, *launcher, str(WRAPPER), str(script), *arguments], cwd=output_dir.parent,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-5000:]
    history = json.loads((output_dir / "trainer_state.json").read_text())["log_history"]
    return [entry["loss"] for entry in history if "loss" in entry]


def test_alpaca_train_under_torchrun_matches_one_process(alpaca_train, tmp_path):
    """The documented ``python`` and ``torchrun --nproc_per_node 2`` lines log the same losses (its data
    differ in length and label tokens; 2 micro-batches per step) and save the interventions on rank 0."""
    checkpoint = suite.make_checkpoint(tmp_path / "checkpoint")
    one = _train(alpaca_train, checkpoint, tmp_path / "one", 1)
    two = _train(alpaca_train, checkpoint, tmp_path / "two", 2)
    assert len(one) == 2 and two == pytest.approx(one, rel=1e-5)
    assert sorted(p.name for p in (tmp_path / "two" / "intervenable_model").glob("intkey_*")) == \
        sorted(p.name for p in (tmp_path / "one" / "intervenable_model").glob("intkey_*"))
