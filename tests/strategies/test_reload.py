"""Folders that docs/examples/train_reft.py saves under one process, DDP, FSDP2 and ZeRO-3, in float32 and bf16, reload
on the CPU with pyreft's ``ReftModel.load`` and docs/examples/serve_reft.py, and answer as the model that was saved.

Each configuration trains once (2 steps, 2 processes but for one process, gloo on the CPU), answers ``PROMPT`` at the
end of training (``--prompt``: the trained model's logits and greedy tokens, under the strategy) and saves its
interventions with ``ReftModel.save``. bf16 is the issue's line: ``--bf16 --dtype bfloat16``. FSDP2 is
``accelerate launch --config_file docs/configs/accelerate-fsdp2.yaml`` with accelerate's FSDP plugin applied on the
CPU (tests/scripts/train_reft_fsdp_on_cpu.py; by itself accelerate trains DDP on the CPU), so that ``--bf16`` sets
up what it sets up on a GPU: float32 master weights and a bf16 ``MixedPrecisionPolicy``. ZeRO-3 is torchrun with
``--deepspeed docs/configs/deepspeed-zero3.json``.

Before the fixes, the ZeRO-3 bf16 folder failed to reload (``NotImplementedError: "geqrf_cpu" not implemented for
'BFloat16'``), FSDP2 with ``--bf16`` failed its first forward (``mat1 and mat2 must have the same dtype, but got
BFloat16 and Float``). tests/strategies/test_gpu_bf16.py runs the docs' launch lines on a GPU.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from launchers import SCRIPTS, run_forked, run_together

pytestmark = pytest.mark.slow

ROOT = Path(__file__).parents[2]
EXAMPLES = ROOT / "docs" / "examples"
CONFIGS = ROOT / "docs" / "configs"
TRAIN = str(EXAMPLES / "train_reft.py")
PROMPT = "red cat runs"
STEPS, GLOBAL_BATCH = 2, 4
FLAGS = ("--positions", "f1+l1", "--max_steps", str(STEPS), "--learning_rate", "1e-2", "--lr_scheduler_type",
         "constant", "--train_sampling_strategy", "sequential", "--save_strategy", "no", "--report_to", "none",
         "--disable_tqdm", "true", "--use_cpu", "--prompt", PROMPT)
DTYPES = {"float32": ("--dtype", "float32"), "bf16": ("--bf16", "--dtype", "bfloat16")}


def _launch(strategy: str, port: int) -> list[str]:
    torchrun = ["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port)]
    return {
        "one-process": [TRAIN],
        "ddp": [*torchrun, TRAIN],
        "fsdp2": ["-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / "accelerate-fsdp2.yaml"),
                  "--main_process_port", str(port), str(SCRIPTS / "train_reft_fsdp_on_cpu.py")],
        "zero3": [*torchrun, TRAIN, "--deepspeed", str(CONFIGS / "deepspeed-zero3.json")],
    }[strategy]


STRATEGIES = ("one-process", "ddp", "fsdp2", "zero3")
#: float32 under one process, DDP and ZeRO-3 is tests/strategies/test_launchers.py's (the same script's folders
#: reloaded with serve_reft.py's ``load``, to 1e-5): here each strategy in bf16, and FSDP2, sharded only here, in both.
CONFIGURATIONS = [(strategy, dtype) for strategy in STRATEGIES for dtype in DTYPES
                  if dtype == "bf16" or strategy == "fsdp2"]
IDS = [f"{strategy}-{dtype}" for strategy, dtype in CONFIGURATIONS]
#: How close a reloaded answer's logits must be to the trained model's. float32: as tests/strategies/test_launchers.py.
#: bf16: the trained model answered where it trained (under accelerate's CPU autocast but for ZeRO-3 and FSDP2, and
#: through the strategy's forward); the reloaded one in plain bf16, whose rounding is 2^-8 of a value.
TOLERANCES = {"float32": {"rtol": 1e-5, "atol": 1e-5}, "bf16": {"rtol": 2 ** -6, "atol": 2 ** -6}}


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory) -> Path:
    """A model folder as users bring one (tiny Llama, a real BPE tokenizer) and its examples."""
    from pyvene_dist.testing.models import instruction_examples, save_checkpoint

    folder = save_checkpoint(tmp_path_factory.mktemp("model"))
    (folder / "train.json").write_text(json.dumps(instruction_examples(GLOBAL_BATCH * STEPS)))
    return folder


@pytest.fixture(scope="module")
def trained(model_folder, tmp_path_factory):
    """(strategy, dtype) -> the output folder of its one training run, made by the first test that asks. The run of
    one process is ``python train_reft.py`` as launchers.run_forked makes it: as ``__main__`` in a process of its
    own forked from the preloaded server (not a fresh interpreter's imports again)."""
    from pyvene_dist.testing.launch import free_port

    runs = {}

    def get(strategy: str, dtype: str) -> Path:
        if (strategy, dtype) not in runs:
            out = tmp_path_factory.mktemp(f"{strategy}-{dtype}")
            world_size = 1 if strategy == "one-process" else 2
            arguments = ["--model", str(model_folder), "--data", str(model_folder / "train.json"), *FLAGS,
                         *DTYPES[dtype], "--output_dir", str(out), "--per_device_train_batch_size",
                         str(GLOBAL_BATCH // world_size)]
            if strategy == "one-process":  # python train_reft.py, in a process forked from the preloaded server
                run_forked(TRAIN, arguments, timeout=600)
            else:
                run_together([[*_launch(strategy, free_port()), *arguments]], cwd=ROOT, timeout=600)
            runs[strategy, dtype] = out
        return runs[strategy, dtype]
    return get


@pytest.fixture(scope="module")
def served(trained, tmp_path_factory):
    """Every folder reloaded in one process of its own (forked from the preloaded server: launchers.run_forked) by
    docs/examples/serve_reft.py's ``load`` (pyreft's ``ReftModel.load``) and ``answer``, with what train_reft.py
    saved beside it (tests/scripts/serve_each.py)."""
    folders = {configuration: str(trained(*configuration) / "reft") for configuration in CONFIGURATIONS}
    out = tmp_path_factory.mktemp("served") / "answers.pt"
    run_forked(SCRIPTS / "serve_each.py", [str(out), PROMPT, *folders.values()], timeout=600)
    answers = torch.load(out)
    return {configuration: answers[folder] for configuration, folder in folders.items()}


def assert_answers_alike(found: dict, trained: dict, dtype: str) -> None:
    tolerance = TOLERANCES[dtype]
    torch.testing.assert_close(found["logits"], trained["logits"], rtol=tolerance["rtol"],
                               atol=tolerance["atol"] * trained["logits"].abs().max().item())
    assert found["ids"].tolist() == trained["ids"].tolist(), (found["text"], trained["text"])


@pytest.mark.parametrize("strategy, dtype", CONFIGURATIONS, ids=IDS)
def test_serve_reft_answers_as_the_trained_model(trained, served, strategy, dtype):
    answer = torch.load(trained(strategy, dtype) / "answer.pt")
    found = served[strategy, dtype]
    print(f"{strategy} {dtype}: trained {answer['text']!r}, reloaded {found['text']!r}, logits differ by at most "
          f"{(found['logits'] - answer['logits']).abs().max().item():.2e} of {answer['logits'].abs().max().item():.2f}")
    assert_answers_alike(found, answer, dtype)


@pytest.mark.parametrize("strategy, dtype", CONFIGURATIONS, ids=IDS)
def test_reftmodel_load_gives_the_saved_weights_on_the_cpu(patched, trained, model_folder, strategy, dtype):
    """Every file holds CPU tensors as ``torch.load`` reads it with no ``map_location`` (as pyvene's ``load``
    does), and ``ReftModel.load`` onto the base in the training dtype gives back each saved weight exactly, in
    its saved dtype: float32 where it trained in float32; under bf16 what the strategy held (ZeRO-3: bf16, as
    DeepSpeed casts them; FSDP2: accelerate's float32 master weights; DDP and one process: pyreft's LoReFT, its
    ``learned_source`` in bf16 and its rotation in float32)."""
    import pyreft
    import transformers

    folder = trained(strategy, dtype) / "reft"
    for path in sorted(folder.glob("*.bin")) + sorted(folder.glob("*.pt")):
        for name, value in torch.load(path).items():
            assert value.device == torch.device("cpu"), (path.name, name, value.device)
    saved = torch.load(folder / "intervention_states.pt")
    base = transformers.AutoModelForCausalLM.from_pretrained(model_folder, dtype=getattr(torch, DTYPES[dtype][-1]))
    loaded = pyreft.ReftModel.load(str(folder), base)
    found = loaded.interventions.state_dict()
    assert found.keys() == saved.keys()
    for name, value in saved.items():
        assert found[name].dtype == value.dtype, name
        torch.testing.assert_close(found[name], value, rtol=0, atol=0, msg=lambda m, name=name: f"{name}: {m}")
    dtypes = {value.dtype for name, value in saved.items() if name.endswith(("weight", "bias", "original"))}
    expected = {"float32": {torch.float32}, "bf16": {"zero3": {torch.bfloat16}, "fsdp2": {torch.float32}}.get(
        strategy, {torch.bfloat16, torch.float32})}[dtype]
    assert dtypes == expected


def test_serve_reft_command_line_on_the_zero3_bf16_folder(trained, tmp_path):
    """The issue's reproduction as a user types it: ``serve_reft.py --interventions OUT/reft`` on a folder saved under
    ZeRO-3 in bf16 (it stopped with ``NotImplementedError: "geqrf_cpu" not implemented for 'BFloat16'``)."""
    output_dir = trained("zero3", "bf16")
    out = tmp_path / "answer.pt"
    result = subprocess.run([sys.executable, str(EXAMPLES / "serve_reft.py"), "--interventions",
                             str(output_dir / "reft"), "--prompt", PROMPT, "--out", str(out)],
                            cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-4000:]
    assert_answers_alike(torch.load(out), torch.load(output_dir / "answer.pt"), "bf16")
