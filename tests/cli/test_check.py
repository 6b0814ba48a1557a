"""`pyvene-dist check`, the README's first command: a table per strategy, a user's own model, clear
one-line errors with exit code 2, and exit code 1 when a strategy disagrees.

In-process tests cover the pieces (model loading, the device_map split, usage checks); the slow tier
runs the command itself; the GPU test is the 2-GPU table the docs quote."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pyvene_dist import check
from pyvene_dist.testing import assert_parity, train
from pyvene_dist.testing.check_runs import CheckCase, model_config, representation_layers
from pyvene_dist.testing.runners import DeviceMap, split_map
from pyvene_dist.testing.models import tiny_gpt2, tiny_llama

MORE_RANKS_THAN_ANY_MACHINE = 4096


def cli(*arguments, timeout=900):
    return subprocess.run([sys.executable, "-m", "pyvene_dist", "check", *arguments], capture_output=True, text=True,
                          timeout=timeout)


# --- a user's own model ------------------------------------------------------------------------------

def test_a_config_directory_builds_the_model_from_the_seed(tmp_path):
    tiny_llama(layers=3).config.save_pretrained(tmp_path)
    built = CheckCase(model=str(tmp_path)).base_model()
    expected = tiny_llama(layers=3, seed=0).state_dict()  # the same config and seed, built directly
    assert set(built.state_dict()) == set(expected)
    for name, value in expected.items():
        assert torch.equal(built.state_dict()[name], value), name


def test_a_directory_with_weights_loads_them(tmp_path):
    saved = tiny_llama(layers=3, seed=7)
    saved.save_pretrained(tmp_path)
    loaded = CheckCase(model=str(tmp_path), seed=0).base_model()
    for name, value in saved.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name


def test_a_config_file_works_and_dropout_is_switched_off(tmp_path):
    config = tiny_gpt2(layers=3).config
    config.resid_pdrop = config.attn_pdrop = 0.1
    config.to_json_file(tmp_path / "gpt2.json")
    loaded = model_config(tmp_path / "gpt2.json")
    assert (loaded.model_type, loaded.n_layer) == ("gpt2", 3)
    assert (loaded.resid_pdrop, loaded.attn_pdrop, loaded.embd_pdrop) == (0.0, 0.0, 0.0)


@pytest.mark.parametrize("layers, chosen", [(1, (0,)), (2, (0, 1)), (5, (0, 4))])
def test_representations_sit_at_the_first_and_last_layer(layers, chosen):
    assert representation_layers(tiny_llama(layers=layers).config) == chosen


@pytest.mark.parametrize("name, content, message", [
    ("missing", None, "missing: no such file or directory"),
    ("folder", "", "folder is a directory without config.json"),
    ("weights.bin", b"", "weights.bin is neither a directory with config.json nor a config .json file"),
    ("c.json", "{}", "c.json: not a transformers config"),
])
def test_a_bad_model_path_is_named(tmp_path, name, content, message):
    path = tmp_path / name
    if content == "":
        path.mkdir()
    elif content is not None:
        path.write_bytes(content) if isinstance(content, bytes) else path.write_text(content)
    with pytest.raises(ValueError, match=message):
        model_config(path)


# --- device_map ------------------------------------------------------------------------------------------

def test_split_map_spreads_the_layers_evenly_and_keeps_the_rest_on_the_first_device():
    assert split_map(tiny_llama(layers=4), [0, 1]) == {
        "model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": 0, "model.layers.2": 1,
        "model.layers.3": 1, "model.norm": 0, "model.rotary_emb": 0, "lm_head": 0,
    }
    assert split_map(tiny_gpt2(layers=3), ["a", "b"]) == {
        "transformer.wte": "a", "transformer.wpe": "a", "transformer.drop": "a", "transformer.h.0": "a",
        "transformer.h.1": "a", "transformer.h.2": "b", "transformer.ln_f": "a", "lm_head": "a",
    }
    with pytest.raises(ValueError, match="has 2 decoder layers .* too few to split over 3 devices"):
        split_map(tiny_llama(layers=2), [0, 1, 2])


def test_device_map_dispatched_on_cpu_matches_one_device(patched):
    """The device_map strategy, with accelerate's hooks, on two "devices" that are both the CPU."""
    case = CheckCase(num_layers=4, layers=(1, 3))
    split = train(case, DeviceMap(devices=["cpu", "cpu"]))
    assert split.world_size == 2
    assert_parity(train(case, "single"), split, case.tolerance)


# --- what runs where, and usage mistakes ----------------------------------------------------------------

def test_gpu_only_strategies_are_listed_once_with_their_reason(monkeypatch):
    monkeypatch.setattr(check, "gpu_count", lambda: 0)
    planned = check.plan(["single", "ddp", "dataparallel", "device_map", "fsdp1"], [1, 2])
    assert planned == [("ddp", 1), ("ddp", 2), ("dataparallel", 2), ("device_map", 2), ("fsdp1", 1), ("fsdp1", 2)]
    assert check.reason("fsdp1", 2) == "needs 2 GPUs, found 0"
    assert check.reason("device_map", 2) == "needs 2 GPUs, found 0"


def quickstart_sample() -> list[tuple[str, str, str]]:
    """(strategy, world, verdict) of each row of docs/quickstart.md's sample `pyvene-dist check` output."""
    text = (Path(__file__).parents[2] / "docs" / "quickstart.md").read_text()
    block = text[text.index("$ pyvene-dist check\n"):]
    lines = block[:block.index("```")].splitlines()[2:]  # after the command and the header
    rows = [re.split(r"\s{2,}", line.strip()) for line in lines if not line.startswith("peak mem:")]
    return [(row[0], row[1], row[-1]) for row in rows]


def test_the_quickstart_sample_is_what_check_runs_on_cpu(monkeypatch):
    """Its rows are check's, in check's order, at the CPU's default world size: those this CPU machine runs agree,
    the rest say why not as check does (the sample of b0b1170 had no tp, tp-fsdp2 or hsdp row)."""
    monkeypatch.setattr(check, "gpu_count", lambda: 0)
    (world,) = check.default_world_sizes()
    expected = [(check.REFERENCE, "1", "reference")] + [
        (name, str(size), "agrees" if why is None else f"unavailable: {why}")
        for name, size in check.plan(check.CHECKED, [world]) for why in [check.reason(name, size)]]
    assert quickstart_sample() == expected


def test_a_missing_package_is_the_reason(monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name in ("deepspeed", "accelerate") else find_spec(name, *args))
    monkeypatch.setattr(check, "gpu_count", lambda: 2)
    names = ("zero2", "zero3-offload", "accelerate", "device_map", "ddp")
    reasons = {name: check.reason(name, 2) for name in names}
    assert reasons == {"zero2": "deepspeed not installed", "zero3-offload": "deepspeed not installed",
                       "accelerate": "accelerate not installed", "device_map": "accelerate not installed", "ddp": None}


def test_zero_in_bfloat16_runs_against_deepspeeds_bf16_bound(monkeypatch):
    """ZeRO in bf16 runs (tests/fixes/test_deepspeed.py trains it; nothing refuses it) and is judged by the 8-ulp
    DeepSpeed bf16 bound."""
    from pyvene_dist.testing import ParityCase
    from pyvene_dist.testing import DEEPSPEED_BF16, TOLERANCES, tolerance

    monkeypatch.setattr(check, "gpu_count", lambda: 0)
    assert check.reason("zero2", 2) is None and check.reason("zero3", 2) is None
    bf16, fp32 = ParityCase(dtype="bfloat16"), ParityCase()
    assert tolerance(bf16, "zero3") == DEEPSPEED_BF16 and DEEPSPEED_BF16.rtol == 2 * TOLERANCES[torch.bfloat16].rtol
    assert tolerance(bf16, "ddp") == TOLERANCES[torch.bfloat16] and tolerance(fp32, "zero3") == TOLERANCES[torch.float32]


@pytest.mark.parametrize("strategies, sizes, gpus, message", [
    (["ddp", "bogus"], [2], 0, "unknown strategy bogus; known: ddp, "),
    (["ddp"], [2, 4], 2, "--world-sizes 4: this machine has 2 GPUs (one rank per GPU)"),
    (["ddp"], [MORE_RANKS_THAN_ANY_MACHINE], 0, f"--world-sizes {MORE_RANKS_THAN_ANY_MACHINE}: this machine has "),
    (["fsdp1"], [2], 0, "none of the strategies asked for can run here: fsdp1 x2 needs 2 GPUs, found 0"),
    (["single"], [2], 0, "no strategy to compare with single"),
])
def test_usage_mistakes_are_refused_before_anything_runs(monkeypatch, strategies, sizes, gpus, message):
    monkeypatch.setattr(check, "gpu_count", lambda: gpus)
    with pytest.raises(check.UsageError) as raised:
        check.validate(strategies, sizes)
    assert message in str(raised.value)


def test_the_batch_grows_to_split_evenly_over_every_world_size(monkeypatch):
    monkeypatch.setattr(check, "gpu_count", lambda: 0)
    assert check.batch_size(CheckCase(), [1, 2]) == 8
    assert check.batch_size(CheckCase(), [3]) == 24


def test_a_differing_strategy_exits_1_and_prints_why(monkeypatch, capsys):
    import pyvene_dist
    from pyvene_dist.__main__ import main

    rows = [check.Row("single", 1, "reference"), check.Row("ddp", 2, "agrees", 0.0, 0.0, 0.0),
            check.Row("fsdp2", 2, "differs", 0.1, 0.2, 0.3, detail="final weight x differs")]
    monkeypatch.setattr(pyvene_dist, "patch", lambda: None)
    monkeypatch.setattr(check, "run", lambda *args, **kwargs: rows)
    assert main(["check", "--strategies", "ddp,fsdp2"]) == 1
    out = capsys.readouterr().out
    assert "fsdp2 x2 differs:\nfinal weight x differs" in out
    rows[2].verdict = "unavailable"
    assert main(["check", "--strategies", "ddp,fsdp2"]) == 0


def test_progress_on_a_terminal_is_one_bar_ended_before_an_error():
    import io

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    stream = Terminal()
    progress = check.Progress(stream)
    progress(1, 4, "ddp x2")
    progress.close()
    written = stream.getvalue()
    assert written.startswith("\r\033[K[#####---------------] 1/4 ") and written.endswith(" ddp x2\n"), written


def test_progress_is_one_line_per_step_off_a_terminal(tmp_path):
    with open(tmp_path / "log", "w") as stream:
        progress = check.Progress(stream)
        progress(0, 2, "single (reference)")
        progress(2, 2, "done")
    lines = (tmp_path / "log").read_text().splitlines()
    assert [line.split(" ", 1)[0] for line in lines] == ["[0/2]", "[2/2]"]
    assert lines[0].endswith("single (reference)")


@pytest.mark.slow
def test_a_rank_that_fails_or_disagrees_is_reported_with_why(patched):
    import dataclasses

    case = CheckCase(steps=2)
    reference = train(case, "single")
    failed = check._run_one(case, "no-such-strategy", 1, reference)
    assert failed.verdict == "failed" and "--- rank 0: failed" in failed.detail, failed
    assert "ValueError: strategy 'no-such-strategy' is not one of" in failed.detail, failed.detail

    shifted = dataclasses.replace(reference, losses=[loss + 1.0 for loss in reference.losses])
    differs = check._run_one(case, "ddp", 1, shifted)
    assert differs.verdict == "differs" and "per-step loss" in differs.detail, differs
    assert 0.99 < differs.loss < 1.01 and differs.grad < 1e-5, differs


# --- the command ------------------------------------------------------------------------------------------

GPU_ONLY = {"fsdp1", "fsdp1+checkpointing", "zero3-offload", "dataparallel", "device_map"}


@pytest.mark.slow
def test_the_readme_command_passes_here_within_ten_minutes():
    """`pyvene-dist check` with no options, as the README's first line runs it (the issue's CI budget)."""
    script = Path(sys.executable).with_name("pyvene-dist")
    # The console script where pip installed one (CI's .venv); scripts/gpu_checks.sh installs no scripts.
    command = [str(script)] if script.exists() else [sys.executable, "-m", "pyvene_dist"]
    result = subprocess.run([*command, "check"], capture_output=True, text=True, timeout=600)
    print(result.stdout)
    assert result.returncode == 0, result.stdout + result.stderr[-5000:]
    header, *lines = result.stdout.split("\n\n")[0].splitlines()
    rows = dict(line.split(maxsplit=1) for line in lines if not line.startswith("peak mem:"))
    assert header.split()[:2] == ["strategy", "world"] and rows.pop("single").split()[-1] == "reference"
    assert set(rows) == set(check.CHECKED)
    for name, cells in rows.items():
        if name in GPU_ONLY and not torch.cuda.is_available():
            assert cells.endswith("unavailable: needs 2 GPUs, found 0"), (name, cells)
        elif name in ("tp-fsdp2", "hsdp") and cells.split()[0] == "2":  # the default world size here
            assert cells.endswith("unavailable: needs a 2-D mesh (data x 2): an even world size of 4 or more, "
                                  "got 2"), (name, cells)
        else:
            assert cells.endswith("agrees"), (name, cells)


@pytest.mark.slow
def test_json_rows_start_with_the_reference_and_say_why_a_strategy_cannot_run():
    result = cli("--strategies", "ddp,dataparallel,device_map", "--steps", "2", "--json")
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    assert [row["strategy"] for row in rows] == ["single", "ddp", "dataparallel", "device_map"]
    assert rows[0]["verdict"] == "reference" and rows[1]["verdict"] == "agrees", rows
    assert rows[1]["loss"] < 1e-5 and rows[1]["grad"] < 1e-5 and rows[1]["peak_memory_bytes"] > 0, rows[1]
    if not torch.cuda.is_available():
        assert [(row["verdict"], row["detail"]) for row in rows[2:]] == [("unavailable", "needs 2 GPUs, found 0")] * 2


@pytest.mark.slow
def test_a_local_model_directory_is_checked_with_layers_that_fit_it(tmp_path):
    tiny_llama(layers=3, seed=5).save_pretrained(tmp_path)
    result = cli("--model", str(tmp_path), "--strategies", "ddp+checkpointing", "--steps", "2")
    assert result.returncode == 0, result.stderr
    assert f"model {tmp_path} (its weights); LoreftIntervention rank 4 at block_output of layers 0, 2" in result.stderr
    assert "ddp+checkpointing" in result.stdout and "agrees" in result.stdout
    assert "peak mem: CPU: peak resident set size" in result.stdout or torch.cuda.is_available()


@pytest.mark.parametrize("arguments, message", [
    (("--strategies", "bogus"), "pyvene-dist: unknown strategy bogus; known: ddp"),
    (("--model", "no/such/model"), "pyvene-dist: --model no/such/model: no such file or directory; expected one of"),
    (("--world-sizes", str(MORE_RANKS_THAN_ANY_MACHINE)), f"pyvene-dist: --world-sizes {MORE_RANKS_THAN_ANY_MACHINE}: "
                                                          "this machine has "),
    (("--world-sizes", "0"), "world sizes must be at least 1"),
    (("--steps", "-1"), "steps must be a positive integer, got '-1'"),
])
def test_user_mistakes_are_one_clear_line_and_exit_2(arguments, message, capsys):
    """The command's function, in this process: what it returns, or argparse's exit, is the exit code (the next test
    runs the command line itself)."""
    from pyvene_dist.__main__ import main

    try:
        code = main(["check", *arguments])
    except SystemExit as exited:  # argparse's errors: usage and one line
        code = exited.code
    stderr = capsys.readouterr().err
    assert code == 2, (code, stderr)
    assert message in stderr.strip().splitlines()[-1] and "Traceback" not in stderr, stderr


@pytest.mark.slow
def test_a_user_mistake_exits_2_from_the_command_line():
    result = cli("--strategies", "bogus", timeout=120)
    assert result.returncode == 2, (result.returncode, result.stderr)
    last = result.stderr.strip().splitlines()[-1]
    assert "pyvene-dist: unknown strategy bogus; known: ddp" in last and "Traceback" not in result.stderr, result.stderr


@pytest.mark.gpus(2)
def test_every_strategy_agrees_on_gpus():
    """The 2-GPU table: `pytest tests/cli/test_check.py -k gpus -s` prints it."""
    result = cli("--json")
    assert result.stdout.strip(), f"exit code {result.returncode}, no rows:\n{result.stderr[-5000:]}"
    rows = [check.Row(**row) for row in json.loads(result.stdout)]
    print(check.table(rows))
    assert result.returncode == 0, result.stderr[-5000:]
    verdicts = {row.strategy: row.verdict for row in rows}
    assert verdicts == {"single": "reference", **{name: "agrees" for name in check.CHECKED}}
