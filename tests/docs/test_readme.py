"""The README's first screen, run as a new user runs it: the "Try it on CPU" commands, in order, in a fresh folder.

``pyvene-dist tiny-model`` saves a model folder, ``docs/examples/train_reft.py`` trains on
``docs/examples/data/instructions.json`` under torchrun in 2 processes and saves, and
``docs/examples/serve_reft.py`` reloads what it saved in a fresh process and answers. The commands are read
from the README (the block after "Try it on CPU"), with ``.venv/bin/`` standing for this environment's bin.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_docs import blocks, shell_commands

ROOT = Path(__file__).parents[2]
VENV = ".venv/bin/"


def example_commands() -> list[str]:
    readme = ROOT / "README.md"
    text = readme.read_text()
    after = text[:text.index("**Try it on CPU**")].count("\n") + 1
    block = next(block for block in blocks(readme) if block.line > after and block.language == "bash")
    return [command for _, command in shell_commands(block)]


def test_the_example_is_the_three_steps():
    commands = example_commands()
    assert [command.split()[0] for command in commands] == [f"{VENV}pyvene-dist", f"{VENV}torchrun", f"{VENV}python"]
    assert "--nproc_per_node 2" in commands[1] and "docs/examples/data/instructions.json" in commands[1]
    examples = json.loads((ROOT / "docs" / "examples" / "data" / "instructions.json").read_text())
    assert len(examples) >= 24 and all(set(example) == {"instruction", "output"} for example in examples)


@pytest.mark.slow
def test_the_readme_example_trains_saves_and_reloads_on_cpu(tmp_path):
    from pyvene_dist.testing.launch import free_port

    (tmp_path / "docs").symlink_to(ROOT / "docs")  # the commands name docs/...; out/ lands in tmp_path
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "OMP_NUM_THREADS": "1", "PET_MASTER_PORT": str(free_port()),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    outputs = []
    for command in example_commands():
        command = command.replace(VENV, f"{Path(sys.executable).parent}/", 1)
        result = subprocess.run(command, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True,
                                timeout=600)
        assert result.returncode == 0, f"{command!r} exited {result.returncode}:\n{result.stderr[-4000:]}"
        outputs.append(result.stdout)
    settings = json.loads((tmp_path / "out" / "run" / "reft" / "train_settings.json").read_text())
    assert settings["model"] == str(tmp_path / "out" / "tiny-llama") and settings["positions"] == "f1+l1"
    log = json.loads((tmp_path / "out" / "run" / "trainer_state.json").read_text())["log_history"]
    assert log[-1]["step"] == 12
    prompt = "'What colour is snow?' -> "  # then the repr of the prompt and its greedy continuation
    answers = [ast.literal_eval(line.removeprefix(prompt)) for line in outputs[-1].splitlines() if line.startswith(prompt)]
    assert answers and answers[0].startswith(" What colour is snow?"), outputs[-1]


def readme_tested_on_column(text: str) -> list[str]:
    """The "tested on" cells of the README's table of strategies."""
    lines = text[text.index("## What works"):].splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("| strategy |"))
    column = [cell.strip() for cell in lines[header].strip("|").split("|")].index("tested on")
    cells = []
    for line in lines[header + 2:]:
        if not line.startswith("|"):
            break
        cells.append([cell.strip() for cell in line.strip("|").split("|")][column])
    return cells


GPU_RUN = re.compile(r"(\d+) x H200, (\d{4}-\d\d-\d\d) \(([0-9a-f]{7,})\)")
NO_LOG = re.compile(r"\d+ x H200 before \d{4}-\d\d, no log kept")


def gpu_claims_without_a_log(text: str) -> list[str]:
    """Each GPU claim of the "tested on" column that names no stored run (gpu-tests/<date>-<commit>/ with its
    JUnit file) and does not say that none was kept."""
    problems = []
    for cell in readme_tested_on_column(text):
        for claim in re.findall(r"\d+ x H200[^;|]*", cell):
            run = GPU_RUN.fullmatch(claim.strip())
            if run and (ROOT / "benchmarks/results/gpu-tests" / f"{run[2]}-{run[3]}" / "junit.xml").is_file():
                continue
            if not run and NO_LOG.fullmatch(claim.strip()):
                continue
            problems.append(claim.strip())
    return problems


def test_each_gpu_claim_names_its_stored_run_or_says_none_was_kept():
    assert not gpu_claims_without_a_log((ROOT / "README.md").read_text())
    planted = "## What works\n| strategy | launch | tested on | docs |\n| --- | --- | --- | --- |\n" \
              "| DDP | x | CPU (CI); 2 x H200 | d |\n| FSDP | x | 1 x H200, 2026-12-03 (0000000) | d |\n"
    assert gpu_claims_without_a_log(planted) == ["2 x H200", "1 x H200, 2026-12-03 (0000000)"]
