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
from packaging.version import Version
from test_docs import blocks, passage, shell_commands

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
    outputs, errors = [], []
    for command in example_commands():
        command = command.replace(VENV, f"{Path(sys.executable).parent}/", 1)
        result = subprocess.run(command, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True,
                                timeout=600)
        assert result.returncode == 0, f"{command!r} exited {result.returncode}:\n{result.stderr[-4000:]}"
        outputs.append(result.stdout)
        errors.append(result.stderr)
    # f1 on the last layer: said once, by the first rank (each of the 2 ranks logged and warned it: 4 times)
    assert errors[1].count("its intervention for the first positions trains nothing") == 1, errors[1][-4000:]
    settings = json.loads((tmp_path / "out" / "run" / "reft" / "train_settings.json").read_text())
    assert settings["model"] == str(tmp_path / "out" / "tiny-llama") and settings["positions"] == "f1+l1"
    log = json.loads((tmp_path / "out" / "run" / "trainer_state.json").read_text())["log_history"]
    assert log[-1]["step"] == 12
    prompt = "'What colour is snow?' -> "  # then the repr of the prompt and its greedy continuation
    answers = [ast.literal_eval(line.removeprefix(prompt)) for line in outputs[-1].splitlines() if line.startswith(prompt)]
    assert answers and answers[0].startswith(" What colour is snow?"), outputs[-1]


def readme_table(text: str) -> list[dict[str, str]]:
    """The rows of the README's table of strategies, each as {column: cell}."""
    lines = text[text.index("## What works"):].splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("| strategy |"))
    columns = [cell.strip() for cell in lines[header].strip("|").split("|")]
    rows = []
    for line in lines[header + 2:]:
        if not line.startswith("|"):
            break
        rows.append(dict(zip(columns, (cell.strip() for cell in line.strip("|").split("|")))))
    return rows


def readme_tested_on_column(text: str) -> list[str]:
    """The "tested on" cells of the README's table of strategies."""
    return [row["tested on"] for row in readme_table(text)]


GPU_TESTS = ROOT / "benchmarks" / "results" / "gpu-tests"
#: A GPU claim naming its stored run, with what failed in it where something did: "1 x H200, 2026-12-03 (a26192c)",
#: "1 x H200, 2026-12-03 (a26192c, 5 of 40 failed: ...)".
GPU_RUN = re.compile(r"(\d+) x H200, (\d{4}-\d\d-\d\d) \(([0-9a-f]{7,})(?:, (\d+) of (\d+) failed[^)]*)?\)")
NO_LOG = re.compile(r"\d+ x H200 before \d{4}-\d\d, no log kept")


def junit_counts(path: Path) -> tuple[int, int]:
    """(failed, tests) of a JUnit file: failures and errors, over every test suite in it."""
    import xml.etree.ElementTree as ElementTree

    root = ElementTree.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    return (sum(int(suite.get("failures", 0)) + int(suite.get("errors", 0)) for suite in suites),
            sum(int(suite.get("tests", 0)) for suite in suites))


def gpu_claims_without_a_log(text: str, runs: Path = GPU_TESTS) -> list[str]:
    """Each GPU claim of the "tested on" column that names no stored run (gpu-tests/<date>-<commit>/ with its
    JUnit file) and does not say that none was kept, or whose run had failures the claim does not state."""
    problems = []
    for cell in readme_tested_on_column(text):
        for claim in re.findall(r"\d+ x H200[^;|]*", cell):
            claim = claim.strip()
            run = GPU_RUN.fullmatch(claim)
            junit = runs / f"{run[2]}-{run[3]}" / "junit.xml" if run else None
            if run and junit.is_file():
                failed, tests = junit_counts(junit)
                stated = (int(run[4]), int(run[5])) if run[4] else (0, tests)
                if stated != (failed, tests):
                    problems.append(f"{claim} (its run: {failed} of {tests} failed)")
                continue
            if not run and NO_LOG.fullmatch(claim):
                continue
            problems.append(claim)
    return problems


def test_each_gpu_claim_names_its_stored_run_or_says_none_was_kept():
    assert not gpu_claims_without_a_log((ROOT / "README.md").read_text())
    planted = "## What works\n| strategy | launch | tested on | docs |\n| --- | --- | --- | --- |\n" \
              "| DDP | x | CPU (CI); 2 x H200 | d |\n| FSDP | x | 1 x H200, 2026-12-03 (0000000) | d |\n"
    assert gpu_claims_without_a_log(planted) == ["2 x H200", "1 x H200, 2026-12-03 (0000000)"]


def test_a_claim_whose_run_failed_must_say_so(tmp_path):
    """The README of b0b1170 cited a26192c's run (5 of 40 failed) as "1 x H200, 2026-12-03 (a26192c)"."""
    run = tmp_path / "2026-12-03-1234567"
    run.mkdir()
    (run / "junit.xml").write_text(
        '<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="1" failures="1" '
        'skipped="0" tests="3"><testcase name="a"/><testcase name="b"><failure message="x"/></testcase>'
        '<testcase name="c"><error message="y"/></testcase></testsuite></testsuites>')
    table = "## What works\n| strategy | launch | tested on | docs |\n| --- | --- | --- | --- |\n| DDP | x | {} | d |\n"
    assert gpu_claims_without_a_log(table.format("1 x H200, 2026-12-03 (1234567)"), tmp_path) == [
        "1 x H200, 2026-12-03 (1234567) (its run: 2 of 3 failed)"]
    assert gpu_claims_without_a_log(table.format("1 x H200, 2026-12-03 (1234567, 1 of 3 failed)"), tmp_path) != []
    assert gpu_claims_without_a_log(table.format("1 x H200, 2026-12-03 (1234567, 2 of 3 failed: see why)"),
                                    tmp_path) == []
    (run / "junit.xml").write_text('<testsuites><testsuite failures="0" errors="0" tests="3"/></testsuites>')
    assert gpu_claims_without_a_log(table.format("1 x H200, 2026-12-03 (1234567)"), tmp_path) == []


def _rows(name: str) -> list[dict]:
    path = ROOT / "benchmarks" / "results" / name
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


#: What the README quotes from the newest row of a results file: (file, words the row has, the paragraph's opening,
#: what the paragraph must say, formatted with the row's fields and ``minutes``, its seconds / 60).
QUOTED_ROWS = [
    ("suite-time-cpu.jsonl", "from a clean clone", "The tests took",
     ("{minutes:.1f} minutes", "{seconds:,.0f} s", "at {commit:.7}", "{outcome}")),
    ("try-it-cpu.jsonl", "readme_try_it_cpu", "**Try it on CPU**", ("{median_s:.0f} s", "{runs} runs")),
]


@pytest.mark.parametrize("name, words, opening, quoted", QUOTED_ROWS, ids=[case[0] for case in QUOTED_ROWS])
def test_the_readme_quotes_the_newest_row(name, words, opening, quoted):
    """The README of b0b1170 quoted the suite at 92a399e (1,234 s) after the run at 6a5a54e (1,708 s) was stored,
    and its "about two minutes" to try it on CPU had no row."""
    rows = [row for row in _rows(name) if words in json.dumps(row)]
    assert rows, f"benchmarks/results/{name} has no row with {words!r}"
    newest = max(enumerate(rows), key=lambda found: (found[1]["date"], found[0]))[1]
    paragraph = passage((ROOT / "README.md").read_text(), opening)
    seconds = newest.get("seconds")
    expected = [text.format(**newest, minutes=seconds / 60 if isinstance(seconds, (int, float)) else None)
                for text in quoted]
    missing = [text for text in expected if text not in paragraph]
    assert not missing, f"README.md's paragraph {opening!r} does not quote the newest row of {name}: {missing}"


def test_the_readme_names_the_traps_the_quickstart_names():
    """Where the Quickstart's line-by-line table says a line stays "unchanged, except `...`", the README's "the
    rest of the script stays as it is" names the exception too (b0b1170's omitted `device_map="cuda"`)."""
    quickstart = (ROOT / "docs" / "quickstart.md").read_text()
    traps = re.findall(r"unchanged, except (`[^`]+`)", quickstart)
    assert traps, "docs/quickstart.md names no 'unchanged, except `...`' any more: update this test"
    paragraph = passage((ROOT / "README.md").read_text(), "**Your pyreft script on several GPUs.**")
    missing = [trap for trap in traps if trap not in paragraph]
    assert not missing, f"README.md says the rest of the script stays as it is, without the exceptions {missing}"


VERSION_MATRIX = ROOT / "benchmarks" / "results" / "version-matrix.jsonl"
#: The packages whose releases the README's "Supported, as tested" line may name as ranges.
RANGED = ("torch", "transformers", "accelerate", "deepspeed", "peft")


def _release(version: str | None) -> str:
    return (version or "").split("+")[0]


def _covers(written: str, version: str | None) -> bool:
    """Whether a release as the README writes it ("5.24", "2.13.0") is ``version`` or its series."""
    return _release(version) == written or _release(version).startswith(written + ".")


def version_claim_problems(sentence: str, rows: list[dict]) -> list[str]:
    """What the README's version line claims beyond the matrix's passing rows (core tests and check passed, without
    ``--allow-unsupported``: a run the guard refused backs no claim of support): each "torch X with transformers
    Y" must be a passing row's pair, and each range "name A-B" must end at releases passing rows ran, hold every
    passing row's release, and come with the pairs that ran it."""
    passing = [row for row in rows if row["pytest"].get("failed", 1) == row["pytest"].get("errors", 1) == 0
               and row["check"].get("verdict") == "passed" and not row.get("allow_unsupported")]
    problems = []
    pairs = re.findall(r"torch (\d+\.\d+(?:\.\d+)?) with transformers (\d+\.\d+(?:\.\d+)?)", sentence)
    for torch_release, transformers_release in pairs:
        if not any(_covers(torch_release, row["versions"].get("torch"))
                   and _covers(transformers_release, row["versions"].get("transformers")) for row in passing):
            problems.append(f"torch {torch_release} with transformers {transformers_release}: no passing row")
    for name, low, high in re.findall(rf"\b({'|'.join(RANGED)}) (\d+\.\d+)-(\d+\.\d+)", sentence):
        ran = [row["versions"].get(name) for row in passing if row["versions"].get(name)]
        for end in (low, high):
            if not any(_covers(end, version) for version in ran):
                problems.append(f"{name} {low}-{high}: no passing row ran {name} {end}")
        outside = sorted({_release(version) for version in ran
                          if not Version(low) <= Version(".".join(_release(version).split(".")[:2])) <= Version(high)})
        if outside:
            problems.append(f"{name} {low}-{high}: passing rows ran {', '.join(outside)} too")
        if not pairs:
            problems.append(f"{name} {low}-{high}: a range, without the pairs that ran it ('torch X with transformers Y')")
    return problems


def readme_version_line(text: str) -> str:
    start = text.index("Supported, as tested:")
    end = text.find(". ", start)
    return " ".join(text[start:end if end != -1 else None].split())


@pytest.mark.skipif(not VERSION_MATRIX.is_file(), reason="benchmarks/results/version-matrix.jsonl does not exist "
                    "yet (scripts/version_matrix.py writes it); the README's version line has no rows to match")
def test_the_readme_version_line_is_what_the_matrix_ran():
    rows = [json.loads(line) for line in VERSION_MATRIX.read_text().splitlines() if line.strip()]
    sentence = readme_version_line((ROOT / "README.md").read_text())
    problems = version_claim_problems(sentence, rows)
    assert not problems, f"README.md's {sentence!r} claims more than benchmarks/results/version-matrix.jsonl ran: " \
                         f"{problems}"


def test_a_version_line_claiming_untested_releases_is_refused():
    """b0b1170's line: ranges over two tested pairs, one of them (torch 2.11 with transformers 5.17) not a row of
    the matrix."""
    row = lambda torch, transformers, failed=0: {  # noqa: E731
        "versions": {"torch": torch, "transformers": transformers}, "pytest": {"failed": failed, "errors": 0},
        "check": {"verdict": "passed"}}
    rows = [row("2.13.0+cpu", "5.24.0"), row("2.14.1+cpu", "5.25.0"), row("2.11.0+cpu", "5.17.0", failed=3)]
    old = ("Supported, as tested: pyvene 0.1.8, pyreft 0.1.0, transformers 5.17-5.24 and torch 2.11-2.13 (torch 2.11 "
           "with transformers 5.17 on H200s, torch 2.13 with transformers 5.24 on CPU, where CI runs)")
    assert version_claim_problems(old, rows) == [
        "torch 2.11 with transformers 5.17: no passing row", "transformers 5.17-5.24: no passing row ran transformers "
        "5.17", "transformers 5.17-5.24: passing rows ran 5.25.0 too", "torch 2.11-2.13: no passing row ran torch "
        "2.11", "torch 2.11-2.13: passing rows ran 2.14.1 too"]
    new = ("Supported, as tested: transformers 5.24-5.25 and torch 2.13-2.14 (torch 2.13 with transformers 5.24, "
           "torch 2.14.1 with transformers 5.25)")
    assert version_claim_problems(new, rows) == []
    assert version_claim_problems("Supported, as tested: torch 2.13-2.14", rows) == [
        "torch 2.13-2.14: a range, without the pairs that ran it ('torch X with transformers Y')"]
    overridden = {**row("2.15.0+cu132", "5.25.0"), "allow_unsupported": True}
    assert version_claim_problems("Supported, as tested: torch 2.15 with transformers 5.25", rows + [overridden]) == [
        "torch 2.15 with transformers 5.25: no passing row"]
