"""Every command in README.md and docs/ is run: here, or by the test (or setup script) the registry names.

Shell commands come from ```bash, ```sh, ```shell and ```console blocks (console: the lines after `$ `),
split at `&&` and `;`, comments dropped. Each is either

- in ``RUN_HERE``: this file runs it, from the repository root, with the virtual environment's
  ``bin`` first on ``PATH``, and checks its exit code; or
- in ``RUN_BY``: the test that runs it. The named file must define that test, contain every file name
  the command mentions (scripts, config files) and the ``evidence`` given, and a command that needs
  GPUs must name a test marked ``@pytest.mark.gpus``, so the registry cannot rot.

An unregistered command fails, naming its file and line: register it (or run it here) when you add it.
Python blocks: a block whose first line is ``# <path>`` must equal that file; a block that is a complete
program (no name it does not define, no ``...``) is run (with pytest when it defines tests); the
others are fragments of the pages' prose and are not run. Config files: every file in docs/configs/
is one a test uses, and every one the docs name exists.
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
import json
import os
import re
import subprocess
import symtable
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
SHELL = {"bash", "sh", "shell", "console"}
TEST_ENV = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
            "OMP_NUM_THREADS": "1"}


@dataclasses.dataclass(frozen=True)
class RunBy:
    """``where``: ``tests/<file>.py::<test>[<param id>]`` or a script CI runs (``scripts/setup.sh``)."""

    where: str
    evidence: tuple[str, ...] = ()
    gpus: int = 0
    note: str = ""


CI = RunBy("scripts/setup.sh", note="CI runs `bash scripts/setup.sh && .venv/bin/python -m pytest`")
LAUNCHERS = "tests/strategies/test_launchers.py::test_torchrun_pyreft_trainer_matches_one_process"
ACCELERATE_LAUNCH = "tests/strategies/test_accelerate.py::test_accelerate_launch_with_the_documented_config"
#: The full check runs every strategy, each as `--strategies <name>` alone would (the test asserts every row).
DEFAULT_CHECK = RunBy("tests/cli/test_check.py::test_the_readme_command_passes_here_within_ten_minutes",
                      ("set(rows) == set(check.CHECKED)",))
GPU_CHECK = RunBy("tests/cli/test_check.py::test_every_strategy_agrees_on_gpus",
                  ('{name: "agrees" for name in check.CHECKED}',), gpus=2)
UPSTREAM_SERIES = "tests/upstream/test_upstream_patches.py::test_series_applies_with_no_fuzz_offset_or_reject"
BENCHMARK_NOTE = "a benchmark run by hand on GPUs (docs/benchmarks.md); the smoke test runs the same script on CPU"
#: The `pyvene-dist eval` lines of docs/evaluation.md, run in each rank of a world of 2 CPU processes (the
#: environment torchrun and accelerate launch give their processes).
EVALUATION_LAUNCH = ("tests/evaluation/test_lm_eval_reft.py::"
                     "test_two_ranks_score_their_shares_and_over_a_sharded_base_agree_with_one")
#: benchmarks/mixed_refts.py's smoke mode, run in process by the serving tests.
MIXED_REFTS = "tests/test_serving.py::test_the_benchmark_smoke_writes_every_provider"
#: benchmarks/continuous_refts.py's smoke mode, run in process by the continuous batching tests.
CONTINUOUS_REFTS = "tests/test_continuous_batching.py::test_the_benchmark_smoke_writes_every_provider"
OPENAI_SERVER = "tests/test_openai_server.py"
MATRIX_NOTE = ("the version matrix, run by hand (a venv per column: minutes and GBs each); its rows are in "
               "benchmarks/results/version-matrix.jsonl and tests/packaging/test_version_matrix.py tests its parts")

#: Commands this file runs, with the exit code they must give.
RUN_HERE: dict[str, int] = {
    "pyvene-dist check --strategies ddp,fsdp2 --world-sizes 1,2 --steps 2": 0,
    "pyvene-dist check --model gpt2 --dtype bfloat16 --strategies ddp --json": 0,
}

#: docs/examples/train_reft.py on a checkpoint folder, under each launcher (tests/strategies/test_launchers.py).
TRAIN_REFT = "tests/strategies/test_launchers.py::test_train_reft_under_a_launcher_matches_one_process"
_REFT_ARGS = "--model path/to/model --data train.json --output_dir out"
_TWO_NODES = ("torchrun --nnodes 2 --nproc_per_node 1 --node_rank {} --rdzv_backend c10d --rdzv_endpoint localhost:29500 "
              "docs/examples/train_reft.py " + _REFT_ARGS)
_ZERO3_ARGS = _REFT_ARGS + " --deepspeed docs/configs/deepspeed-zero3.json"
_DEEPSPEED_TWO_NODES = ("deepspeed --hostfile hostfile --no_ssh --node_rank {} --master_addr 127.0.0.1 "
                        "--master_port 29500 docs/examples/train_reft.py " + _ZERO3_ARGS)
TRAIN_REFT_COMMANDS: dict[str, RunBy] = {
    f"python docs/examples/train_reft.py {_REFT_ARGS}": RunBy("tests/strategies/test_launchers.py::"
                                                             "test_one_process_logs_saves_and_answers",
                                                             ("train_reft_each.py", '"one-process")]')),
    f"torchrun --nproc_per_node 2 docs/examples/train_reft.py {_REFT_ARGS}":
        RunBy(TRAIN_REFT, ('"--nproc_per_node", "2"', '"torchrun": _torchrun')),
    **{_TWO_NODES.format(rank): RunBy(TRAIN_REFT, ('"--nnodes", "2"', '"--rdzv_backend", "c10d"', "localhost:"))
       for rank in (0, 1)},
    **{f"accelerate launch --config_file docs/configs/accelerate-{name}.yaml docs/examples/train_reft.py {_REFT_ARGS}":
       RunBy(TRAIN_REFT, (f'_accelerate("accelerate-{name}.yaml")', "accelerate.commands.launch"))
       for name in ("ddp", "fsdp2", "zero2", "zero3", "zero3-offload")},
    f"deepspeed --num_gpus 2 docs/examples/train_reft.py {_ZERO3_ARGS}":
        RunBy(TRAIN_REFT, ('"deepspeed": _deepspeed', '"deepspeed.launcher.runner", "--num_gpus", "2"', "*ZERO3")),
    **{_DEEPSPEED_TWO_NODES.format(rank): RunBy(TRAIN_REFT, (
        '"deepspeed-2-nodes": _deepspeed_two_nodes', '"--no_ssh", "--node_rank", str(rank)',
        '"--master_addr", "127.0.0.1"', "localhost slots=1\\n127.0.0.1 slots=1\\n")) for rank in (0, 1)},
    'python docs/examples/serve_reft.py --interventions out/reft --prompt "red cat runs"':
        RunBy("tests/strategies/test_launchers.py::test_reloaded_interventions_answer_as_the_trained_model",
              ("serve_each.py", "PROMPT = \"red cat runs\"", "str(out), PROMPT, *folders.values()"),
              note="serve_each.py runs serve_reft.py's settings, load and answer, for each trained folder, in one "
                   "process"),
}

#: The README's "Try it on CPU" example, run in order by one test.
README_EXAMPLE = RunBy("tests/docs/test_readme.py::test_the_readme_example_trains_saves_and_reloads_on_cpu",
                       ("example_commands()", "tiny-model", "serve_reft.py", "instructions.json"))

#: Commands other tests (or CI's setup) run.
RUN_BY: dict[str, RunBy] = {
    **TRAIN_REFT_COMMANDS,
    ".venv/bin/pyvene-dist tiny-model out/tiny-llama": README_EXAMPLE,
    ".venv/bin/torchrun --nproc_per_node 2 docs/examples/train_reft.py --model out/tiny-llama --data "
    "docs/examples/data/instructions.json --positions f1+l1 --output_dir out/run --use_cpu --max_steps 12 "
    "--learning_rate 4e-3": README_EXAMPLE,
    '.venv/bin/python docs/examples/serve_reft.py --interventions out/run/reft --prompt "What colour is snow?"':
        README_EXAMPLE,
    "pyvene-dist fixes": RunBy("tests/cli/test_cli.py::test_fixes_lists_every_fix_applied_here_with_its_ranges",
                               ('run(capsys, "fixes")',)),
    **{command: RunBy("tests/workloads/test_example_scripts.py::test_alpaca_train_under_torchrun_matches_one_process",
                      evidence) for command, evidence in (
        ('python docs/examples/run_pyreft_example.py path/to/pyreft/examples/alpaca/train.py --model_name_or_path path/to/model --data_path alpaca_data.json --output_dir out --layers "0;1" --position f1+l1 --gradient_accumulation_steps 2', ("WRAPPER", "nproc > 1")),
        ('torchrun --nproc_per_node 2 docs/examples/run_pyreft_example.py path/to/pyreft/examples/alpaca/train.py --model_name_or_path path/to/model --data_path alpaca_data.json --output_dir out --layers "0;1" --position f1+l1 --gradient_accumulation_steps 2', ('"--nproc_per_node", str(nproc)',)))},
    "bash scripts/setup.sh": CI,
    ".venv/bin/python -m pytest": CI,
    "pip install torch": RunBy("scripts/setup.sh", ("pip install", "torch==")),
    'pip install -e ".[reft,accelerate]"':
        RunBy("tests/packaging/test_packaging.py::test_the_wheel_installs_with_each_extra_and_lists_the_fixes",
              ('"reft"', '"accelerate"', 'f"{wheel}[{extra}]"'),
              note="the wheel, with each extra; setup.sh installs the test extra"),
    "pip install --no-deps pyreft==0.1.0": RunBy("scripts/setup.sh", ("pip install --no-deps pyreft==0.1.0",)),
    ".venv/bin/pyvene-dist check": dataclasses.replace(DEFAULT_CHECK, evidence=('"pyvene-dist"', '"check"')),
    "pyvene-dist check": dataclasses.replace(DEFAULT_CHECK, evidence=('"pyvene-dist"', '"check"')),
    "pyvene-dist plan --model path/to/model --gpus 8 --nodes 2 --batch 8 --seq-len 1024":
        RunBy("tests/cli/test_plan.py::test_the_command_prints_every_strategy_and_whether_it_fits",
              ('"--model", str(config_folder)', '"--gpus"', '"--batch"', '"--seq-len"')),
    "pyvene-dist plan --model llama-1b --gpus 2 --batch 8 --seq-len 512 --layers 2,8":
        RunBy("tests/cli/test_plan.py::test_the_documented_table_is_what_plan_prints", ('"plan.md"',)),
    "pyvene-dist plan --model path/to/Llama-2-70b-hf --gpus 2 --quantize 4bit --gpu-memory 24 --batch 1 --seq-len 512":
        RunBy("tests/cli/test_plan_quantized.py::test_a_4bit_70b_fits_two_24_gb_gpus_with_fsdp2_and_offload",
              ('"--model", str(config)', '"--quantize", "4bit"', '"--gpu-memory", "24"', '"--seq-len", "512"')),
    "pyvene-dist check --quantize 4bit":
        RunBy("tests/strategies/test_quantized.py::test_check_quantize_4bit_agrees_here", ('"--quantize", "4bit"',),
              note="with --strategies fsdp2 --steps 2 (CI's time); docs/quantized.md shows a whole run"),
    "pyvene-dist check --model path/to/model --strategies ddp":
        RunBy("tests/cli/test_check.py::test_a_local_model_directory_is_checked_with_layers_that_fit_it",
              ('"--model", str(tmp_path)', '"--strategies"')),
    "pyvene-dist check --strategies ddp,ddp+checkpointing": DEFAULT_CHECK,
    "pyvene-dist check --strategies fsdp2,fsdp2+checkpointing,fsdp1,fsdp1+checkpointing": DEFAULT_CHECK,
    "pyvene-dist check --strategies accelerate": DEFAULT_CHECK,
    "pyvene-dist check --strategies tp,tp-fsdp2,hsdp": DEFAULT_CHECK,
    "python -m pytest tests/fixes/test_tensor_parallel.py": RunBy("tests/fixes/test_tensor_parallel.py",
                                                            note="CI's pytest run includes this file"),
    "bash scripts/gpu_checks.sh tests/fixes/test_tensor_parallel.py -k one_gpu":
        RunBy("tests/fixes/test_tensor_parallel.py::test_tensor_parallel_of_one_gpu_matches_one_gpu",
              ("scripts/gpu_checks.sh",), gpus=1),
    "pyvene-dist check --strategies dataparallel": GPU_CHECK,
    "pyvene-dist check --strategies device_map": GPU_CHECK,
    "torchrun --nproc_per_node 2 tests/scripts/train_with_trainer.py /tmp/record.pt":
        RunBy(LAUNCHERS, ('"--nproc_per_node", str(nproc)', "trainer_runs(2, trainer)")),
    "CUDA_VISIBLE_DEVICES=0,1 python tests/scripts/train_with_trainer.py /tmp/record.pt --trainer ReftTrainer":
        RunBy("tests/fixes/test_data_parallel.py::test_hf_trainer_data_parallel_matches_one_gpu",
              ('"0,1"', '"--trainer"', "CUDA_VISIBLE_DEVICES"), gpus=2),
    "torchrun --nproc_per_node 2 tests/scripts/train_with_trainer.py /tmp/record.pt --fsdp 2":
        RunBy("tests/strategies/test_launchers.py::test_torchrun_hf_trainer_fsdp_matches_one_process",
              ('"--fsdp", str(version)', "[2, 1]"), gpus=2),
    "accelerate launch --config_file docs/configs/accelerate-ddp.yaml tests/scripts/train_with_accelerate.py /tmp/r.pt":
        RunBy(ACCELERATE_LAUNCH, ("accelerate.commands.launch", "--config_file"), gpus=2),
    "accelerate launch --config_file docs/configs/accelerate-fsdp2.yaml tests/scripts/train_with_accelerate.py "
    "/tmp/r.pt": RunBy(ACCELERATE_LAUNCH, ("accelerate.commands.launch", "--config_file"), gpus=2),
    "ACCELERATE_USE_CPU=1 torchrun --nproc_per_node 2 tests/scripts/train_with_accelerate.py /tmp/r.pt":
        RunBy("tests/strategies/test_accelerate.py::test_accelerate_script_under_torchrun",
              ('"ACCELERATE_USE_CPU": "1"', '"--nproc_per_node", "2"')),
    "python scripts/upstream_patches.py apply /tmp/up": RunBy(UPSTREAM_SERIES, ('"apply"',)),
    'PYTHONPATH=/tmp/up python -c "import pyvene; print(sorted(pyvene.FIXES))"':
        RunBy(UPSTREAM_SERIES, ('print(sorted({package}.FIXES))', '"PYTHONPATH"')),
    "for diff in $(grep -v '^#' /path/to/pyvene_dist/fixes/pyvene/series); do patch -p1 --fuzz=0 < "
    "/path/to/pyvene_dist/fixes/pyvene/$diff || break; done":
        RunBy("scripts/upstream_patches.py", ('"patch", "-p1", "--fuzz=0"', "series"),
              note="the script applies each diff of the series this way; tests/upstream/test_upstream_patches.py runs it"),
    ".venv/bin/python -m pytest tests/upstream/test_upstream_patches.py": RunBy("tests/upstream/test_upstream_patches.py", note="CI's "
                                                                       "pytest run includes this file"),
    "python benchmarks/scaling.py --strategies ddp,fsdp2,zero2,zero3 --world-sizes 1,2 --model llama-1b":
        RunBy("tests/benchmarks/test_benchmarks.py::test_scaling_smoke_writes_rows_and_profiles",
              ('"--strategies", "ddp,fsdp2,zero3"',), note=BENCHMARK_NOTE),
    "python benchmarks/scaling.py --strategies ddp,zero2,zero3,zero3-offload --world-sizes 2 --model llama-1b "
    "--checkpointing non-reentrant --zero '{\"stage3_max_live_parameters\": 3e7, \"stage3_max_reuse_distance\": 0, "
    "\"stage3_prefetch_bucket_size\": 3e7, \"reduce_bucket_size\": 5e6}'":
        RunBy("tests/benchmarks/test_benchmarks.py::test_scaling_smoke_takes_deepspeed_memory_settings",
              ('"--zero"', "stage3_max_live_parameters"), note=BENCHMARK_NOTE),
    "python benchmarks/overhead.py":
        RunBy("tests/benchmarks/test_benchmarks.py::test_overhead_smoke_writes_every_provider", note=BENCHMARK_NOTE),
    "python benchmarks/scaling.py --smoke":
        RunBy("tests/benchmarks/test_benchmarks.py::test_scaling_smoke_writes_rows_and_profiles", ('"--smoke"',)),
    **{command: RunBy("scripts/version_matrix.py", evidence, note=MATRIX_NOTE) for command, evidence in (
        (".ci/matrix", ('default="oldest,newest,pyreft-main"',)),
        (".ci/matrix --columns newest --reuse", ('"--reuse"',)),
        (".ci/matrix --columns pinned", ('Column("pinned"',)))},
    "python scripts/without_sweep.py": RunBy("tests/packaging/test_without_sweep.py::test_a_fixs_tests_fail_without_it",
                                             ("sweep.sweep_one(",), note="one fix's sweep; the whole sweep on demand"),
    ".ci/matrix --table":
        RunBy("tests/packaging/test_version_matrix.py::test_the_testing_page_shows_what_the_table_option_prints",
              ('".ci" / "matrix"), "--table"',)),
    "python benchmarks/overhead.py --smoke":
        RunBy("tests/benchmarks/test_benchmarks.py::test_overhead_smoke_writes_every_provider", ('"--smoke"',)),
    "pyvene-dist serve --reft poet=out/poet/reft --reft coder=out/coder/reft --port 8000":
        RunBy(f"{OPENAI_SERVER}::test_the_openai_client_gets_each_reft_as_alone", ("serving_server",),
              note="started as `python -m pyvene_dist serve` on a free port of the loopback with three ReFT folders "
                   "(tests/conftest.py's serving_server, once per session)"),
    **{command: RunBy(f"{OPENAI_SERVER}::test_the_pages_curl_lines_answer", ('"curl "',),
                      note="the page's curl lines against the test's server, its ReFTs for poet and coder")
       for command in (
           "curl -s localhost:8000/v1/completions -H 'Content-Type: application/json' -d '{\"model\": \"poet\", "
           "\"prompt\": \"Write about snow\", \"max_tokens\": 16}'",
           "curl -s localhost:8000/v1/chat/completions -H 'Content-Type: application/json' -d '{\"model\": \"coder\", "
           "\"messages\": [{\"role\": \"user\", \"content\": \"Add 2 and 2\"}]}'",
           "curl -s localhost:8000/v1/models")},
    "python benchmarks/continuous_refts.py --smoke": RunBy(CONTINUOUS_REFTS, ('"--smoke"',)),
    **{f"OMP_NUM_THREADS=1 python benchmarks/continuous_refts.py --model tiny --requests 64 --prompt-len 32 "
       f"--new-tokens 16 --rounds 9 --max-batch-tokens 512{mode} --out benchmarks/results/continuous-refts-cpu.jsonl":
       RunBy(CONTINUOUS_REFTS, ('"--smoke"',), note=BENCHMARK_NOTE) for mode in ("", " --every-token")},
    **{f"python benchmarks/continuous_refts.py{mode} --out benchmarks/results/continuous-refts-1xH100.jsonl":
       RunBy(CONTINUOUS_REFTS, ('"--smoke"',), note=BENCHMARK_NOTE) for mode in ("", " --every-token")},
    "python benchmarks/mixed_refts.py --smoke": RunBy(MIXED_REFTS, ('"--smoke"',)),
    "python benchmarks/evaluation.py --device cuda --hidden 2048 --layers 16 --documents 512 --batch-size 32 "
    "--rounds 3 --out benchmarks/results/evaluation-1xH100.jsonl":
        RunBy("benchmarks/evaluation.py", ('"--device"', '"--hidden"'),
              note="a benchmark run by hand on a GPU; its CPU rows are in benchmarks/results/evaluation-cpu.jsonl"),
    "pyvene-dist eval --model reft --model_args reft=out/run/reft --tasks hellaswag --batch_size 8":
        RunBy(EVALUATION_LAUNCH, ('main(["eval", "--model", "reft"', '"--batch_size"'),
              note="pyvene_dist.__main__.main, the entry point's function, in each of 2 ranks, with the test's local tasks"),
    "accelerate launch --config_file docs/configs/accelerate-ddp.yaml -m pyvene_dist eval --model reft "
    "--model_args reft=out/run/reft --tasks hellaswag --batch_size 8 --output_path results --log_samples":
        RunBy(EVALUATION_LAUNCH, ('"--output_path"', '"--log_samples"'),
              note="the command in each rank of a world of 2 with the environment the launcher gives (the launcher "
                   "itself: tests/strategies/test_accelerate.py), with the test's local tasks"),
    "torchrun --nproc_per_node 2 -m pyvene_dist eval --model reft --model_args reft=out/run/reft --tasks hellaswag "
    "--batch_size 8 --device cpu --output_path results --log_samples":
        RunBy(EVALUATION_LAUNCH, ('"--device", "cpu"', '"--output_path"'),
              note="the command in each rank of a world of 2 with torchrun's environment (testing.launch); the "
                   "torchrun line itself was run by hand on the CPU machine"),
    "HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 pyvene-dist eval --model reft --model_args reft=out/run/reft "
    "--tasks words_mc --include_path my_tasks":
        RunBy(EVALUATION_LAUNCH, ('HF_DATASETS_OFFLINE="1"', '"--include_path"'),
              note="the test's tasks are such a folder: a YAML file each and one JSON file"),
    **{f"OMP_NUM_THREADS=1 python benchmarks/mixed_refts.py --model tiny --prompt-len 16 --new-tokens 16 --rounds 15"
       f"{mode} --out benchmarks/results/mixed-refts-cpu.jsonl": RunBy(MIXED_REFTS, ('"--smoke"',), note=BENCHMARK_NOTE)
       for mode in ("", " --every-token")},
    **{f"python benchmarks/mixed_refts.py{mode} --out benchmarks/results/mixed-refts-1xH200.jsonl":
       RunBy(MIXED_REFTS, ('"--smoke"',), note=BENCHMARK_NOTE) for mode in ("", " --every-token")},
}

#: Every file in docs/configs/, and the test that uses it (its file must name it).
CONFIGS = {
    "accelerate-ddp.yaml": ACCELERATE_LAUNCH,
    "accelerate-fsdp2.yaml": ACCELERATE_LAUNCH,
    "accelerate-zero2.yaml": TRAIN_REFT,
    "accelerate-zero3.yaml": TRAIN_REFT,
    "accelerate-zero3-offload.yaml": TRAIN_REFT,
    "deepspeed-zero2.json": "tests/docs/test_docs.py::test_deepspeed_configs_carry_the_measured_settings",
    "deepspeed-zero3.json": "tests/strategies/test_launchers.py::test_zero3_loads_the_checkpoint_partitioned",
    "deepspeed-zero3-offload.json": "tests/docs/test_docs.py::test_deepspeed_configs_carry_the_measured_settings",
}


# --- reading the pages -----------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the first line inside the fence
    language: str
    text: str

    @property
    def where(self) -> str:
        return f"{_shown(self.page)}:{self.line}"


def _shown(page: Path) -> str:
    return str(page.relative_to(ROOT)) if page.is_relative_to(ROOT) else str(page)


def blocks(page: Path) -> list[Block]:
    found, fence, start, language, lines = [], None, 0, "", []
    for number, line in enumerate(page.read_text().splitlines(), start=1):
        stripped = line.strip()
        if fence is None and stripped.startswith("```"):
            fence, start, language, lines = stripped[:3], number + 1, stripped[3:].split(" ")[0].strip(), []
        elif fence is not None and stripped == fence:
            found.append(Block(page, start, language, "\n".join(lines) + "\n"))
            fence = None
        elif fence is not None:
            lines.append(line)
    return found


def shell_commands(block: Block) -> list[tuple[str, str]]:
    """(where, command) for every command in a shell block: lines joined at a trailing backslash and
    over a compound command (``for ... done``, ``if ... fi``), then split at ``&&`` and ``;`` outside
    quotes and compound commands; comments dropped; whitespace collapsed."""
    commands, pending, first_line, depth = [], "", 0, 0
    for offset, line in enumerate(block.text.splitlines()):
        if block.language == "console":
            if not line.startswith("$ ") and not pending:
                continue
            line = line[2:] if line.startswith("$ ") else line
        line = _strip_comment(line).rstrip()
        if not line and not pending:
            continue
        first_line = first_line if pending else block.line + offset
        words = line.replace(";", " ; ").split()
        depth += sum(word in ("for", "while", "until", "if", "case") for word in words[:1] + [
            after for before, after in zip(words, words[1:]) if before in (";", "&&", "do", "then")])
        depth -= sum(word in ("done", "fi", "esac") for word in words)
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        if depth > 0:
            pending += line + (" " if line.endswith(("do", "then", "else")) else "; ")
            continue
        text = pending + line
        parts = [text] if pending.strip() and re.match(r"(for|while|until|if|case)\b", pending.strip()) \
            else _split(text)
        where = f"{_shown(block.page)}:{first_line}"
        commands.extend((where, " ".join(part.split())) for part in parts if part.strip())
        pending, depth = "", 0
    return commands


def _strip_comment(line: str) -> str:
    quote = None
    for index, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (index == 0 or line[index - 1].isspace()):
            return line[:index]
    return line


def _split(text: str) -> list[str]:
    """``text`` split at ``&&`` and ``;`` outside quotes."""
    parts, current, quote, index = [], "", None, 0
    while index < len(text):
        char = text[index]
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == ";" or text.startswith("&&", index):
            parts.append(current)
            current, index = "", index + (2 if char == "&" else 1)
            continue
        current += char
        index += 1
    return parts + [current]


def all_commands() -> list[tuple[str, str]]:
    return [found for page in PAGES for block in blocks(page) if block.language in SHELL
            for found in shell_commands(block)]


def python_blocks() -> list[Block]:
    return [block for page in PAGES for block in blocks(page) if block.language == "python"]


def undefined_names(source: str) -> set[str]:
    """Names a program reads but neither defines, imports nor gets from builtins (empty: it is complete)."""
    top = symtable.symtable(source, "<doc>", "exec")
    defined = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported() or s.is_namespace()}
    missing = set()

    def visit(table) -> None:
        for symbol in table.get_symbols():
            global_read = table is top or symbol.is_global()
            if symbol.is_referenced() and global_read and symbol.get_name() not in defined:
                missing.add(symbol.get_name())
        for child in table.get_children():
            visit(child)

    visit(top)
    return {name for name in missing if not hasattr(builtins, name)}


def is_complete(block: Block) -> bool:
    try:
        tree = ast.parse(block.text)
    except SyntaxError:
        return False
    ellipsis = any(isinstance(node, ast.Constant) and node.value is Ellipsis for node in ast.walk(tree))
    return not ellipsis and not undefined_names(block.text)


def copied_file(block: Block) -> Path | None:
    first = block.text.splitlines()[0] if block.text.strip() else ""
    return ROOT / first[2:].strip() if first.startswith("# ") and (ROOT / first[2:].strip()).is_file() else None


# --- the tests ----------------------------------------------------------------------------------------------

def test_every_command_is_run_here_or_by_a_named_test():
    commands = all_commands()
    assert any(command == ".venv/bin/pyvene-dist check" for _, command in commands)  # the reader found the README's
    unregistered = [f"{where}: {command}" for where, command in commands if command not in RUN_HERE | RUN_BY]
    assert not unregistered, ("commands in the docs that no test runs; add each to RUN_HERE or RUN_BY in "
                              "tests/docs/test_docs.py:\n" + "\n".join(unregistered))


def test_registered_commands_are_still_in_the_docs():
    documented = {command for _, command in all_commands()}
    stale = sorted((set(RUN_HERE) | set(RUN_BY)) - documented)
    assert not stale, f"registered but in no page any more (remove them): {stale}"


@pytest.mark.parametrize("command", sorted(RUN_BY))
def test_the_named_test_runs_the_command(command):
    run_by = RUN_BY[command]
    path, _, test = run_by.where.partition("::")
    source = (ROOT / path).read_text()
    if test:
        name, _, param = test.partition("[")
        assert re.search(rf"^def {name}\(", source, re.M), f"{path} defines no {name} (registered for {command!r})"
        if param:
            assert f'id="{param.rstrip("]")}"' in source, f"{path} has no parameter id {param} ({command!r})"
    for token in command.split():
        if "/" in token and not token.startswith(".venv/") and (ROOT / token).is_file() and token != path:
            assert Path(token).name in source, f"{path} never names {Path(token).name}, which {command!r} runs"
    for evidence in run_by.evidence:
        assert evidence in source, f"{path} does not contain {evidence!r}, the sign that it runs {command!r}"
    if run_by.gpus:
        assert _gpu_marked(source, test, run_by.gpus), f"{run_by.where} is not marked @pytest.mark.gpus({run_by.gpus})"
    elif test:
        assert not _gpu_marked(source, test, 1, any_count=True), f"{run_by.where} needs GPUs: register it with gpus="


def _gpu_marked(source: str, test: str, gpus: int, any_count: bool = False) -> bool:
    name, _, param = test.partition("[")
    pattern = r"pytest\.mark\.gpus\(\d+\)" if any_count else rf"pytest\.mark\.gpus\({gpus}\)"
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef) and node.name == name:
            if any(re.search(pattern, ast.unparse(decorator)) for decorator in node.decorator_list):
                return True
    line = next((line for line in source.splitlines() if param and f'id="{param.rstrip("]")}"' in line), "")
    return bool(re.search(pattern, line))


@pytest.mark.slow
@pytest.mark.parametrize("command", sorted(RUN_HERE))
def test_the_command_runs_here(command, tmp_path):
    from pyvene_dist.testing.launch import free_port

    env = {**TEST_ENV, "PET_MASTER_PORT": str(free_port())}  # torchrun's --master_port, so runs never collide
    result = subprocess.run(command, shell=True, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == RUN_HERE[command], (
        f"{command!r} exited {result.returncode}, expected {RUN_HERE[command]}:\n{result.stdout[-3000:]}\n"
        f"{result.stderr[-5000:]}")


@pytest.mark.parametrize("block", [b for b in python_blocks() if copied_file(b)], ids=lambda b: b.where)
def test_a_block_naming_a_file_is_that_file(block):
    path = copied_file(block)
    body = block.text.split("\n", 1)[1]
    assert body == path.read_text(), f"{block.where} is not {path.relative_to(ROOT)} any more: copy it again"
    assert any(str(path.relative_to(ROOT)) in command for command in RUN_HERE | RUN_BY), f"nothing runs {path}"


@pytest.mark.slow
@pytest.mark.parametrize("block", [b for b in python_blocks() if is_complete(b) and not copied_file(b)],
                         ids=lambda b: b.where)
def test_a_complete_python_example_runs(block, tmp_path):
    program = tmp_path / ("test_example.py" if re.search(r"^def test_", block.text, re.M) else "example.py")
    program.write_text(block.text)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(program)] \
        if program.name.startswith("test_") else [sys.executable, str(program)]
    result = subprocess.run(command, cwd=tmp_path, env=TEST_ENV, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, (f"the example at {block.where} failed:\n{result.stdout[-3000:]}\n"
                                    f"{result.stderr[-3000:]}")
    if program.name.startswith("test_"):
        summary = result.stdout.strip().splitlines()[-1]
        assert " passed" in summary and "skipped" not in summary, f"the example at {block.where}: {summary}"


def test_the_fragment_rule_tells_programs_from_fragments():
    block = lambda text: Block(ROOT / "README.md", 1, "python", text)  # noqa: E731
    assert is_complete(block("import os\nprint(os.sep)\n"))
    assert is_complete(block("import pytest\n\ndef test_x():\n    assert pytest\n"))
    assert not is_complete(block("trainer.train()\n"))
    assert not is_complete(block("TrainingArguments(..., fsdp=True)\n"))
    assert not is_complete(block("def f():\n    return model\n"))


def test_the_command_reader_finds_what_a_reader_would_type(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("```bash\nbash a.sh && b --x 1    # both\nc \\\n  --y 2\n```\n"
                    "```console\n$ d --z; e\noutput line\n```\n```python\nnot_a_command\n```\n"
                    "```sh\nf -c \"import a; print(1)\" # x  # comment\n"
                    "for x in $(ls); do\n  echo $x || break\ndone\n```\n")
    found = [found for block in blocks(page) if block.language in SHELL for found in shell_commands(block)]
    assert found == [(f"{page}:2", "bash a.sh"), (f"{page}:2", "b --x 1"), (f"{page}:3", "c --y 2"),
                     (f"{page}:7", "d --z"), (f"{page}:7", "e"), (f"{page}:14", 'f -c "import a; print(1)"'),
                     (f"{page}:15", "for x in $(ls); do echo $x || break; done")]


def test_config_files_are_the_ones_the_tests_use():
    present = {path.name for path in (ROOT / "docs" / "configs").iterdir()}
    assert present == set(CONFIGS), f"docs/configs/ holds {sorted(present)}; CONFIGS names {sorted(CONFIGS)}"
    for name, where in CONFIGS.items():
        path, _, test = where.partition("::")
        source = (ROOT / path).read_text()
        assert name in source and re.search(rf"^def {test}\(", source, re.M), f"{where} does not use {name}"
    named = {match for page in PAGES for match in re.findall(r"docs/configs/[\w.-]+|configs/[\w.-]+\.(?:yaml|json)",
                                                              page.read_text())}
    missing = sorted(name for name in named if not (ROOT / "docs" / "configs" / Path(name).name).is_file())
    assert not missing, f"the docs name config files that do not exist: {missing}"


@pytest.mark.parametrize("name, stage", [("deepspeed-zero2.json", "2"), ("deepspeed-zero3.json", "3"),
                                         ("deepspeed-zero3-offload.json", "3-offload")])
def test_deepspeed_configs_carry_the_measured_settings(name, stage):
    """The tests' config (what every DeepSpeed test trains with), plus the memory settings behind the figures in
    docs/strategies/deepspeed.md (its JSON block, the ones that apply at the stage)."""
    from pyvene_dist.testing.hf import deepspeed_config

    shipped = json.loads((ROOT / "docs" / "configs" / name).read_text())
    page = (ROOT / "docs" / "strategies" / "deepspeed.md").read_text()
    measured = json.loads(re.search(r"```json\n(\{\"zero_optimization\": \{\"stage\": 3.*?)```", page, re.S)
                          .group(1))["zero_optimization"]
    expected = deepspeed_config(stage)
    expected["zero_optimization"].update({key: value for key, value in measured.items()
                                          if key != "stage" and (stage != "2" or not key.startswith("stage3_"))})
    assert shipped == expected


def test_every_page_is_linked_from_the_index():
    index = (ROOT / "docs" / "index.md").read_text()
    pages = [page.relative_to(ROOT / "docs").as_posix() for page in PAGES[1:] if page.name != "index.md"]
    unlinked = [page for page in pages if f"]({page})" not in index and f"]({page}#" not in index]
    assert not unlinked, f"docs/index.md links no {unlinked}"
    assert "](docs/quickstart.md)" in (ROOT / "README.md").read_text()


def test_the_patch_page_names_every_fix_and_what_it_wraps():
    """docs/patches.md has a row per fix of ``patch()``, naming every symbol the fix's record lists."""
    from pyvene_dist.fixes import fixes

    rows: dict[str, str] = {}
    for line in (ROOT / "docs" / "patches.md").read_text().splitlines():
        found = re.match(r"\| `(\w+)`( \(cont\.\))? \|", line)
        if found:
            rows[found.group(1)] = rows.get(found.group(1), "") + line
    assert sorted(rows) == sorted(fix.name for fix in fixes()), "docs/patches.md's rows are not the fixes"
    for fix in fixes():
        unnamed = [site.path for site in fix.sites if site.attribute not in rows[fix.name]]
        assert not unnamed, f"docs/patches.md's row for {fix.name!r} does not name {unnamed}"


def test_the_upstreaming_tables_follow_the_records():
    """docs/upstreaming.md: the runtime-only table has a row per fix without an upstream diff, and each
    diff's "depends on" names every fix its record requires."""
    from pyvene_dist.fixes import fixes

    note = (ROOT / "docs" / "upstreaming.md").read_text()
    runtime_table = note.split("### What stays runtime-only")[1].split("\n#")[0]
    runtime_rows = set(re.findall(r"^\| `(\w+)` \|", runtime_table, re.MULTILINE))
    assert runtime_rows == {fix.name for fix in fixes() if not fix.upstream}
    for fix in fixes():
        diff_rows = [line for line in note.splitlines() if re.match(rf"\| \w+ \| `{fix.name}\.diff` \|", line)]
        assert len(diff_rows) == len(fix.upstream), f"docs/upstreaming.md lists {len(diff_rows)} diffs of {fix.name!r}"
        for required in fix.requires if fix.upstream else ():  # a runtime-only fix has no diff to name it
            assert any(f"{required}.diff" in row.rsplit("|", 2)[-2] for row in diff_rows), (
                f"docs/upstreaming.md: no diff of {fix.name!r} says it depends on {required}.diff")



# --- figures in docs/benchmarks.md's summary (the README links it) against the rows in benchmarks/results -------

RESULTS = ROOT / "benchmarks" / "results"
SUMMARY = ROOT / "docs" / "benchmarks.md"


def _pairs(name: str, strategy: str, batch: int) -> list[float]:
    """2-GPU over 1-GPU throughput of each run of ``strategy`` at ``batch`` per GPU: a 1-GPU row and the 2-GPU
    row right after it."""
    rows = [json.loads(line) for line in (RESULTS / "archive" / name).read_text().splitlines()]
    rows = [row for row in rows if row["strategy"] == strategy and row["batch"] == batch]
    return [two["tokens_per_s"] / one["tokens_per_s"] for one, two in zip(rows, rows[1:])
            if one["world_size"] == 1 and two["world_size"] == 2]


def test_the_ddp_figures_say_how_many_runs_back_them():
    ddp_8 = _pairs("ddp-scaling-2xH200.jsonl", "ddp", 8) + _pairs("fsdp-scaling-2xH200.jsonl", "ddp", 8)
    independent_8 = _pairs("ddp-scaling-2xH200.jsonl", "independent", 8)
    (ddp_32,) = _pairs("ddp-scaling-2xH200.jsonl", "ddp", 32)  # one run: the page must say so
    readme = SUMMARY.read_text()
    expected = [f"{ddp_32:.2f} x at 32 x 512 tokens per GPU (one pair of runs",
                f"{min(ddp_8):.2f}-{max(ddp_8):.2f} over {len(ddp_8)} pairs of runs",
                f"{min(independent_8):.2f}-{max(independent_8):.2f} over {len(independent_8)})"]
    missing = [text for text in expected if text not in readme]
    assert not missing, f"docs/benchmarks.md does not state what the rows give: {missing}"


def test_the_zero_figures_say_how_many_runs_back_them():
    rows = [json.loads(line) for line in (RESULTS / "archive" / "zero-memory-2xH200.jsonl").read_text().splitlines()]
    at_59b = [row for row in rows if row.get("hidden") == 4096 and row["checkpointing"] == "non-reentrant"]
    peak = {row["strategy"]: [r["peak_memory_gib"] for r in at_59b if r["strategy"] == row["strategy"]]
            for row in at_59b}
    assert all(len(found) == 1 for found in peak.values()), peak  # "one run each"
    zero3, offload = peak["zero3"][0] / peak["ddp"][0], peak["zero3-offload"][0] / peak["ddp"][0]
    stated = "0.59 x DDP's at 5.9B, 0.11 x with CPU offload (one run each"
    assert f"{zero3:.2f}" == "0.59" and f"{offload:.2f}" == "0.11" and stated in SUMMARY.read_text()


def test_the_supported_versions_are_the_tested_ones():
    """setup.cfg asks for the version guard's floors alone (the guard judges a newer release by its functions'
    forms, not pip), the releases the results and CI ran lie above them, and the README's version line names the
    floors as a tested pair and says that older releases are refused (test_readme.py checks each pair it names
    against the version matrix's passing rows)."""
    from packaging.specifiers import SpecifierSet

    from pyvene_dist.versions.installed import version as installed_version
    from pyvene_dist.versions.guard import REQUIRED

    setup = (ROOT / "setup.cfg").read_text()
    for name in ("torch", "transformers"):
        (lower,) = [spec for spec in SpecifierSet(REQUIRED[name]) if spec.operator == ">="]
        assert f"    {name}{lower}\n" in setup, f"setup.cfg does not require {name}{lower}"
    ran = {json.dumps(row["versions"], sort_keys=True) for path in RESULTS.glob("*.jsonl")
           for row in map(json.loads, path.read_text().splitlines()) if "transformers" in row.get("versions", {})}
    here = {name: installed_version(name) for name in ("torch", "transformers")}  # CI's, when CI runs this
    ran = [json.loads(versions) for versions in ran] + [here]
    for versions in ran:
        for name in ("torch", "transformers"):
            release = versions[name].split("+")[0]
            assert SpecifierSet(REQUIRED[name]).contains(release), f"{name} {release} ran but is not supported"
    floor = {name: next(spec.version for spec in SpecifierSet(REQUIRED[name]) if spec.operator == ">=")
             for name in ("torch", "transformers")}
    paragraph = passage((ROOT / "README.md").read_text(), "Supported, as tested:")
    line = paragraph[:paragraph.index(". ")]
    assert f"torch {floor['torch']} with transformers {floor['transformers']}" in line, (
        f"README.md's version line does not name the floors, torch {floor['torch']} with transformers "
        f"{floor['transformers']}, as a tested pair: {line!r}")
    assert f"torch older than {floor['torch']} and transformers older than {floor['transformers']} are refused" \
        in paragraph, "README.md's version paragraph does not say which releases the guard refuses"


# --- every figure a page quotes is backed by rows in benchmarks/results ----------------------------------------

#: A figure, as the pages quote one: a ratio with decimals ("1.32 x", "0.98-1.03 x", "1.51x"), a time in ms or
#: us ("21.5 ms", "53-86 ms"), a memory size ("6.62 GiB", "518 MiB"), a duration ("1,234 s", "20.6 minutes",
#: "about two minutes": a spelled-out number is rounded to a whole one), or a count of what a run gave ("884
#: passed", "4,335 kernel launches", "2 graph breaks"). Sizes of inputs ("8 x 512", "2 x H200", "2 layers"),
#: deviations ("4.8e-07"), goals ("at most 1.03 x") and anything in code blocks are not figures.
_NUMBER = r"\d[\d,]*(?:\.\d+)?"
SPELLED = {"one": "1", "two": "2", "three": "3", "four": "4", "five": "5", "six": "6", "seven": "7", "eight": "8",
           "nine": "9", "ten": "10", "twenty": "20", "thirty": "30"}
#: What a row's number is divided by to give a figure in each unit of time: rows keep seconds or milliseconds.
DIVISORS = {"s": (1, 1000), "second": (1, 1000), "minute": (1, 60, 60_000), "min": (1, 60, 60_000),
            "hour": (1, 3600, 3_600_000)}
COUNTED = ("passed", "failed", "skipped", "errors?", "(?:kernel )?launches", "(?:operator |Python )?calls",
           "(?:graph )?breaks", "recompil(?:e|ation)s")
FIGURE = re.compile(rf"(?<![\w.])(?:(?P<ratio>\d+\.\d+)(?:\s*-\s*(?P<ratio_to>\d+\.\d+))?\s?x\b"
                    rf"|(?P<size>{_NUMBER})(?:\s*-\s*(?P<size_to>{_NUMBER}))?\s?(?:ms|us|MiB|GiB)\b"
                    rf"|(?P<time>{_NUMBER})(?:\s*-\s*(?P<time_to>{_NUMBER}))?\s?(?P<unit>minutes?|min|hours?|seconds?|s)\b"
                    rf"|(?P<spelled>{'|'.join(SPELLED)})\s(?P<spelled_unit>minutes?|hours?|seconds?)\b"
                    rf"|(?P<count>{_NUMBER})(?:\s*-\s*(?P<count_to>{_NUMBER}))?\s(?:{'|'.join(COUNTED)})\b)")


def figure_values(match: re.Match) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """The numbers of a figure as written (a spelled-out one as digits), and what a row's number may be divided
    by to give them (60 for a figure in minutes and a row in seconds)."""
    values = tuple(SPELLED.get(value, value) for name, value in match.groupdict().items()
                   if value and not name.endswith("unit"))
    unit = match["unit"] or match["spelled_unit"] or ""
    return values, DIVISORS.get(unit if unit in DIVISORS else unit.rstrip("s"), (1,))


#: ``<!-- rows: benchmarks/results/<file>[, ...] -->`` names the rows behind the figures after it, until the
#: next heading or marker; a heading naming a results file names it for its section, and a block (paragraph,
#: table, list item) naming one is backed by it too. A figure whose page names no rows for it is in
#: ``FIGURE_SOURCES``, or the check fails.
ROWS_MARKER = re.compile(r"<!-- rows: ([^>]*?) -->")
NAMED_RESULTS = re.compile(r"benchmarks/results/[\w./-]+\.(?:jsonl|json|md|txt)")
#: Words a block quoting rows from archive/ must carry, or its heading, or the passage after the heading or marker
#: that opens its part of the page: those rows predate the hot path's rewrites.
BEFORE_REWRITE = "before the rewrite"

#: Where a figure comes from when its page does not say: (page, the figure as written, or the words that open its
#: block, for every figure of the block) -> "rows: <results files>" whose rows must give it, or why it is not a
#: result (a setting, arithmetic, a count no row keeps). One line a figure; a line no figure uses any more fails
#: (``test_every_figure_source_is_used``).
ARRIVAL_TIMEOUT = "a timeout: pyvene_dist.gather.ARRIVAL_TIMEOUT_S"
RAY_BY_HAND = "timed by hand once (Ray 2.60, 2026-12-03, the page says so); no row kept"
FIGURE_SOURCES: dict[tuple[str, str], str] = {
    ("docs/plan.md", "| measured (2 x H200 unless noted) |"):
        "plan's estimates beside the peaks of the rows in benchmarks/results/archive/, arithmetic on them; "
        "tests/cli/test_plan.py compares every row",
    ("docs/strategies/deepspeed.md", "A frozen base model has no gradients"): "the size of DeepSpeed's default "
        "bucket, 5e8 fp32 elements: a setting",
    ("docs/strategies/deepspeed.md", "What ZeRO-3 keeps beyond its half"): "the sizes of one matrix, vocabulary x "
        "hidden in fp32: arithmetic",
    ("docs/strategies/deepspeed.md", "30 s"): ARRIVAL_TIMEOUT,
    ("docs/limits.md", "30 s"): ARRIVAL_TIMEOUT,
    ("docs/checkpoints.md", "30 s"): ARRIVAL_TIMEOUT,
    ("docs/testing.md", "20 s"): "a timeout: how long the other ranks wait for one that stopped (testing.launch)",
    ("docs/testing.md", "70 s"): "timed by hand when the test was written (CPU time of one run); no row kept",
    ("docs/testing.md", "4.1 minutes"): "timed by hand when the test was written (wall time, loaded machine); no "
        "row kept",
    ("docs/strategies/deepspeed.md", "1 MiB"): "DeepSpeed's smallest swap, a setting",
    ("docs/strategies/ray.md", "27 s"): RAY_BY_HAND,
    ("docs/strategies/ray.md", "88 s"): RAY_BY_HAND,
    ("docs/strategies/ray.md", "35 s"): RAY_BY_HAND,
    ("docs/strategies/ray.md", "150 s"): RAY_BY_HAND,
    ("docs/fast_path.md", "15 breaks"): "torch._dynamo.explain's count, asserted on CPU by "
        "tests/fixes/test_fast_path_compile.py, and in the log of the GPU run at 95e7580 (gpu-tests/)",
    ("docs/fast_path.md", "45 Python calls"): "counted with benchmarks/calls.py's profiler while the change was "
        "made; no row keeps one application's count",
    ("docs/fast_path.md", "31 kernel launches"): "arithmetic: ReFT's launches per token less the bare model's, "
        "both in the generation profile the paragraph names",
    ("docs/fast_path.md", "557 calls"): "counted with benchmarks/calls.py's profiler while the change was made; no "
        "row keeps the walk's count",
    ("docs/fast_path.md", "143 calls"): "counted with benchmarks/calls.py's profiler while the change was made "
        "(DataParallel: not in the CPU rows)",
    ("docs/fast_path.md", "8 calls"): "arithmetic: 4 interventions x 2 lock.__exit__",
    ("docs/fast_path.md", "9 calls"): "counted with benchmarks/calls.py's profiler while the change was made; no "
        "row keeps one hook's count",
    ("docs/fast_path.md", "2 calls"): "what the proposed change would leave: a dict lookup and its key, not run",
    ("docs/patches.md", "3,883 Python calls"): "rows: benchmarks/results/calls-cpu.jsonl",
    ("docs/patches.md", "550 operator calls"): "counted with the profiler when the householder fix was written; no "
        "row kept",
    ("docs/patches.md", "200 calls"): "counted with the profiler when the householder fix was written; no row kept",
    **{("docs/loading.md", figure): "issue 47's own measurement at 7424c13 (pyvene-dist check --model on the 206M "
       "folder, 2 CPU ranks), quoted as the issue gives it; its rows are not in the project" for figure in
       ("1.33 x", "1.65 x", "1.75 x", "3.19 x")},
    **{("docs/loading.md", figure): "issue 47's goal for the load, a target, not a result" for figure in
       ("0.35 x",)},
    ("docs/loading.md", "| step | per GPU (plan) |"): "pyvene-dist plan's output for Llama-2-70B's shape, which "
        "docs/quantized.md prints whole: arithmetic, not a measurement",
    ("README.md", "40 failed"): "the JUnit file of the GPU run the claim names; tests/docs/test_readme.py checks "
        "the claim against it",
}


@dataclasses.dataclass(frozen=True)
class Figure:
    where: str
    text: str
    values: tuple[str, ...]  # as written: the decimals give the rounding
    results: tuple[str, ...]  # the results files that back it
    not_measured: bool = False
    block: str = ""
    per: tuple[int, ...] = (1,)  # what a row's number may be divided by to give it (60: a row's seconds, minutes)
    source: tuple[str, str] | None = None  # its key in FIGURE_SOURCES, if it is there


def _source(page: str, figure: str, block: str, sources: dict[tuple[str, str], str]) -> tuple[str, str] | None:
    opening = " ".join(block.split())
    return next((key for key in ((page, figure), *((page, words) for listed, words in sources if listed == page
                                                   and opening.startswith(words))) if key in sources), None)


def quoted_figures(page: Path, text: str | None = None, sources: dict[tuple[str, str], str] | None = None
                   ) -> list[Figure]:
    """Every figure in the prose of ``page`` (code blocks skipped), with the results files named for it (by the
    page, or by ``sources``, FIGURE_SOURCES unless given)."""
    text = page.read_text() if text is None else text
    sources = FIGURE_SOURCES if sources is None else sources
    found, section_rows, block_lines, fence, heading = [], (), [], False, ""
    introduction = ""  # the first block after a heading or marker: what it says holds for the blocks after it
    lines = text.splitlines() + [""]

    def close() -> None:
        nonlocal introduction
        block = "\n".join(line for _, line in block_lines)
        introduction = introduction or block
        rows = tuple(section_rows) + tuple(NAMED_RESULTS.findall(block))
        for number, line in block_lines:
            for match in FIGURE.finditer(re.sub(r"<!--.*?-->", "", line)):
                if re.search(r"(at most|goal|<=)\s*\(?$", line[:match.start()]):
                    continue  # a goal ("at most 1.03 x LoRA"), not a measurement
                values, per = figure_values(match)
                source = _source(_shown(page), match.group(0), block, sources)
                named = tuple(NAMED_RESULTS.findall(sources[source])) if source and sources[source].startswith(
                    "rows: ") else ()
                found.append(Figure(f"{_shown(page)}:{number}", match.group(0), values, named or rows,
                                    bool(source and not named), f"{heading}\n{introduction}\n{block}", per, source))

    for number, line in enumerate(lines, start=1):
        stripped = line.strip()
        if stripped.startswith("```"):
            fence = not fence
            continue
        if fence:
            continue
        marker = ROWS_MARKER.search(line)
        if stripped.startswith("#") or not stripped or marker:
            if block_lines:
                close()
                block_lines = []
            if stripped.startswith("#") or marker:
                introduction = ""
            if stripped.startswith("#"):
                section_rows, heading = tuple(NAMED_RESULTS.findall(stripped)), stripped
            if marker:
                section_rows = tuple(name.strip() for name in marker.group(1).split(","))
            continue
        if block_lines and re.match(r"(-|\*|\d+\.) ", stripped):  # a list item is a block of its own
            close()
            block_lines = []
        block_lines.append((number, line))
    return found


def _numbers(value, key: str = "") -> list[tuple[str, float]]:
    """(key, number) for every number in a row, lists and nested objects included, and the figures a text
    in it states ("outcome": "884 passed, 110 skipped"; "took 371 s")."""
    if isinstance(value, bool):
        return []
    if isinstance(value, str):
        return [(key, float(number.replace(",", ""))) for match in FIGURE.finditer(value)
                for number in figure_values(match)[0]]
    if isinstance(value, (int, float)):
        return [(key, float(value))]
    if isinstance(value, dict):
        return [found for name, item in value.items() for found in _numbers(item, f"{key}.{name}")]
    if isinstance(value, list):
        return [found for item in value for found in _numbers(item, f"{key}[]")]
    return []


#: The measures the pages compare between rows of one invocation (a ratio or a difference of two rows' values).
COMPARED = {"median_ms", "p50_ms", "host_p50_ms", "tokens_per_s", "peak_memory_gib", "parameter_gib", "ms_per_token"}


def _rows(path: Path) -> list[dict]:
    """The rows of a results file: a JSON file is one row, a JSONL file one a line."""
    if path.suffix == ".json":
        return [json.loads(path.read_text())]
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def backing_values(name: str) -> set[float]:
    """The numbers a results file backs: every number in its rows, and the ratio and difference of two numbers
    under the same key in rows of one invocation (the same run id; for rows stored before run ids, the same
    commit that stored them, else the same time), as the pages compare rows timed side by side. A Markdown
    results file backs the numbers in its text."""
    path = ROOT / name
    if not path.is_file():
        raise AssertionError(f"{name} is named as the rows behind a figure, but there is no such file")
    if path.suffix in (".md", ".txt"):  # a table or a profile: the numbers in its text
        return {float(number.replace(",", "")) for number in re.findall(r"\d[\d,]*(?:\.\d+)?", path.read_text())}
    rows = _rows(path)
    values: set[float] = set()
    by_key: dict[tuple, list[float]] = {}
    for row in rows:
        invocation = row.get("run_id") or row.get("commit_added") or row.get("time")
        for key, number in _numbers(row):
            values.add(number)
            if key.lstrip(".") in COMPARED:
                by_key.setdefault((invocation, key), []).append(number)
    for numbers in by_key.values():
        for a in numbers:
            for b in numbers:
                if b:
                    values.add(a / b)
                values.add(abs(a - b))
    return values


def _within_rounding(written: str, values: set[float], per: tuple[int, ...] = (1,)) -> bool:
    decimals = len(written.partition(".")[2])
    target, half_unit = float(written.replace(",", "")), 0.5 * 10 ** -decimals
    return any(abs(value / divisor - target) <= half_unit * (1 + 1e-9) for value in values for divisor in per)


def unbacked_figures(figures: list[Figure]) -> list[str]:
    """What is wrong with each figure that no row backs: no results file named, a value none of them gives
    within its rounding, or archived rows quoted without saying they predate the rewrite."""
    problems, cache = [], {}
    for figure in figures:
        if figure.not_measured:
            continue
        if not figure.results:
            problems.append(f"{figure.where}: {figure.text!r} names no results file (add <!-- rows: "
                            f"benchmarks/results/... --> before it, or drop the figure)")
            continue
        values = set().union(*(cache.setdefault(name, backing_values(name)) for name in figure.results))
        missing = [value for value in figure.values if not _within_rounding(value, values, figure.per)]
        if missing:
            problems.append(f"{figure.where}: {figure.text!r}: no row of {', '.join(figure.results)} gives "
                            f"{', '.join(missing)} within its rounding")
        if any("/archive/" in name for name in figure.results) and BEFORE_REWRITE not in " ".join(figure.block.split()):
            problems.append(f"{figure.where}: {figure.text!r} quotes rows in archive/ without saying they were "
                            f"measured {BEFORE_REWRITE}")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=_shown)
def test_every_quoted_figure_is_backed_by_a_row(page):
    problems = unbacked_figures(quoted_figures(page))
    assert not problems, ("figures no row in benchmarks/results backs (name the rows on the page, or say where "
                          "the figure comes from in FIGURE_SOURCES):\n" + "\n".join(problems))


def test_every_figure_source_is_used():
    used = {figure.source for page in PAGES for figure in quoted_figures(page)}
    stale = [key for key in FIGURE_SOURCES if key not in used]
    assert not stale, f"FIGURE_SOURCES lists figures no page quotes any more (remove them): {stale}"


def test_an_unbacked_figure_is_refused(tmp_path):
    """A page quoting a figure its rows do not give, or naming no rows, or quoting archived rows as current,
    fails; the same page with figures the rows give passes. The rows: LoRA 20.0 ms and ReFT 26.4 ms in one run,
    so 1.32 x (26.4 / 20.0) is backed and 1.40 x is not."""
    rows = tmp_path / "benchmarks-results-speed.jsonl"
    rows.write_text("".join(json.dumps({"run_id": "r1", "provider": provider, "median_ms": median}) + "\n"
                            for provider, median in (("peft-lora", 20.0), ("pyvene_dist", 26.4))))
    page = f"# Speed\n\n<!-- rows: {rows} -->\nA ReFT step takes 26.4 ms, 1.32 x the LoRA step (20 ms).\n"

    def problems(text: str) -> list[str]:
        return unbacked_figures(quoted_figures(Path("fake.md"), text))

    assert problems(page) == []
    assert [problem.split(": ", 1)[1] for problem in problems(page.replace("1.32 x", "1.40 x"))] == [
        f"'1.40 x': no row of {rows} gives 1.40 within its rounding"]
    assert len(problems(page.replace("26.4 ms", "21.5 ms"))) == 1
    unnamed = "# Speed\n\nThe step takes 21.5 ms, 1.02 x LoRA's, at 6.62 GiB.\n"
    assert [problem.split("'")[1] for problem in problems(unnamed)] == ["21.5 ms", "1.02 x", "6.62 GiB"]
    assert all("names no results file" in problem for problem in problems(unnamed))
    archived = f"<!-- rows: {rows} -->\n" + "Peak 26.4 ms.\n"
    assert problems(archived.replace(str(rows), "benchmarks/results/archive/checkpointing-1xH200.jsonl").replace(
        "26.4 ms", "6.62 GiB"))[0].endswith(f"without saying they were measured {BEFORE_REWRITE}")
    assert problems("<!-- rows: benchmarks/results/archive/checkpointing-1xH200.jsonl -->\n"
                    f"Measured {BEFORE_REWRITE}: peak 6.62 GiB.\n") == []
    not_figures = "```\nstep 21.5 ms\n```\n\n2 x H200, 8 x 512 tokens, 2 layers, 4.8e-07.\n\nA 2 GiB bucket.\n"
    assert [problem.split("'")[1] for problem in problems(not_figures)] == ["2 GiB"]
    setting = {("fake.md", "2 GiB"): "a setting"}
    assert unbacked_figures(quoted_figures(Path("fake.md"), not_figures, setting)) == []
    assert unbacked_figures(quoted_figures(Path("fake.md"), not_figures, {("fake.md", "A 2 GiB"): "a setting"})) == []


def test_durations_and_counts_are_figures(tmp_path):
    """The README of b0b1170 quoted its suite time ("20.6 minutes", "1,234 s") and "about two minutes" with no
    figure found: durations (a spelled-out one too) and counts of what a run gave are figures, and a row's
    seconds back a figure in minutes."""
    rows = tmp_path / "suite.jsonl"
    rows.write_text(json.dumps({"run_id": "r1", "seconds": 1233.93, "outcome": "878 passed, 105 skipped"}) + "\n")
    page = (f"<!-- rows: {rows} -->\nThe tests took 20.6 minutes (1,234 s; 878 passed, 105 skipped).\n\n"
            "Trying it takes about ten minutes, and 4,335 kernel launches in 3 steps, 2 graph breaks.\n")
    figures = quoted_figures(Path("fake.md"), page)
    assert [figure.text for figure in figures] == ["20.6 minutes", "1,234 s", "878 passed", "105 skipped",
                                                   "ten minutes", "4,335 kernel launches", "2 graph breaks"]
    assert figures[4].values == ("10",) and 60 in figures[0].per
    assert [problem.split("'")[1] for problem in unbacked_figures(figures)] == [
        "ten minutes", "4,335 kernel launches", "2 graph breaks"]
    assert unbacked_figures(quoted_figures(Path("fake.md"), page.replace("20.6", "26"))) != []


def test_every_row_says_where_it_came_from():
    """Every row in benchmarks/results carries its commit, date, machine, versions and run id; rows in archive/
    carry no measured commit (none was recorded) but say they predate the rewrite and which commit stored them."""
    for path in sorted(RESULTS.rglob("*.json*")):
        if "gpu-tests" in path.parts:
            continue
        rows = _rows(path)
        archived = path.parent.name == "archive"
        needed = ("time", "gpu", "versions", "before_rewrite", "commit_added") if archived else (
            "commit", "date", "machine", "versions", "run_id")
        for number, row in enumerate(rows, start=1):
            missing = [key for key in needed if not row.get(key) and not (key == "date" and row.get("time"))]
            assert not missing, f"{path.relative_to(ROOT)} row {number} lacks {missing}"
    for table in sorted(RESULTS.glob("*.md")):  # a table's run, on one line
        run = next((line for line in table.read_text().splitlines() if line.startswith("Run: ")), "")
        assert re.match(r"Run: commit [0-9a-f]{7}.*, \d{4}-\d\d-\d\d, .*(H200|CPU).*torch .*; run id \S+\.$", run), (
            f"{table.relative_to(ROOT)} has no line 'Run: commit <sha>, <date>, <machine>, <versions>; run id <id>.'")


# --- names the pages quote resolve in the code ----------------------------------------------------------------

#: Pages that quote the package's names: the docs, the README, and patches/README.md.
QUOTING = [*PAGES, ROOT / "patches" / "README.md"]
#: A site path: "module:Qualified.attr" in one of the packages pyvene_dist patches.
SITE_PATH = re.compile(r"^((?:pyvene|pyreft|transformers|torch)(?:\.\w+)*):(\w+(?:\.\w+)*)$")


def _resolves(dotted: str) -> bool:
    """Whether ``dotted`` (``pyvene_dist.x.y``) is a module or an attribute of one."""
    import importlib

    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for name in parts[cut:]:
                found = getattr(found, name)
        except AttributeError:
            return False
        return True
    return False


def _quoted_names(page: Path) -> list[str]:
    """The package's names ``page`` quotes: ``pyvene_dist.…`` and ``fixes.…`` in backticks, site paths in
    backticks, and the paths given to ``Site(...)`` in its code."""
    text = page.read_text()
    found = []
    for span in re.findall(r"`([^`\n]+)`", text):
        dotted = re.match(r"(?:pyvene_dist|fixes)(?:\.\w+)+", span)
        if dotted:
            found.append(dotted.group().replace("fixes.", "pyvene_dist.fixes.", 1) if span.startswith("fixes.")
                         else dotted.group())
        elif SITE_PATH.match(span):
            found.append(span)
    return found + [f"Site {path}" for path in re.findall(r"Site\(\s*f?\"([^\"]+)\"", text)]


@pytest.mark.parametrize("page", QUOTING, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_name_a_page_quotes_is_in_the_code(page):
    """A page's ``pyvene_dist.…``/``fixes.…`` names resolve, and the site paths it quotes are sites of the
    records (docs/architecture.md showed a site of ``locations`` no fix wraps any more, and patches/README.md
    named ``fixes.RUNTIME_ONLY`` after it was gone)."""
    from pyvene_dist.fixes import fixes

    places = {place.path for fix in fixes() for place in fix.places}
    missing = []
    for name in _quoted_names(page):
        if name.startswith("Site ") or SITE_PATH.match(name):
            path = name.removeprefix("Site ")
            if path not in places:
                missing.append(f"{path} (no fix's site)")
        elif not _resolves(name):
            missing.append(name)
    assert not missing, f"{page.relative_to(ROOT)} quotes names the code lacks: {missing}"


# --- how ranks start, as the pages say it ----------------------------------------------------------------------

#: Passages that say how a rank's process starts: (page, the words that open the passage). quickstart.md said
#: check's ranks were "freshly spawned" after they forked by default (``pyvene_dist.testing._preloaded``).
RANK_START = [
    ("docs/quickstart.md", "`pyvene-dist check` trains a tiny Llama"),
    ("docs/testing.md", "- `@pytest.mark.world_size(1, 2, backend=None"),
    ("docs/testing.md", "`trainer_runs.py`, and `suite.py` lists them"),
    ("docs/strategies/accelerate.md", "`check` builds `Accelerator("),
]
#: A start method, as the pages say it.
STARTED = {"forkserver": "forked", "spawn": "spawned"}


def passage(text: str, opening: str) -> str:
    """The paragraph or list item of ``text`` that starts with ``opening``, its lines joined."""
    start = text.index(opening)
    ends = [end for end in (text.find("\n\n", start), text.find("\n- ", start + 1)) if end != -1]
    return " ".join(text[start:min(ends, default=len(text))].split())


@pytest.mark.parametrize("page, opening", RANK_START, ids=[f"{page}:{opening[:30]}" for page, opening in RANK_START])
def test_the_pages_say_how_ranks_start(page, opening, monkeypatch):
    from pyvene_dist.testing import _preloaded

    monkeypatch.delenv(_preloaded.VARIABLE, raising=False)
    monkeypatch.setitem(_preloaded._servers, _preloaded._now(), None)  # as if started: nothing is started here
    method = _preloaded.context().get_start_method()
    said_here = passage((ROOT / page).read_text(), opening)
    others = [word for start, word in STARTED.items() if start != method]
    said = [word for word in others if re.search(rf"\b{word} (?:process|processes|ranks?|world)\b", said_here)]
    assert STARTED[method] in said_here and not said, (
        f"{page}: ranks start {STARTED[method]} by default ({method}); the passage {opening!r} says "
        f"{said or 'neither'}: {said_here[:300]}")


def test_the_quickstarts_copy_of_train_reft_is_the_script():
    """quickstart.md shows docs/examples/train_reft.py whole, as the script users run: a change to the script (issue
    38's refusals changed its docstring and flag checks three times in one day) must change the copy too."""
    page = (ROOT / "docs" / "quickstart.md").read_text()
    copy = re.search(r"```python\n# docs/examples/train_reft.py\n(.*?\n)```", page, re.S)
    assert copy, "docs/quickstart.md no longer shows docs/examples/train_reft.py"
    assert copy.group(1) == (ROOT / "docs" / "examples" / "train_reft.py").read_text(), (
        "docs/quickstart.md's copy of docs/examples/train_reft.py differs from the script: copy the script into it")
