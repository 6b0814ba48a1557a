"""The docs' launch lines in bf16 on one GPU, end to end: train with accelerate's FSDP2 and with DeepSpeed ZeRO-3
(``--bf16 --dtype bfloat16``), then reload each saved folder with docs/examples/serve_reft.py on the GPU and on the
CPU, and answer as the trained model did. Skipped without CUDA.

    python -m pytest -q tests/strategies/test_gpu_bf16.py        (one GPU)

On one H200 (issue 37, before the fixes) the FSDP2 line failed in its first forward (``RuntimeError: mat1 and mat2
must have the same dtype, but got BFloat16 and Float``), and the ZeRO-3 folder saved CUDA tensors and failed to
reload on the CPU (``NotImplementedError: "geqrf_cpu" not implemented for 'BFloat16'``). The CPU's conditions of
both are tests/fixes/test_fsdp_mixed_precision.py and tests/strategies/test_reload.py.
"""

import json
from pathlib import Path

import pytest
import torch

from launchers import run_together

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs 1 GPU (CUDA), found none")]

ROOT = Path(__file__).parents[2]
EXAMPLES = ROOT / "docs" / "examples"
CONFIGS = ROOT / "docs" / "configs"
PROMPT = "red cat runs"
STEPS = 4
BF16 = ("--bf16", "--dtype", "bfloat16")
FLAGS = ("--positions", "f1+l1", "--max_steps", str(STEPS), "--learning_rate", "1e-2", "--logging_steps", "1",
         "--per_device_train_batch_size", "4", "--save_strategy", "no", "--report_to", "none", "--disable_tqdm",
         "true", "--prompt", PROMPT, *BF16)
#: The docs' launch lines (docs/examples/train_reft.py's docstring, docs/configs), on one GPU.
LAUNCHES = {
    "fsdp2": lambda port: ["-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / "accelerate-fsdp2.yaml"),
                           "--num_processes", "1", "--main_process_port", str(port), str(EXAMPLES / "train_reft.py")],
    "zero3": lambda port: ["-m", "deepspeed.launcher.runner", "--num_gpus", "1", "--master_port", str(port),
                           str(EXAMPLES / "train_reft.py"), "--deepspeed", str(CONFIGS / "deepspeed-zero3.json")],
}
#: bf16 logits: the trained model answered through its strategy's forward, the reloaded one plainly.
TOLERANCE = 2 ** -6


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory) -> Path:
    from pyvene_dist.testing.models import instruction_examples, save_checkpoint

    folder = save_checkpoint(tmp_path_factory.mktemp("model"))
    (folder / "train.json").write_text(json.dumps(instruction_examples(4 * STEPS)))
    return folder


@pytest.fixture(scope="module")
def trained(model_folder, tmp_path_factory):
    from pyvene_dist.testing.launch import free_port

    runs = {}

    def get(strategy: str) -> Path:
        if strategy not in runs:
            out = tmp_path_factory.mktemp(strategy)
            run_together([[*LAUNCHES[strategy](free_port()), "--model", str(model_folder), "--data",
                           str(model_folder / "train.json"), *FLAGS, "--output_dir", str(out)]], cwd=ROOT, timeout=600)
            runs[strategy] = out
        return runs[strategy]
    return get


@pytest.mark.parametrize("strategy", LAUNCHES)
def test_trains_in_bf16_and_saves_cpu_tensors(trained, strategy):
    out = trained(strategy)
    losses = [entry["loss"] for entry in json.loads((out / "trainer_state.json").read_text())["log_history"]
              if "loss" in entry]
    assert len(losses) == STEPS and all(loss == loss for loss in losses), losses
    files = sorted((out / "reft").glob("*.bin")) + sorted((out / "reft").glob("*.pt"))
    assert files
    for path in files:  # read as pyvene's load reads them: no map_location
        for name, value in torch.load(path).items():
            assert value.device == torch.device("cpu"), (path.name, name, value.device)


@pytest.mark.parametrize("device", ["cuda", "cpu"])
@pytest.mark.parametrize("strategy", LAUNCHES)
def test_serve_reft_answers_as_the_trained_model(trained, tmp_path, strategy, device):
    out = trained(strategy)
    answer = tmp_path / "answer.pt"
    env = {"CUDA_VISIBLE_DEVICES": ""} if device == "cpu" else {}
    run_together([[str(EXAMPLES / "serve_reft.py"), "--interventions", str(out / "reft"), "--prompt", PROMPT,
                   "--out", str(answer)]], cwd=ROOT, timeout=300, env=env)
    served, expected = torch.load(answer), torch.load(out / "answer.pt", map_location="cpu")
    print(f"{strategy} on {device}: trained {expected['text']!r}, reloaded {served['text']!r}")
    torch.testing.assert_close(served["logits"], expected["logits"], rtol=TOLERANCE,
                               atol=TOLERANCE * expected["logits"].abs().max().item())
    assert served["ids"].tolist() == expected["ids"].tolist()

