"""The flags the README promises, parsed by the programs that take them: ``pyvene-dist`` and the example scripts.

The README says dtypes go by their torch names everywhere and the older spellings (``--dtype bf16``, ``--layers
'2;8'``) still work, with a note naming the new one. ``SPELLINGS`` is one line per promise: the program, the
arguments as a user types them, the attribute they set, its value, and what the note on stderr must say (empty:
no note). Only the argument parsing runs (the scripts' ``parse_arguments``, the command's ``parser()``), in one
process per script, not a training.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
#: The arguments each script needs besides the one under test.
REQUIRED = {"train_reft.py": "--model m --data d.json --output_dir out", "serve_reft.py": "--interventions x --prompt p",
            "pyvene-dist plan": "--model llama --gpus 1", "pyvene-dist check": ""}
#: (program, arguments, attribute, value, what the note on stderr says)
SPELLINGS = [
    ("train_reft.py", "--dtype bf16", "dtype", "bfloat16", "write --dtype bfloat16"),
    ("train_reft.py", "--dtype fp16", "dtype", "float16", "write --dtype float16"),
    ("train_reft.py", "--dtype bfloat16", "dtype", "bfloat16", ""),
    ("train_reft.py", "--layers '2;8'", "layers", "2,8", "as 2,8"),
    ("serve_reft.py", "--dtype bf16", "dtype", "bfloat16", "write --dtype bfloat16"),
    ("serve_reft.py", "--dtype fp32", "dtype", "float32", "write --dtype float32"),
    ("serve_reft.py", "--dtype float16", "dtype", "float16", ""),
    ("pyvene-dist plan", "--dtype bf16", "dtype", "bfloat16", "write --dtype bfloat16"),
    ("pyvene-dist plan", "--layers '2;8'", "layers", (2, 8), "write --layers 2,8"),
    ("pyvene-dist check", "--dtype bf16", "dtype", "bfloat16", "write --dtype bfloat16"),
]

#: Parses each (script, arguments, attribute) of argv[1] with the script's ``parse_arguments``; prints, per case,
#: the attribute's value (None where parsing refused it) and what the parsing wrote to stderr.
SCRIPT_PARSER = """
import contextlib, io, json, sys, warnings
sys.path.insert(0, "docs/examples")
import serve_reft, train_reft
found = []
for script, argv, attribute in json.loads(sys.argv[1]):
    module = {"train_reft.py": train_reft, "serve_reft.py": serve_reft}[script]
    stderr = io.StringIO()
    value = None
    with contextlib.redirect_stderr(stderr), warnings.catch_warnings():
        warnings.simplefilter("always")
        try:
            parsed = module.parse_arguments(argv)
            value = getattr(parsed[0] if isinstance(parsed, tuple) else parsed, attribute)
        except (Exception, SystemExit) as error:  # a refusal: argparse's exit, or a script's own error
            print(f"{type(error).__name__}: {error}", file=sys.stderr)
    found.append([value, stderr.getvalue()])
print("PARSED " + json.dumps(found))
"""


def _arguments(program: str, given: str) -> list[str]:
    return program.split()[1:] + shlex.split(REQUIRED[program]) + shlex.split(given)


@pytest.fixture(scope="module")
def parsed_by_the_scripts(tmp_path_factory) -> dict[tuple[str, str], tuple[object, str]]:
    """(script, arguments) -> (value, stderr) for every script case of ``SPELLINGS``, in one process (forked from
    the preloaded server: launchers.run_forked)."""
    from launchers import run_forked

    cases = [(program, given, attribute) for program, given, attribute, _, _ in SPELLINGS if program.endswith(".py")]
    parser_file = tmp_path_factory.mktemp("script-parser") / "parse.py"
    parser_file.write_text(SCRIPT_PARSER)
    output = run_forked(parser_file, [json.dumps([[program, _arguments(program, given), attribute]
                                              for program, given, attribute in cases])], cwd=ROOT, timeout=300)
    lines = [line for line in output.splitlines() if line.startswith("PARSED ")]
    assert lines, f"parsing the scripts' flags failed:\n{output[-4000:]}"
    return {(program, given): tuple(found) for (program, given, _), found in zip(cases, json.loads(lines[0][7:]))}


def _parsed_by_the_command(program: str, given: str, attribute: str, capsys) -> tuple[object, str]:
    from pyvene_dist.__main__ import parser

    capsys.readouterr()
    try:
        value = getattr(parser().parse_args(_arguments(program, given)), attribute)
    except SystemExit:  # argparse refused it: report what it said
        value = None
    return value, capsys.readouterr().err


@pytest.mark.parametrize("program, given, attribute, value, note", SPELLINGS,
                         ids=[f"{program} {given}" for program, given, *_ in SPELLINGS])
def test_each_promised_spelling_parses(program, given, attribute, value, note, request, capsys):
    if program.endswith(".py"):
        found, stderr = request.getfixturevalue("parsed_by_the_scripts")[program, given]
    else:
        found, stderr = _parsed_by_the_command(program, given, attribute, capsys)
    assert found == value, f"{program} {given}: {attribute} is {found!r}, expected {value!r}; stderr ends:\n{stderr[-500:]}"
    if note:
        assert note in stderr, f"{program} {given}: the note on stderr does not say {note!r}: {stderr!r}"
    else:
        assert not stderr.strip(), f"{program} {given}: a note where none was expected: {stderr!r}"


def _choices(command: str, flag: str) -> tuple[str, ...]:
    """The choices ``pyvene-dist <command>`` gives ``flag``."""
    from pyvene_dist.__main__ import parser

    commands = next(action for action in parser()._actions if action.dest == "command")
    return tuple(next(action for action in commands.choices[command]._actions if flag in action.option_strings).choices)


def readme_dtype_claims(text: str) -> tuple[set[str], set[str], set[str]]:
    """What the README says the programs take: the dtypes of its flags sentence ("dtypes by their torch names
    (...)", which holds for check too unless it makes an exception for `check`), those it says check takes there,
    and those its Commands section lists for check (``--dtype a|b``)."""
    text = " ".join(text.split())
    sentence = re.search(r"dtypes by their torch names \(([^)]*)\)", text)
    assert sentence, "README.md no longer says which dtypes the flags take ('dtypes by their torch names (...)')"
    everywhere, _, exception = sentence[1].partition("`check`")
    listed = re.search(r"`--dtype ([\w|]+)`", text[text.index("## Commands"):])
    assert listed, "README.md's Commands section no longer lists check's `--dtype a|b`"
    everywhere = set(re.findall(r"`(\w+)`", everywhere))
    return everywhere, set(re.findall(r"`(\w+)`", exception)) or everywhere, set(listed[1].split("|"))


def test_the_readme_says_which_dtypes_each_program_takes():
    from pyvene_dist import flags

    everywhere, check, options = readme_dtype_claims((ROOT / "README.md").read_text())
    assert everywhere == set(flags.DTYPES) == set(_choices("plan", "--dtype")), (
        f"README.md says the dtypes are {sorted(everywhere)}; the scripts take {sorted(flags.DTYPES)}, plan "
        f"{sorted(_choices('plan', '--dtype'))}")
    taken = set(_choices("check", "--dtype"))
    assert check == taken, f"README.md's flags sentence says check takes {sorted(check)}; it takes {sorted(taken)}"
    assert options == taken, f"README.md's Commands list `--dtype {'|'.join(sorted(options))}`; check takes {sorted(taken)}"


def test_the_dtype_claims_are_read_as_a_user_reads_them():
    """The README of b0b1170 lists float16 with no exception for check: the claim is that check takes it."""
    text = ("The flags: dtypes by their torch names (`float32`, `bfloat16`, `float16`), layers as `2,8`.\n"
            "## Commands\nOptions: `--dtype float32|bfloat16`, `--steps`.\n")
    everywhere = {"float32", "bfloat16", "float16"}
    assert readme_dtype_claims(text) == (everywhere, everywhere, {"float32", "bfloat16"})
    excepted = text.replace("`float16`)", "`float16`; `check` takes `float32` and `bfloat16`)")
    assert readme_dtype_claims(excepted) == (everywhere, {"float32", "bfloat16"}, {"float32", "bfloat16"})
