"""The command line's shared vocabulary (dtypes by torch name, layers as ``2,8``, the old spellings still taken
with a note) and ``pyvene-dist fixes``."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pyvene_dist.versions import installed


def run(capsys, *arguments) -> tuple[int, str, str]:
    """``pyvene-dist ARGUMENTS`` in this process (the console script calls the same ``main``)."""
    from pyvene_dist.__main__ import main

    try:
        code = main(list(arguments))
    except SystemExit as exit:  # argparse's own usage errors
        code = exit.code
    out, err = capsys.readouterr()
    return code, out, err


PLAN = ("plan", "--model", "llama-1b", "--gpus", "2", "--gpu-memory", "80")


def test_the_old_spellings_give_the_same_plan_with_a_note_naming_the_new(capsys):
    code, current, err = run(capsys, *PLAN, "--dtype", "float32", "--layers", "2,8")
    assert code == 0 and not err, err
    assert "float32, batch" in current.splitlines()[0] and "at layers 2,8;" in current.splitlines()[0]
    code, old, err = run(capsys, *PLAN, "--dtype", "fp32", "--layers", "2;8")
    assert code == 0 and old == current
    assert err.splitlines() == ["pyvene-dist: --dtype fp32 is deprecated and will stop working; write --dtype float32",
                                "pyvene-dist: --layers '2;8' is deprecated and will stop working; write --layers 2,8"]


def test_flags_take_underscores_as_the_example_scripts_do(capsys):
    _, dashes, _ = run(capsys, *PLAN, "--seq-len", "256")
    _, underscores, err = run(capsys, *PLAN[:-2], "--gpu_memory", "80", "--seq_len", "256")
    assert underscores == dashes and "256 tokens per GPU" in dashes and not err


def test_check_takes_the_dtype_names_it_can_run_and_refuses_others_naming_them(capsys):
    code, _, err = run(capsys, "check", "--dtype", "float16")
    assert code == 2 and "argument --dtype: invalid choice: 'float16' (choose from 'float32', 'bfloat16')" in err
    from pyvene_dist.__main__ import parser

    assert parser().parse_args(["check", "--dtype", "bf16"]).dtype == "bfloat16"
    assert "write --dtype bfloat16" in capsys.readouterr().err


def test_a_reader_that_leaves_early_ends_the_command_quietly(capsys, monkeypatch):
    """``pyvene-dist fixes --json | head``: the command ended in a ``BrokenPipeError`` traceback once ``head`` had
    left. Here the pipe's reader is gone before the command writes."""
    import os

    from pyvene_dist.__main__ import main

    reader, writer = os.pipe()
    os.close(reader)
    with open(writer, "w") as closed_pipe:
        monkeypatch.setattr(sys, "stdout", closed_pipe)
        assert main(["fixes", "--json"]) == 1  # Python's documented exit for a reader that left; no exception


def test_fixes_lists_every_fix_applied_here_with_its_ranges(capsys):
    from pyvene_dist.fixes import fixes

    code, out, _ = run(capsys, "fixes", "--json")
    assert code == 0
    rows = {row["name"]: row for row in json.loads(out)}
    assert list(rows) == [fix.name for fix in fixes()]
    assert all(row["applied"] and not row["reason"] for row in rows.values())  # CI's releases are the checked ones
    assert rows["hooks"]["checked"] == {"pyvene": ["0.1.8"]} and rows["hooks"]["installed"] == {"pyvene": "0.1.8"}
    assert rows["hooks"]["fingerprint"] == "unchanged" and rows["hooks"]["changed"] == []
    assert rows["reft_compute_loss"]["checked"]["pyreft"] == ["0.1.0", "0.1.0+git.dafd099"]  # its git main's forms too
    assert rows["reft_compute_loss"]["fixes"] == "pyreft's `compute_loss` answers HF Trainer's calls as HF Trainer makes and reads them."
    code, out, _ = run(capsys, "fixes")
    assert code == 0 and out.splitlines()[-1] == f"{len(rows)} of {len(rows)} fixes applied here by pyvene_dist.patch()"
    assert "hooks: applied; checked on pyvene 0.1.8; fingerprint unchanged" in out.splitlines()


def test_fixes_applies_a_newer_release_with_the_same_functions_and_names_a_changed_one(capsys, monkeypatch):
    from pyvene_dist.versions import table

    real_version = installed.version
    monkeypatch.setattr(installed, "version", lambda name: "0.2.0" if name == "pyvene" else real_version(name))
    code, out, _ = run(capsys, "fixes", "--json")
    rows = {row["name"]: row for row in json.loads(out)}
    assert all(row["applied"] and row["fingerprint"] == "unchanged" for row in rows.values())
    assert rows["hooks"]["checked"] == {"pyvene": ["0.1.8"]} and rows["hooks"]["installed"] == {"pyvene": "0.2.0"}

    target = "pyvene.models.intervenable_base:IntervenableModel._remove_forward_hooks"
    monkeypatch.setitem(table.KNOWN, target, {"0123456789abcdef": ("0.2.0",)})  # not the one here
    code, out, _ = run(capsys, "fixes", "--json")
    rows = {row["name"]: row for row in json.loads(out)}
    assert not any(row["applied"] for row in rows.values())  # patch() refuses them all, as it applies none
    assert rows["hooks"]["fingerprint"] == "changed" and rows["hooks"]["changed"] == [target]
    assert rows["hooks"]["reason"] == (f"patch() refuses: the fix 'hooks' depends on {target}, whose source here has "
                                       "the fingerprint f76d928fd9d68878, and knows 0123456789abcdef (0.2.0)")
    assert rows["zero_grad"]["fingerprint"] == "unchanged"
    assert rows["zero_grad"]["reason"] == "patch() refuses: functions of 'hooks' changed (see those fixes)"
    code, out, _ = run(capsys, "fixes")
    assert f"hooks: not applied; checked on pyvene none recorded; fingerprint changed: {target}" in out.splitlines()


@pytest.mark.parametrize("layers", ["2,x", "two"])
def test_a_bad_layer_list_names_the_expected_form(capsys, layers):
    code, _, err = run(capsys, *PLAN, "--layers", layers)
    assert code == 2 and f"layers are comma-separated integers such as 2,8, got {layers!r}" in err


def test_check_without_pyreft_says_how_to_install_it(capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *rest: None if name == "pyreft" else real(name, *rest))
    code, out, err = run(capsys, "check", "--strategies", "ddp")
    assert code == 2 and not out
    assert err.strip().splitlines()[-1] == ("pyvene-dist: check trains LoReFT with pyreft; pyreft not installed here: "
                                            'pip install "pyvene_dist[reft]" && pip install --no-deps pyreft==0.1.0')


def test_tiny_model_saves_a_folder_the_auto_classes_load(capsys, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    code, out, _ = run(capsys, "tiny-model", str(tmp_path / "tiny"))
    assert code == 0 and out.strip() == str(tmp_path / "tiny")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "tiny")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "tiny")
    assert (model.config.hidden_size, model.config.num_hidden_layers) == (32, 2)
    assert tokenizer.decode(tokenizer("What colour is snow?")["input_ids"]).strip() == "What colour is snow?"


def test_the_command_line_imports_no_pyvene_before_it_redirects_standard_output():
    """pyvene prints a notice to standard output as it is imported ("nnsight is not detected"), and `pyvene-dist
    check --json` writes its JSON there: the command imports pyvene only inside its redirect. 42a3038 made the
    harness's ``optim`` import it at the top, and the check's output began with two such lines."""
    found = subprocess.run([sys.executable, "-c", "import sys, pyvene_dist.__main__; print('pyvene' in sys.modules)"],
                           capture_output=True, text=True, timeout=120)
    assert found.returncode == 0, found.stderr
    assert found.stdout == "False\n", found.stdout
