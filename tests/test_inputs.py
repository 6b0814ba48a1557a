"""Every input a user gives the examples, the command line and pyvene: a clear error or the right result (issue 38).

Each table is one line per case: the input, and the words of the error (or of the warning of a run that trains)
it must give. docs/examples/train_reft.py and serve_reft.py run in one subprocess for all their cases
(``RUNNER``: they patch at import), on a checkpoint folder saved here with a real tokenizer; the command line and
``unit_locations`` run in-process.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st

import helpers

ROOT = Path(__file__).parents[1]
#: Words of the example data: 3-token prompts, 3 answer tokens (pyvene_dist.testing.models.instruction_examples).
LONG = " ".join(["red cat runs"] * 60)  # 180 prompt tokens: longer than the tiny model's 128 positions
DATA = {
    "train": None,  # instruction_examples(4)
    "empty": [],
    "null-output": [{"instruction": "red cat runs", "output": " big dog"}, {"instruction": "red cat", "output": None}],
    "not-objects": ["red cat runs"],
    "all-long": [{"instruction": LONG, "output": " big dog"}] * 2,
    "one-long": [{"instruction": LONG, "output": " big dog"}, {"instruction": "red cat runs", "output": " big dog"}],
    "short-and-long-prompts": [{"instruction": "red", "output": " big dog"},
                               {"instruction": "red cat runs fast big dog", "output": " big dog"}],
}
TRAIN_FLAGS = ("--max_steps", "1", "--learning_rate", "1e-2", "--per_device_train_batch_size", "2", "--report_to",
               "none", "--save_strategy", "no", "--disable_tqdm", "true", "--use_cpu")
#: (id, train_reft.py's flags besides --model/--output_dir, --data, "error: ..." or "warning: ..." and its words).
#: An error is the run's exit message (nothing trained); a warning comes from a run that trained and saved.
TRAIN_CASES = [
    ("positions-x3", "--positions x3", "train", "error: --positions 'x3': pyreft reads it as no position"),
    ("positions-f0+l0", "--positions f0+l0", "train", "error: --positions 'f0+l0': pyreft reads it as no position"),
    ("positions-f1l1", "--positions f1l1", "train", "error: expected first n and/or last n prompt positions as fN"),
    ("rank-0", "--rank 0", "train", "error: --rank 0: an intervention of rank 0 has nothing to train"),
    ("layers-0,,1", "--layers 0,,1", "train", "error: --layers '0,,1': expected 'all' or layer numbers separated"),
    ("data-empty", "", "empty", "error: holds no examples; expected a JSON list"),
    ("output-null", "", "null-output", "error: example 1's 'output' is null, expected a string"),
    ("data-not-objects", "", "not-objects", "error: example 0 has the str 'red cat runs', expected 'instruction'"),
    ("every-answer-cut", "", "all-long", "error: every example's answer is cut off: examples are cut to "
                                         "--model_max_length 128 tokens"),
    ("one-answer-cut", "", "one-long", "warning: 1 of 2 examples have no answer token left after cutting to "
                                       "--model_max_length 128 (examples 0)"),
    ("positions-l200", "--positions l200", "train", "error: --positions l200: pyreft takes at most half of a prompt's "
                                                     "tokens"),
    ("positions-l2-one-short", "--positions l2", "short-and-long-prompts",
     "warning: 1 of 2 prompts are too short for it (examples 0)"),
    ("positions-f1-last-layer", "--positions f1 --layers 1", "train", "error: --positions f1 on the model's last "
                                                                      "layer (1): its output at the first prompt "
                                                                      "positions reaches only their own predictions"),
    ("positions-f1-all-layers", "--positions f1", "train", "warning: so its intervention for the first positions "
                                                           "trains nothing; leave layer 1 out of --layers"),
    ("noreft", "--intervention NoreftIntervention", "train", "['config.json'"),
    ("dtype-float64", "--dtype float64", "train", "error: --dtype 'float64': expected one of float32, bfloat16, float16"),  # was KeyError: 'add_bias'
    ("output-dir-unwritable", "--output_dir UNWRITABLE/out", "train", "error: --output_dir UNWRITABLE/out cannot be "
                                                                     "written"),
    # issue 50: a reshape error after training; DeepSpeed without a launcher looked for MPI ('mpi4py')
    ("prompt-empty", "--prompt ''", "train", "error: train_reft.py: --prompt '' has no tokens"),
    ("deepspeed-without-a-launcher", "--deepspeed ZERO3CONFIG", "train", "['config.json'"),
    # the 70B recipe of docs/loading.md loads its base with --quantize 4bit
    ("quantize-3bit", "--quantize 3bit", "train", "error: --quantize '3bit': expected one of 4bit, 8bit"),
    ("quantize-4bit", "--quantize 4bit", "train", "['config.json'"),
]
#: (id, serve_reft.py's flags besides --prompt, "error: ..." or the start of the answer)
SERVE_CASES = [
    ("no-config", "--interventions EMPTY", "error: --interventions EMPTY has no config.json; expected the folder "
                                           "ReftModel.save wrote"),
    ("no-folder", "--interventions EMPTY/gone", "error: --interventions EMPTY/gone is not a folder"),
    ("model-moved", "--interventions MOVED", "error: MOVED/train_settings.json names the base model "
                                             "MODEL-GONE, which is not there"),
    ("other-hidden-size", "--interventions SAVED --model WIDE", "error: the interventions in SAVED were trained on a "
                                                                "model of another size than WIDE (hidden_size 64)"),
    # float32 interventions on a float16 base: each computes in its own dtype (it failed: mat1 and mat2 must have
    # the same dtype)
    ("float16-base", "--interventions SAVED --dtype float16", " red cat runs"),
    ("bin-empty", "--interventions EMPTYBIN", "error: cannot be read: it is empty (EOFError)"),
    ("bin-corrupt", "--interventions CORRUPT", "error: cannot be read: it is not a state dict torch.save wrote"),
    ("positions-x3", "--interventions SAVED --positions x3", "error: --positions 'x3': pyreft reads it as no position"),
    ("max-new-tokens-0", "--interventions SAVED --max_new_tokens 0", "error: --max_new_tokens 0: generate at least 1"),
    ("positions-beyond-prompt", "--interventions SAVED --positions l3", "error: --positions l3: --prompt 'red cat runs' "
                                                                         "has "),
    ("answers", "--interventions SAVED", " red cat runs"),
    # issue 50: a run's output folder, or its checkpoint, for its reft/; a file, or a folder without the tokenizer
    ("output-dir", "--interventions TRAINED", "error: --interventions TRAINED has no config.json: it is a training "
                                              "run's --output_dir, whose interventions are in SAVED"),
    ("checkpoint", "--interventions CHECKPOINTED", "error: it is a checkpoint of a run, to resume training from"),
    ("model-a-file", "--interventions SAVED --model SAVED/config.json", "error: --model SAVED/config.json is a file; "
                                                                       "expected the model's folder"),
    ("model-without-tokenizer", "--interventions SAVED --model NOTOKENIZER", "error: --model NOTOKENIZER holds no "
                                                                             "tokenizer"),
]

#: Runs each case of argv[1] in this one process; prints, per case, what it ended with: ("error", message),
#: ("ok", the warnings' text, the answer or the saved weights' names).
RUNNER = """
import contextlib, io, json, logging, sys, warnings
sys.path.insert(0, "docs/examples")
import serve_reft, train_reft
found = []
for script, argv, out in json.loads(sys.argv[1]):
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if script == "train":
                train_reft.main(argv)
            else:
                serve_reft.main(argv + ["--out", out])
        if script == "train":
            import os
            result = sorted(os.listdir(os.path.join(argv[argv.index("--output_dir") + 1], "reft")))
        else:
            import torch
            result = torch.load(out)["text"]
        found.append(["ok", " | ".join(str(w.message) for w in caught), result])
    except SystemExit as error:
        found.append(["error", f"{error.code}\\n{stderr.getvalue()}", None])
    except Exception as error:
        found.append(["error", f"{type(error).__name__}: {error}", None])
print("FOUND " + json.dumps(found))
"""


def run_cases(cases: list, folder: Path) -> list:
    """RUNNER on ``cases``, as ``python -c RUNNER`` in the repository with one intra-op thread, in a process forked
    from the preloaded server (launchers.run_forked: torch, transformers and pyvene are not imported again)."""
    from launchers import run_forked

    runner = folder / "runner.py"
    runner.write_text(RUNNER)
    output = run_forked(runner, [json.dumps(cases)], cwd=ROOT, timeout=600)
    lines = [line for line in output.splitlines() if line.startswith("FOUND ")]
    assert lines, f"the runner failed:\n{output[-8000:]}"
    return json.loads(lines[0][len("FOUND "):])


def unwritable_folder(tmp_path: Path) -> Path:
    """A folder this process cannot create files in: a read-only one, or, for root (whom modes do not stop),
    one of sysfs's."""
    if os.geteuid() != 0:
        folder = tmp_path / "read-only"
        folder.mkdir()
        folder.chmod(0o500)
        return folder
    if os.path.isdir("/sys/kernel") and not os.access("/sys/kernel", os.W_OK | os.X_OK) or \
            _cannot_write("/sys/kernel"):
        return Path("/sys/kernel")
    pytest.skip("running as root with no folder root cannot write to")


def _cannot_write(folder: str) -> bool:
    import tempfile

    try:
        with tempfile.NamedTemporaryFile(dir=folder):
            return False
    except OSError:
        return True


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory) -> Path:
    from pyvene_dist.testing.models import instruction_examples, save_checkpoint

    folder = save_checkpoint(tmp_path_factory.mktemp("model"))
    for name, examples in DATA.items():
        (folder / f"{name}.json").write_text(json.dumps(instruction_examples(4) if examples is None else examples))
    return folder


@pytest.fixture(scope="module")
def no_tokenizer_folder(model_folder, tmp_path_factory) -> Path:
    """The model of ``model_folder`` without its tokenizer files."""
    folder = tmp_path_factory.mktemp("no-tokenizer")
    for name in ("config.json", "model.safetensors"):
        shutil.copy(model_folder / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def script_results(model_folder, no_tokenizer_folder, tmp_path_factory) -> dict:
    """Every train and serve case, in one process of its own (run_cases). The serve cases read interventions saved
    here with pyreft's ``ReftModel.save`` and train_reft.py's settings beside them (as saved, or copied and
    broken)."""
    import transformers

    from pyvene_dist.testing import models

    work = tmp_path_factory.mktemp("runs")
    saved = work / "trained" / "reft"
    models.reft_model(transformers.AutoModelForCausalLM.from_pretrained(model_folder), layers=(0, 1)).save(
        str(saved), save_to_hf_hub=False)
    (saved / "train_settings.json").write_text(json.dumps({"model": str(model_folder), "positions": "l1",
                                                           "share_weights": False, "dtype": "float32"}))
    places = {"UNWRITABLE": str(unwritable_folder(work)), "EMPTY": str(work / "empty"), "SAVED": str(saved),
              "MOVED": str(work / "moved"), "EMPTYBIN": str(work / "empty-bin"), "CORRUPT": str(work / "corrupt"),
              "WIDE": str(_wider_model(model_folder, work / "wide")), "MODEL-GONE": str(work / "model-gone"),
              "TRAINED": str(work / "trained"), "CHECKPOINTED": str(work / "checkpoint-2"),
              "NOTOKENIZER": str(no_tokenizer_folder), "ZERO3CONFIG": str(ROOT / "docs/configs/deepspeed-zero3.json")}
    (work / "empty").mkdir()
    (work / "checkpoint-2").mkdir()
    (work / "checkpoint-2" / "trainer_state.json").write_text("{}")
    for name, corrupt in (("MOVED", None), ("EMPTYBIN", b""), ("CORRUPT", b"not a torch file at all")):
        shutil.copytree(saved, places[name])
        if corrupt is not None:
            next(Path(places[name]).glob("intkey_*.bin")).write_bytes(corrupt)
    settings_file = Path(places["MOVED"]) / "train_settings.json"
    settings_file.write_text(json.dumps({**json.loads(settings_file.read_text()), "model": places["MODEL-GONE"]}))
    # the flag given last wins in HF's parser: an --output_dir in the case replaces the default one
    trains = [["train", ["--model", str(model_folder), "--data", str(model_folder / f"{data}.json"), *TRAIN_FLAGS,
                         "--output_dir", str(work / f"train-{number}"),
                         *("" if part == "''" else part for part in _fill(flags, places).split())], None]
              for number, (_, flags, data, _) in enumerate(TRAIN_CASES)]
    serves = [["serve", ["--prompt", "red cat runs", "--max_new_tokens", "3", *_fill(flags, places).split()],
               str(work / f"answer-{number}.pt")] for number, (_, flags, _) in enumerate(SERVE_CASES)]
    # DeepSpeed's runs last: ZeRO-3's config outlives the run in this process (HF keeps it, and loads every later
    # model partitioned), and they leave the launcher's variables of a world of one behind
    last = [number for number, case in enumerate(TRAIN_CASES) if "--deepspeed" in case[1]]
    order = [number for number in range(len(trains)) if number not in last] + \
        [len(trains) + number for number in range(len(serves))] + last
    found = dict(zip(order, run_cases([(trains + serves)[number] for number in order], work)))
    results = [found[number] for number in range(len(trains) + len(serves))]
    return {"train": dict(zip([case[0] for case in TRAIN_CASES], results[:len(trains)])),
            "serve": dict(zip([case[0] for case in SERVE_CASES], results[len(trains):])), "places": places}


def _wider_model(model_folder: Path, folder: Path) -> Path:
    """The model of ``model_folder`` with twice its hidden size, and the same tokenizer."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(model_folder)
    config.hidden_size, config.intermediate_size = 2 * config.hidden_size, 2 * config.intermediate_size
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    transformers.AutoTokenizer.from_pretrained(model_folder).save_pretrained(folder)
    return folder


def _fill(text: str, places: dict) -> str:
    """``text`` with each placeholder (``SAVED``, ``EMPTYBIN``, ...) replaced by its path, the longest first."""
    for name, path in sorted(places.items(), key=lambda item: -len(item[0])):
        text = text.replace(name, path)
    return text


def _expect(found, expected: str, places: dict) -> None:
    expected = _fill(expected, places)
    kind, text, result = found
    print(f"{kind}: {text.strip()[:600]}")
    if expected.startswith("error: "):
        assert kind == "error", f"expected an error, the run ended with {found}"
        assert expected[len("error: "):] in text, text
        assert "weights_only=False" not in text  # never the unsafe advice
    elif expected.startswith("warning: "):
        assert kind == "ok", text
        assert expected[len("warning: "):] in text, text
        assert any(name.startswith("intkey_") for name in result), result  # it trained and saved
    else:
        assert kind == "ok", text
        assert str(result).startswith(expected), result


@pytest.mark.parametrize("case", TRAIN_CASES, ids=[case[0] for case in TRAIN_CASES])
def test_train_reft_refuses_what_would_train_nothing_or_warns(script_results, case):
    _expect(script_results["train"][case[0]], case[3], script_results["places"])


@pytest.mark.parametrize("case", SERVE_CASES, ids=[case[0] for case in SERVE_CASES])
def test_serve_reft_names_what_does_not_fit(script_results, case):
    _expect(script_results["serve"][case[0]], case[2], script_results["places"])


# --- pyvene-dist tiny-model ------------------------------------------------------------------------------------

#: (id, what is at the target before, exit code, words on stderr)
TINY_MODEL_CASES = [
    ("non-empty-folder", "folder:config.json", 2, "the folder holds 1 entry (config.json); give a new or empty folder"),
    ("a-file", "file", 2, "a file is there; give a new or empty folder"),
    ("empty-folder", "folder:", 0, ""),
]


@pytest.mark.parametrize("case", TINY_MODEL_CASES, ids=[case[0] for case in TINY_MODEL_CASES])
def test_tiny_model_saves_into_a_new_or_empty_folder_only(tmp_path, capsys, monkeypatch, case):
    """What it saves is test_cli's: here the save is a stand-in that writes config.json, and must not be reached
    where the target is refused."""
    from pyvene_dist import __main__ as command

    main = command.main
    monkeypatch.setattr(command, "save_checkpoint", lambda folder: (Path(folder) / "config.json").write_text("tiny"))

    _, before, code, words = case
    target = tmp_path / "target"
    if before == "file":
        target.write_text("mine")
    else:
        target.mkdir()
        for name in filter(None, before.split(":")[1:]):
            (target / name).write_text("{}")
    held = {path.name: path.read_text() for path in target.iterdir()} if target.is_dir() else target.read_text()
    assert main(["tiny-model", str(target)]) == code
    assert words in capsys.readouterr().err
    if code:  # left exactly as it was
        assert held == ({path.name: path.read_text() for path in target.iterdir()} if target.is_dir()
                        else target.read_text())
    else:
        assert (target / "config.json").read_text() == "tiny"


# --- unit_locations and interventions -------------------------------------------------------------------------

BATCH, LENGTH = 2, 8
#: (id, unit_locations for a 2-intervention model and a batch of 2, words of the error)
LOCATIONS = [
    ("float-position", {"sources->base": (None, [[[7.5]] * BATCH, [[3]] * BATCH])},
     "unit_locations['sources->base'][1][0][0] holds position 7.5; positions are integers (pyvene would take 7)"),
    ("flat-list", {"sources->base": (None, [7, 7])},
     "unit_locations['sources->base'][1][0] is 7, expected rows of positions: one list per example"),
    ("row-an-int", {"sources->base": (None, [[7, 7], [[3]] * BATCH])},
     "unit_locations['sources->base'][1][0][0] is 7, expected a list of positions such as [7]"),
    ("float-tensor", {"sources->base": (None, torch.full((2, BATCH, 1), 7.0))},
     "unit_locations['sources->base'][1][0] is a tensor of torch.float32; positions are integers"),
]


@pytest.mark.parametrize("case", LOCATIONS, ids=[case[0] for case in LOCATIONS])
def test_unit_locations_of_another_form_are_refused(patched, case):
    from pyvene_dist.fixes.locations import LocationError
    from pyvene_dist.testing import models

    _, locations, words = case
    model = models.reft_model(models.tiny_llama(), layers=(0, 1), rank=2)
    ids = torch.randint(models.VOCAB_SIZE, (BATCH, LENGTH), generator=torch.Generator().manual_seed(0))
    with pytest.raises(LocationError) as error:
        model({"input_ids": ids}, unit_locations=locations)
    assert words in str(error.value), str(error.value)


def test_pyrefts_default_bfloat16_loreft_on_a_float32_model_is_named(patched):
    """pyreft's ``LoreftIntervention`` defaults to bfloat16: on a float32 model its first matmul failed with
    ``mat1 and mat2 must have the same dtype``; under autocast it runs."""
    import pyreft

    from pyvene_dist.testing import models

    base = models.tiny_llama()
    intervention = pyreft.LoreftIntervention(embed_dim=base.config.hidden_size, low_rank_dimension=2)
    model = pyreft.get_reft_model(base, pyreft.ReftConfig(representations=[
        {"layer": 0, "component": "block_output", "low_rank_dimension": 2, "intervention": intervention}]))
    ids = torch.randint(models.VOCAB_SIZE, (BATCH, LENGTH), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"the intervention layer_0_comp_block_output_unit_pos_nunit_1#0 "
                                         r"\(LoreftIntervention\) holds its learned_source in torch.bfloat16 but the "
                                         r"model computes in torch.float32.*build them with dtype=torch.float32"):
        model({"input_ids": ids}, unit_locations={"base": 3})
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model({"input_ids": ids}, unit_locations={"base": 3})


# --- loads of broken folders, through the patch's own load path ---------------------------------------------------

#: (id, how the folder is loaded, the file broken (``*`` for the first match), its new bytes or "half" for the first
#: half of it, the words of the error). Loaded directly, under the patch: no example script checks the files first.
LOADS = [
    ("load-intkey-empty", "load", "intkey_*.bin", b"", "cannot be read: it is empty (0 bytes) (EOFError)"),
    ("load-intkey-corrupt", "load", "intkey_*.bin", b"not a torch file at all",
     "cannot be read: its 23 bytes are not a state dict torch.save wrote (UnpicklingError)"),
    ("load-states-half", "load", "intervention_states.pt", "half", "intervention_states.pt cannot be read"),
    ("load-intervention-states-empty", "load_intervention", "intervention_states.bin", b"",
     "intervention_states.bin cannot be read: it is empty (0 bytes) (EOFError)"),
    ("load-intkey-pickle", "load", "intkey_*.bin", b"\x80\x02not pickled",
     "cannot be read: its 13 bytes are not a state dict torch.save wrote"),
    ("load-intkey-half", "load", "intkey_*.bin", "half", "cannot be read: its "),
]


@pytest.mark.parametrize("case", LOADS, ids=[case[0] for case in LOADS])
def test_loading_a_broken_file_names_it_and_never_suggests_weights_only_false(patched, tmp_path, case):
    """pyvene's load failed with torch's advice to retry with ``weights_only=False`` (which runs the file's code), or
    a bare ``EOFError``."""
    import pyreft

    from pyvene_dist.fixes.checkpoints import UnreadableCheckpointError
    from pyvene_dist.testing import models

    _, how, pattern, content, words = case
    model = models.reft_model(models.tiny_llama(), layers=(0, 1), rank=2)
    folder = tmp_path / "saved"
    if how == "load":
        model.save(str(folder), save_to_hf_hub=False)
    else:
        model.save_intervention(str(folder), include_model=False)
    broken = sorted(folder.glob(pattern))[0]
    broken.write_bytes(broken.read_bytes()[:broken.stat().st_size // 2] if content == "half" else content)
    with pytest.raises(UnreadableCheckpointError) as error:
        if how == "load":
            pyreft.ReftModel.load(str(folder), models.tiny_llama())
        else:
            models.reft_model(models.tiny_llama(), layers=(0, 1), rank=2).load_intervention(str(folder),
                                                                                        include_model=False)
    message = str(error.value)
    assert str(broken) in message and words in message and "weights_only=False" not in message, message


# --- ranks: started without RANK/LOCAL_RANK, given other data, stopped ------------------------------------------

def _tiny_trainer(folder, output_dir, examples: int, **overrides):
    """pyreft's README flow on the checkpoint ``folder``: one LoReFT at the last prompt position, trained with
    ``ReftTrainerForCausalLM`` on ``examples`` examples, one per rank and step."""
    import pyreft
    import transformers

    from pyvene_dist.testing import models

    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    base = transformers.AutoModelForCausalLM.from_pretrained(folder)
    model = models.reft_model(base, layers=(0,), rank=2)
    data = models.instruction_examples(examples)
    module = pyreft.make_last_position_supervised_data_module(
        tokenizer, base, [row["instruction"] for row in data], [row["output"] for row in data])
    settings = dict(output_dir=str(output_dir), per_device_train_batch_size=1, max_steps=2, learning_rate=1e-2,
                    report_to=[], use_cpu=True, disable_tqdm=True, remove_unused_columns=False, save_strategy="no",
                    logging_steps=1)
    arguments = transformers.TrainingArguments(**{**settings, **overrides})
    return pyreft.ReftTrainerForCausalLM(model=model, processing_class=tokenizer, args=arguments, **module), model


@pytest.mark.world_size(2)
def test_ranks_started_without_rank_variables_take_them_from_the_process_group(model_folder, tmp_path):
    """An early version of pyreft's examples/alpaca/train_multigpu.py starts its ranks with ``mp.spawn`` and joins
    the group with ``init_process_group(rank=..., world_size=...)``: no RANK, LOCAL_RANK, WORLD_SIZE. HF's
    arguments then made every rank process 0 of 1, each saving every checkpoint into the same folder."""
    import torch.distributed as dist

    helpers.patch()
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        os.environ.pop(name, None)
    output_dir = tmp_path / "out"  # the ranks' tmp_path is one folder: they share it, as the example's ranks do
    trainer, _ = _tiny_trainer(model_folder, output_dir, 4, save_strategy="steps", save_steps=1, max_steps=1)
    assert (trainer.args.process_index, trainer.args.world_size) == (dist.get_rank(), 2)
    assert trainer.is_world_process_zero() == (dist.get_rank() == 0)
    trainer.train()
    assert [path.name for path in output_dir.glob("checkpoint-*")] == ["checkpoint-1"]


@pytest.mark.world_size(2)
def test_ranks_given_different_data_are_refused_naming_each_rank(model_folder, tmp_path):
    import torch.distributed as dist

    helpers.patch()
    trainer, _ = _tiny_trainer(model_folder, tmp_path / f"rank{dist.get_rank()}", 4 + 2 * dist.get_rank())
    with pytest.raises(ValueError, match=r"the ranks' training data differ: len\(train_dataset\) is 4 on rank 0, 6 on "
                                         r"rank 1"):
        trainer.train()


#: One rank of a 2-rank CPU run (started by torchrun, or as torchrun starts it): rank 1 sends itself argv[4] (STOP or
#: KILL) after its first step, and rank 0 waits for it in the next step's gradient all-reduce.
FAULTY_RANK = """
import os, signal, sys
sys.path.insert(0, "tests")
import pyvene_dist
pyvene_dist.patch()
import transformers
from test_inputs import _tiny_trainer

class SignalRankOne(transformers.TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if args.process_index == 1 and state.global_step == 1:
            print(f"rank 1 gets SIG{sys.argv[4]}", flush=True)
            os.kill(os.getpid(), getattr(signal, "SIG" + sys.argv[4]))

trainer, _ = _tiny_trainer(sys.argv[1], sys.argv[2], 8, max_steps=4, ddp_timeout=int(sys.argv[3]))
trainer.add_callback(SignalRankOne())
trainer.train()
"""


def _run_ranks(commands: list[list[str]], timeout: float, environment: dict | None = None,
               after_first: float = 30) -> tuple[list, str]:
    """``python COMMAND`` for each rank (RANK, LOCAL_RANK and the rendezvous set as torchrun sets them, unless
    ``environment`` is given), all at once; any still running at ``timeout`` seconds, or ``after_first`` seconds
    after the first ended, is killed with its children.
    Returns each one's exit code (None: killed at the timeout) and a report of every one's output."""
    from pyvene_dist.testing.launch import free_port

    shared = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
              "WORLD_SIZE": str(len(commands)), "LOCAL_WORLD_SIZE": str(len(commands))}
    processes = [subprocess.Popen([sys.executable, *command], cwd=ROOT, text=True, start_new_session=True,
                                  env=environment or {**shared, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
                 for rank, command in enumerate(commands)]
    deadline = time.monotonic() + timeout
    codes, outputs = [], []
    for number, process in enumerate(processes):
        if number == 1:  # the first has ended: the others get after_first seconds more
            deadline = min(deadline, time.monotonic() + after_first)
        try:
            output, _ = process.communicate(timeout=max(0.0, deadline - time.monotonic()))
            codes.append(process.returncode)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            output, _ = process.communicate()
            codes.append(None)
        outputs.append(output)
    for process in processes:  # the ranks' own children (gloo's, torchrun's workers)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    return codes, "\n".join(f"--- process {number}: exit {code} ---\n{output[-4000:]}"
                            for number, (code, output) in enumerate(zip(codes, outputs)))


@pytest.mark.slow  # two rank processes started as a launcher starts them
def test_a_stopped_rank_ends_the_run_within_ddp_timeout_naming_the_rank(model_folder, tmp_path):
    """``--ddp_timeout`` with ``use_cpu``: HF left it out of the gloo group, and rank 0 waited gloo's default 30
    minutes for a stopped rank (SIGSTOP)."""
    arguments = ["-c", FAULTY_RANK, str(model_folder), str(tmp_path / "out"), "5", "STOP"]
    # rank 1 is stopped and never ends by itself: killed as soon as rank 0 ended (its output is read after)
    codes, report = _run_ranks([arguments, arguments], timeout=240, after_first=0)
    assert codes[0] is not None, f"rank 0 still waited after 240 s for the stopped rank 1:\n{report}"
    assert "rank 1 gets SIGSTOP" in report and codes[0] != 0 and "Timed out" in report, report
    # gloo's timeout names the rank that waited (torch prefixes its lines), not the one it waited for
    assert re.search(r"\[rank0\]: RuntimeError: .*Timed out", report), f"rank 0's error names no rank:\n{report}"


@pytest.mark.slow  # torchrun and its two ranks
def test_a_killed_rank_ends_the_run_at_once_naming_the_rank(model_folder, tmp_path):
    """A rank killed (SIGKILL) mid-training: torchrun stops the other and names the rank that died."""
    from pyvene_dist.testing.launch import free_port

    script = tmp_path / "faulty_rank.py"
    script.write_text(FAULTY_RANK)
    codes, report = _run_ranks([["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
                                 "--master_port", str(free_port()), str(script), str(model_folder),
                                 str(tmp_path / "out"), "60", "KILL"]], timeout=180,
                               environment={**os.environ, "OMP_NUM_THREADS": "1"})
    assert codes[0] is not None, f"torchrun still ran 180 s after rank 1 was killed:\n{report}"
    # torchrun's summary: the rank, its exit code and the signal
    assert codes[0] != 0 and re.search(r"rank\s*: 1 \(local_rank: 1\)\s*exitcode\s*: -9 .*\s*.*\s*traceback\s*: "
                                       r"Signal 9 \(SIGKILL\)", report), report


@pytest.mark.slow  # two rank processes started as a launcher starts them
def test_a_read_only_output_dir_on_one_rank_stops_every_rank_naming_it(model_folder, tmp_path):
    """One rank of two whose --output_dir cannot be written (a node's read-only disk): train_reft.py stopped that
    rank alone, and neither rank's message said which rank could not write. Every rank now stops, naming it."""
    read_only = unwritable_folder(tmp_path)
    data = tmp_path / "train.json"
    data.write_text(json.dumps(_four_examples()))

    def arguments(output_dir):
        return ["docs/examples/train_reft.py", "--model", str(model_folder), "--data", str(data), *TRAIN_FLAGS,
                "--output_dir", str(output_dir)]

    codes, report = _run_ranks([arguments(tmp_path / "out"), arguments(read_only / "out")], timeout=120)
    assert None not in codes, f"a rank still ran after 120 s:\n{report}"
    words = f"train_reft.py: rank 1: --output_dir {read_only / 'out'} cannot be written"
    assert codes == [1, 1] and report.count(words) >= 2, f"expected every rank to stop with {words!r}:\n{report}"


def _four_examples() -> list:
    from pyvene_dist.testing.models import instruction_examples

    return instruction_examples(4)


# --- properties: what the examples accept means what pyreft reads -----------------------------------------------

@pytest.fixture(scope="module")
def examples():
    """docs/examples/train_reft.py and serve_reft.py as modules; they patch at import, undone at once (what the
    properties read of them runs unpatched)."""
    import pyvene_dist

    sys.path.insert(0, str(ROOT / "docs" / "examples"))
    try:
        import serve_reft
        import train_reft
    finally:
        sys.path.remove(str(ROOT / "docs" / "examples"))
        pyvene_dist.unpatch()
    return train_reft, serve_reft


def test_quantize_4bit_loads_the_base_as_qlora_packed_in_the_dtype(examples, model_folder, tmp_path):
    """--quantize 4bit: every linear layer of the decoder is bitsandbytes' NF4, packed in --dtype (what FSDP2 needs
    to shard it: docs/loading.md), the embeddings and the interventions' dtype untouched."""
    bnb = pytest.importorskip("bitsandbytes")
    train_reft, _ = examples
    reft_args, _ = train_reft.parse_arguments(["--model", str(model_folder), "--data", str(model_folder / "train.json"),
                                               "--output_dir", str(tmp_path), "--quantize", "4bit", "--dtype",
                                               "bfloat16", "--use_cpu"])
    _, model = train_reft.load_model(reft_args)
    layers = [module for name, module in model.named_modules() if ".layers." in name
              and isinstance(module, torch.nn.Linear)]
    assert layers and all(isinstance(layer, bnb.nn.Linear4bit) for layer in layers), layers
    assert {layer.weight.quant_state.quant_type for layer in layers} == {"nf4"}
    assert {layer.weight.dtype for layer in layers} == {torch.bfloat16}  # the packed storage
    assert model.get_input_embeddings().weight.dtype == torch.bfloat16


POSITION_TEXT = st.one_of(st.text(alphabet="fl+x0123456789 ", max_size=8),
                          st.from_regex(r"\A(f\d{1,2})?\+?(l\d{1,2})?\Z"))


@given(text=POSITION_TEXT)
def test_accepted_positions_are_what_pyreft_reads_and_not_none(examples, text):
    """Every --positions the examples accept, pyreft's parse_positions reads as the same counts, at least one
    position; what pyreft reads as no position (or misreads) is refused."""
    import pyreft

    _, serve_reft = examples
    counts = serve_reft.positions_counts(text)
    if counts is not None:
        assert pyreft.parse_positions(text) == counts and sum(counts) >= 1, (text, counts)
    else:
        try:
            read = pyreft.parse_positions(text)
        except ValueError:
            return
        # pyreft reads it as no position, or as counts that are not the text's own (f1+1 read as f1+l1)
        assert sum(read) == 0 or f"f{read[0]}+l{read[1]}" != text, (text, read)


JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=5),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner,
                                                                                         max_size=3), max_leaves=8)
EXAMPLE = st.fixed_dictionaries({"instruction": st.text(max_size=5) | JSON_VALUES,
                                 "output": st.text(max_size=5) | JSON_VALUES})


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("data") / "train.json"


@given(data=st.lists(EXAMPLE | JSON_VALUES, max_size=4) | JSON_VALUES)
def test_any_data_file_is_read_or_refused_naming_data(examples, data_file, data):
    """A --data file of any JSON: read as examples with string instructions and outputs, or refused with a
    message that names --data (pyreft failed on them later: num_samples=0, a TypeError for null)."""
    train_reft, _ = examples
    path = data_file
    path.write_text(json.dumps(data))
    try:
        read = train_reft.read_examples(str(path))
    except SystemExit as error:
        assert str(error.code).startswith(f"train_reft.py: --data {path}"), error.code
        return
    assert read and all(isinstance(example["instruction"], str) and isinstance(example["output"], str)
                        for example in read)


# --- the property end to end: every draw of flags and data trains the interventions or stops naming a flag --------

#: Draws of the end-to-end property: 40 in CI (a quarter train one step; ~10 s in all), more in its long mode:
#: PYVENE_DIST_INPUT_DRAWS=500 python -m pytest -q tests/test_inputs.py -k end_to_end
END_TO_END_DRAWS = int(os.environ.get("PYVENE_DIST_INPUT_DRAWS", 40))
WORD = st.sampled_from(["red", "cat", "runs", "big", "dog"])
TEXT = st.lists(WORD, max_size=5).map(" ".join)
DRAWN_EXAMPLES = st.lists(st.fixed_dictionaries({"instruction": TEXT,
                                                 "output": TEXT.map(lambda text: " " + text) | st.none()}),
                          max_size=3)
ENOUGH_EXAMPLES = st.lists(st.fixed_dictionaries({"instruction": st.lists(WORD, min_size=2, max_size=6).map(" ".join),
                                                  "output": st.lists(WORD, min_size=1, max_size=3).map(
                                                      lambda words: " " + " ".join(words))}), min_size=1, max_size=3)
POSITIONS = st.sampled_from(["l1", "f1", "f1+l1", "l2", "f2+l2"]) | st.sampled_from(["l3", "x3", "f0+l0", "l0", "f1l1",
                                                                                 "3"])
TRAIN_FLAG_VALUES = {
    "--positions": POSITIONS,
    "--rank": st.integers(1, 3).map(str) | st.integers(-1, 0).map(str),
    "--layers": st.sampled_from(["all", "0", "1", "0,1", "0;1"]) | st.sampled_from(["0,,1", "2", "-1"]),
    "--share_weights": st.sampled_from(["true", "false"]),
    "--intervention": st.sampled_from(["LoreftIntervention", "NoreftIntervention"]) | st.just("Nope"),
    "--dtype": st.sampled_from(["float32", "bfloat16", "bf16"]) | st.sampled_from(["float64", "nope"]),
    "--model_max_length": st.sampled_from(["4", "8", "128"]) | st.sampled_from(["1", "2"]),
}
LAST_LAYER = "layer_1_"  # the tiny model's, of 2
SERVE_FLAG_VALUES = {
    "--positions": POSITIONS,
    "--dtype": st.sampled_from(["float32", "bfloat16", "float16", "nope"]),
    "--share_weights": st.just(None),
    "--max_new_tokens": st.integers(1, 3).map(str) | st.just("0"),
}


def _flags(values: dict) -> st.SearchStrategy:
    return st.fixed_dictionaries({}, optional=values).map(
        lambda chosen: [part for flag, value in chosen.items() for part in ((flag,) if value is None else
                                                                             (flag, value))])


def _stopped(run, argv) -> str | None:
    """None where ``run(argv)`` returned; else the message it stopped with: a ``SystemExit``'s text (argparse's
    ``error:`` line), or a ``ValueError``'s. Any other exception is no clear error, and fails the test."""
    import io

    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            run(argv)
    except SystemExit as error:
        lines = [line for line in stderr.getvalue().splitlines() if "error:" in line]
        return str(error.code) if isinstance(error.code, str) else "\n".join(lines) or f"exit {error.code}"
    except ValueError as error:
        return f"{type(error).__name__}: {error}"
    return None


@settings(max_examples=END_TO_END_DRAWS, deadline=None, suppress_health_check=list(HealthCheck),
          phases=(Phase.explicit, Phase.reuse, Phase.generate))  # a draw trains: shrinking took minutes
@given(train_flags=_flags(TRAIN_FLAG_VALUES), data=ENOUGH_EXAMPLES | DRAWN_EXAMPLES, serve_flags=_flags(SERVE_FLAG_VALUES))
def test_end_to_end_every_draw_trains_every_intervention_or_stops_naming_a_flag(
        examples, model_folder, data_file, train_flags, data, serve_flags):
    """train_reft.py run in-process on the tiny model for one step with drawn flags and data: it stops with a message
    that names one of the flags given (or --data), or every intervention it saved differs from how it was built.
    serve_reft.py then answers with those interventions and drawn flags, or stops naming one."""
    import tempfile
    from unittest import mock

    import pyreft

    import pyvene_dist

    import warnings

    train_reft, serve_reft = examples
    data_file.write_text(json.dumps(data))
    built = {}

    def recording(*args, **kwargs):
        model = get_reft_model(*args, **kwargs)
        built.update({name: tensor.detach().clone() for name, tensor in model.interventions.state_dict().items()})
        return model

    helpers.patch()
    get_reft_model = pyreft.get_reft_model
    try:
        with tempfile.TemporaryDirectory() as output_dir, mock.patch.object(pyreft, "get_reft_model", recording):
            argv = ["--model", str(model_folder), "--data", str(data_file), *TRAIN_FLAGS, "--output_dir", output_dir,
                    *train_flags]
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                stopped = _stopped(train_reft.main, argv)
            event("train_reft.py stopped" if stopped else "train_reft.py trained")
            if stopped is not None:
                named = [*TRAIN_FLAG_VALUES, "--data", "--output_dir"]  # one given, or a default that does not fit
                assert any(flag in stopped for flag in named), f"{argv}\nstopped naming none of {named}: {stopped}"
                return
            saved = torch.load(Path(output_dir) / "reft" / "intervention_states.pt", weights_only=True)
            unchanged = sorted({name.split(".")[0] for name in built} -
                               {name.split(".")[0] for name in built if not torch.equal(saved[name], built[name])})
            # an intervention for the first positions on the last layer (#0: pyreft puts first before last) trains
            # nothing, and train_reft.py says so
            warned = any("trains nothing" in str(warning.message) for warning in caught)
            unwarned = [name for name in unchanged if not (warned and name.startswith(LAST_LAYER) and
                                                           name.endswith("#0"))]
            assert built and not unwarned, f"{argv}: trained nothing in {unwarned}, and said nothing"

            out = Path(output_dir) / "answer.pt"
            argv = ["--interventions", str(Path(output_dir) / "reft"), "--prompt", "red cat runs", *serve_flags,
                    "--out", str(out)]
            stopped = _stopped(serve_reft.main, argv)
            event("serve_reft.py stopped" if stopped else "serve_reft.py answered")
            if stopped is not None:
                named = [*SERVE_FLAG_VALUES, "--prompt", "--interventions"]
                assert any(flag in stopped for flag in named), f"{argv}\nstopped naming none of {named}: {stopped}"
                return
            answer = torch.load(out, weights_only=True)
            assert isinstance(answer["text"], str) and torch.isfinite(answer["logits"]).all(), argv
    finally:
        pyvene_dist.unpatch()


# --- serving: generation keywords, server request fields, and hostile bodies (issue 50) ----------------------------
# Its own section (another section of this file draws launch flags and resume): MultiReftModel.generate with drawn
# beams, return sequences and sampling, then the server (the session's pyvene-dist serve, tests/conftest.py's
# serving_server, which tests/test_openai_server.py calls too) with drawn request fields, then with drawn JSON bodies
# nobody wrote cases for. END_TO_END_DRAWS each.

SERVED_REFTS = ("lo", "di")
GENERATE_WORDS = st.lists(WORD, min_size=2, max_size=6).map(" ".join)


@pytest.fixture(scope="module")
def serving(serving_saved, serving_server, one_thread):
    """A MultiReftModel of two ReFTs on the serving tests' tiny base (the session's, ``serving_saved``), its tokenizer,
    pyreft's answers, the session's server (``serving_server``: pyvene-dist serve of lo, no and di), and the tokens
    it gives a request without max_tokens: (many, tokenizer, alone, url, default_tokens). One intra-op thread from
    here on (``one_thread``). Skipped without pyreft (``serving_saved``)."""
    import transformers
    from serving_refts import NEW_TOKENS, load_many

    tokenizer = transformers.AutoTokenizer.from_pretrained(serving_saved.base_folder, padding_side="left")
    return load_many(serving_saved, SERVED_REFTS), tokenizer, serving_saved.alone, serving_server, NEW_TOKENS


@pytest.fixture
def patched_throughout():
    """pyvene_dist patched for a whole drawn test, for pyreft's answers (a patch and unpatch at each draw spent 0.3 s of
    CPU); the server runs in its own process."""
    import pyvene_dist

    with pyvene_dist.patched():
        yield


#: Sampling as greedy (top_k=1), so that a row's copies can be compared with the row generated alone.
GENERATION = st.fixed_dictionaries({"num_beams": st.integers(1, 3)}, optional={
    "num_return_sequences": st.integers(1, 3), "do_sample": st.booleans()}).map(
    lambda keywords: {**keywords, "top_k": 1} if keywords.get("do_sample") else keywords)


@settings(max_examples=END_TO_END_DRAWS, deadline=None, suppress_health_check=list(HealthCheck))
@given(prompts=st.lists(GENERATE_WORDS, min_size=1, max_size=3), data=st.data(), keywords=GENERATION,
       on_prompt=st.booleans())
def test_mixed_generate_keeps_each_rows_reft_for_any_beams_sequences_or_sampling(serving, prompts, data, keywords,
                                                                                  on_prompt):
    """MultiReftModel.generate with drawn rows' ReFTs, beams, return sequences and sampling (greedy through top_k=1):
    generate's own refusal (a ValueError naming the keyword), or every row's copies equal to that row generated on its
    own (at 09d6d98 beams and sequences swapped or dropped the ReFTs). Pyreft's equality: tests/test_serving.py."""
    many, tokenizer, *_ = serving
    names = data.draw(st.lists(st.sampled_from([None, *SERVED_REFTS]), min_size=len(prompts), max_size=len(prompts)))
    settings_ = dict(max_new_tokens=3, pad_token_id=tokenizer.pad_token_id, intervene_on_prompt=on_prompt, **keywords)
    inputs = tokenizer(prompts, return_tensors="pt", padding=True)
    try:
        ids = many.generate(inputs, refts=names, **settings_)
    except ValueError as error:
        assert any(word in str(error) for word in (*keywords, "positions", "prompt")), error
        event("refused")
        return
    copies = keywords.get("num_return_sequences", 1)
    assert ids.shape[0] == len(prompts) * copies
    width = inputs["input_ids"].shape[1]
    for row, (name, prompt) in enumerate(zip(names, prompts)):
        one = tokenizer([prompt], return_tensors="pt", padding=True)
        alone = many.generate(one, refts=[name], **settings_)
        mine = ids[row * copies:(row + 1) * copies, width:]
        assert [tokens[tokens != tokenizer.pad_token_id].tolist() for tokens in mine] == \
            [tokens[tokens != tokenizer.pad_token_id].tolist() for tokens in alone[:, one["input_ids"].shape[1]:]], \
            (name, prompt, keywords)
    event("generated")


FIELD_VALUES = {
    "model": st.sampled_from(["base", *SERVED_REFTS]) | st.sampled_from(["poet", "", None, ["lo"], 3]),
    "prompt": GENERATE_WORDS | st.sampled_from(["", "red", 5, ["red cat"], " ".join(["red cat runs"] * 50)]),
    "max_tokens": st.integers(1, 4) | st.sampled_from([0, -1, True, "4", 4.0, 1000, None]),
    "temperature": st.sampled_from([0, 0.0, None, 1, 0.5, "0"]),
    "top_p": st.sampled_from([1, 1.0, None, 0.5]),
    "n": st.sampled_from([1, None, 2]),
    "stop": st.sampled_from([None, "cat", ["cat"]]),
    "stream": st.booleans() | st.sampled_from([None, "yes"]),
    "intervene_on_prompt": st.booleans() | st.just(1),
    "echo": st.booleans(),
    "logprobs": st.sampled_from([None, 0, 2]),
    "seed": st.integers(0, 3),
    "nonsense": st.just(1),
}


#: Values the server honours: half the draws take only these, so that answers are drawn as often as refusals.
HONOURED_VALUES = {"model": st.sampled_from(["base", *SERVED_REFTS]), "max_tokens": st.integers(1, 4), "temperature": st.sampled_from([0, 0.0, None]),
                   "stream": st.booleans(), "intervene_on_prompt": st.booleans(), "seed": st.integers(0, 3)}


def post_json(url: str, body, path: str = "/v1/completions") -> tuple[int, bytes]:
    import urllib.error
    import urllib.request

    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(f"{url}{path}", data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


@settings(max_examples=END_TO_END_DRAWS, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=st.fixed_dictionaries({"prompt": GENERATE_WORDS}, optional=HONOURED_VALUES) |
       st.fixed_dictionaries({}, optional=FIELD_VALUES))
def test_every_drawn_request_is_answered_or_refused_naming_a_field(serving, patched_throughout, body):
    """A drawn completion request: answered 200 with at most max_tokens tokens and, greedy, the text of its prompt
    alone with its ReFT through pyreft (stream or not); or refused (4xx) in OpenAI's form, naming a field it gave (or
    the prompt, or model for a model left out). Never a 5xx (at 09d6d98: max_tokens true ran as 1 token, n, stop,
    logprobs, echo, top_p were ignored, ["poet"] was a 500)."""
    _, tokenizer, alone, url, default_tokens = serving
    status, raw = post_json(url, body)
    if status != 200:
        assert 400 <= status < 500, (body, status, raw)
        error = json.loads(raw)["error"]
        assert error["param"] in {*body, "prompt", "model"}, (body, error)
        event(f"refused: {error['param']}")
        return
    if body.get("stream"):
        chunks = [json.loads(line[6:]) for line in raw.decode().splitlines() if line.startswith("data: {")]
        text, usage = "".join(chunk["choices"][0]["text"] for chunk in chunks), chunks[-1]["usage"]
    else:
        answer = json.loads(raw)
        text, usage = answer["choices"][0]["text"], answer["usage"]
    asked = body.get("max_tokens") or default_tokens
    assert usage["completion_tokens"] <= asked, (body, usage)
    model = body.get("model")
    expected = alone(None if model in (None, "base") else model, body["prompt"], body.get("intervene_on_prompt", True),
                     max_new_tokens=asked, min_new_tokens=0)
    if not body.get("stream"):  # a stream decodes as it goes: a byte-level token split over chunks is dropped
        assert text == tokenizer.decode(expected, skip_special_tokens=True), (body, text)
    assert usage["completion_tokens"] == len(expected), body
    event("answered")


HOSTILE_VALUES = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) |
                              st.text(max_size=8),
                              lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                                        max_size=3), max_leaves=10)
HOSTILE_KEYS = st.sampled_from([*FIELD_VALUES, "messages", "max_completion_tokens", "tools", "suffix"]) | \
    st.text(max_size=6)
HOSTILE = (st.dictionaries(HOSTILE_KEYS, HOSTILE_VALUES, max_size=6) | HOSTILE_VALUES).map(json.dumps).map(
    str.encode) | st.binary(max_size=40)


@settings(max_examples=END_TO_END_DRAWS, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=HOSTILE, path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
def test_hostile_bodies_are_answered_and_never_a_server_error(serving, body, path):
    """Drawn JSON (or bytes) nobody wrote a case for, against both endpoints over the loopback: an answer or a 4xx,
    never a 5xx, and the server answers the next request."""
    status, raw = post_json(serving[3], body, path)
    assert status < 500, (path, body, status, raw[:500])
    event(f"status {status}")


# --- issue 50: the run's own flags, launching and resuming (train_reft.py and trainer_flags.py) --------------------

@pytest.fixture(scope="module")
def checkpoints(examples, model_folder, tmp_path_factory) -> dict:
    """Places for the cases below: a run of train_reft.py (LoReFT, rank 4, layers 0,1, positions l1: the defaults)
    that saved checkpoint-2 with the run's train_settings.json, trained here once; a copy of that checkpoint without
    the record, as train_reft.py saved checkpoints before; one whose trainer_state.json two runs wrote at once; a
    copy of the model in another folder; a JSON file that is no DeepSpeed config and one that is no JSON."""
    import pyvene_dist

    train_reft, _ = examples
    work = tmp_path_factory.mktemp("checkpointed")
    helpers.patch()
    try:
        train_reft.main(["--model", str(model_folder), "--data", str(model_folder / "train.json"), *TRAIN_FLAGS,
                         "--output_dir", str(work / "run"), "--save_strategy", "steps", "--save_steps", "2",
                         "--max_steps", "2"])
    finally:
        pyvene_dist.unpatch()
    checkpoint = work / "run" / "checkpoint-2"
    for copy in ("old", "two-writers"):
        shutil.copytree(checkpoint, work / copy)
    (work / "old" / "train_settings.json").unlink(missing_ok=True)  # (09d6d98 saved none)
    state = work / "two-writers" / "trainer_state.json"
    state.write_text(state.read_text() * 2)  # 'Extra data', as two ranks that each took itself for the only one
    shutil.copytree(model_folder, work / "model-copy")
    (work / "list.json").write_text("[]")
    (work / "garbage.json").write_text("{")
    return {"CHECKPOINT": str(checkpoint), "OLDCHECKPOINT": str(work / "old"), "TWOWRITERS": str(work / "two-writers"),
            "MODELCOPY": str(work / "model-copy"), "LISTJSON": str(work / "list.json"),
            "GARBAGE": str(work / "garbage.json"), "MODEL": str(model_folder), "RUN": str(work / "run")}


RESUME_FLAGS = "--max_steps 3 --resume_from_checkpoint CHECKPOINT"
#: (id, train_reft.py's flags besides --data/--output_dir (--model is MODEL unless given), the words of its one
#: error line). Each stops in parse_arguments, before a model or the data is read.
ARGUMENT_CASES = [
    ("max-steps-0", "--max_steps 0", "--max_steps 0: trains nothing; give at least 1"),  # saved untrained ones
    ("epochs-0", "--max_steps -1 --num_train_epochs 0", "--num_train_epochs 0: trains nothing; give more than 0"),
    ("epochs-negative", "--max_steps -1 --num_train_epochs -1", "--num_train_epochs -1: trains nothing"),
    ("accumulation-0", "--gradient_accumulation_steps 0", "--gradient_accumulation_steps 0: expected at least 1"),
    ("batch-0", "--per_device_train_batch_size 0", "--per_device_train_batch_size 0: expected at least 1"),
    ("deepspeed-not-json", "--deepspeed GARBAGE", "--deepspeed GARBAGE is not JSON (Expecting property name"),
    ("deepspeed-missing", "--deepspeed GARBAGE.gone", "--deepspeed GARBAGE.gone: no such file; expected a DeepSpeed "
                                                      "config file"),
    ("deepspeed-a-list", "--deepspeed LISTJSON", "--deepspeed LISTJSON holds a JSON list; expected an object"),
    ("model-a-file", "--model MODEL/config.json", "--model MODEL/config.json is a file; expected the model's folder"),
    ("model-not-there", "--model MODEL/gone", "--model MODEL/gone is not there; expected the model's folder"),
    ("model-without-tokenizer", "--model NOTOKENIZER", "--model NOTOKENIZER holds no tokenizer (none of "
                                                       "tokenizer.json, tokenizer_config.json, ...)"),
    ("unknown-flag", "--max_stepz 3", "unrecognized arguments: --max_stepz 3 (did you mean --max_steps?)"),
    ("rank-0", "--rank 0", "--rank 0: an intervention of rank 0 has nothing to train"),  # after 116 lines of usage
    ("resume-direft", f"{RESUME_FLAGS} --intervention DireftIntervention",
     "--resume_from_checkpoint CHECKPOINT was trained with --intervention LoreftIntervention (its "
     "train_settings.json), not --intervention DireftIntervention; resume with the flags it was trained with"),
    ("resume-rank-layers", f"{RESUME_FLAGS} --rank 2 --layers 0", "was trained with --layers 0,1 --rank 4 (its "
                                                                  "train_settings.json), not --layers 0 --rank 2"),
    ("resume-positions", f"{RESUME_FLAGS} --positions f1+l1", "was trained with --positions l1 (its "
                                                              "train_settings.json), not --positions f1+l1"),
    ("resume-model", f"{RESUME_FLAGS} --model MODELCOPY", "was trained with --model MODEL (its train_settings.json), "
                                                          "not --model MODELCOPY"),
    ("resume-trained-already", "--max_steps 2 --resume_from_checkpoint CHECKPOINT",
     "--max_steps 2: the checkpoint CHECKPOINT has trained 2 steps already, and resuming it would train nothing"),
    ("resume-state-not-json", "--max_steps 3 --resume_from_checkpoint TWOWRITERS",
     "--resume_from_checkpoint TWOWRITERS: its trainer_state.json is not JSON (Extra data"),
]


@pytest.mark.parametrize("case", ARGUMENT_CASES, ids=[case[0] for case in ARGUMENT_CASES])
def test_train_reft_stops_on_its_flags_in_one_line_before_loading(examples, checkpoints, no_tokenizer_folder,
                                                                  tmp_path, case):
    """Silent at 09d6d98: --max_steps 0 and no epochs saved untrained interventions, a resume into DiReFT loaded
    LoReFT's weights; the others failed later with a bare JSONDecodeError, ZeroDivisionError, size mismatch, or a
    tokenizer's advice on sentencepiece. A mistake is one line and a hint, not 116 lines of usage first."""
    import io

    train_reft, _ = examples
    places = {**checkpoints, "NOTOKENIZER": str(no_tokenizer_folder)}
    _, flags, words = case
    argv = ["--model", str(checkpoints["MODEL"]), "--data", "unread.json", *TRAIN_FLAGS, "--output_dir",
            str(tmp_path / "out"), *_fill(flags, places).split()]
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr), pytest.raises(SystemExit) as stop:
        train_reft.parse_arguments(argv)
    lines = stderr.getvalue().splitlines()
    assert stop.value.code == 2 and lines[1:] == ["train_reft.py: --help lists every flag"], stderr.getvalue()
    assert lines[0].startswith("train_reft.py: error: ") and _fill(words, places) in lines[0], lines[0]


def test_each_checkpoint_holds_the_settings_of_its_run(checkpoints):
    """What a resume is checked against: the state dicts alone do not tell LoReFT from DiReFT."""
    saved = json.loads((Path(checkpoints["RUN"]) / "reft" / "train_settings.json").read_text())
    assert json.loads((Path(checkpoints["CHECKPOINT"]) / "train_settings.json").read_text()) == saved
    assert saved["intervention"] == "LoreftIntervention" and saved["rank"] == 4 and saved["layers"] == [0, 1]


def test_a_resume_from_a_checkpoint_without_settings_names_it_as_it_loads(examples, checkpoints, tmp_path):
    """A checkpoint saved before checkpoints held their settings: another --rank failed with a bare 'size mismatch'."""
    import pyvene_dist

    train_reft, _ = examples
    helpers.patch()
    try:
        data = str(Path(checkpoints["MODEL"]) / "train.json")
        stopped = _stopped(train_reft.main, ["--model", checkpoints["MODEL"], "--data", data, *TRAIN_FLAGS,
                                             "--output_dir", str(tmp_path / "out"), "--max_steps", "3", "--rank", "2",
                                             "--resume_from_checkpoint", checkpoints["OLDCHECKPOINT"]])
    finally:
        pyvene_dist.unpatch()
    assert stopped.startswith(f"train_reft.py: --resume_from_checkpoint {checkpoints['OLDCHECKPOINT']} holds other "
                              "interventions than these flags build (size mismatch for"), stopped
    assert "resume with the --model, --layers, --positions, --share_weights, --intervention and --rank" in stopped


@pytest.mark.parametrize("rank, said", [("0", 1), ("1", 0)])
def test_a_warning_is_said_once_by_the_first_rank(examples, monkeypatch, caplog, rank, said):
    """The README's two-rank run said its warning four times: each rank logged it and warned it."""
    import warnings

    train_reft, _ = examples
    monkeypatch.setenv("RANK", rank)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train_reft.warn("its intervention for the first positions trains nothing")
    said_it = [str(warning.message) for warning in caught]
    assert said_it == ["its intervention for the first positions trains nothing"] * said
    assert not caplog.records


def test_what_deepspeed_waits_for_on_cpu_is_said_before_the_wait(examples, monkeypatch, tmp_path, caplog):
    """DeepSpeed on CPU builds its communication op as it joins the process group (minutes), or waits on the lock
    of another build, forever where a killed build left it: all without a word."""
    import trainer_flags  # imported by train_reft.py, from docs/examples

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    folder = tmp_path / "deepspeed_shm_comm"
    trainer_flags.say_what_deepspeed_waits_for()
    assert f"DeepSpeed builds its CPU communication op in {folder} before it joins the process group" in caplog.text
    (folder / "lock").write_text("")
    caplog.clear()
    trainer_flags.say_what_deepspeed_waits_for()
    assert f"DeepSpeed waits for {folder / 'lock'} (there for 0 min) before it joins the process group: another " \
           "process is building its CPU communication op, or a build that was killed left the lock" in caplog.text
    (folder / "lock").unlink()
    (folder / "deepspeed_shm_comm.so").write_bytes(b"")
    caplog.clear()
    trainer_flags.say_what_deepspeed_waits_for()
    assert not caplog.text  # built: nothing to wait for


# --- issue 50's property: drawn launches (the absent --use_cpu among them), run lengths and resumes -------------

#: How the process is started: plain python, or as torchrun starts a world of one (its variables; HF then joins a
#: process group of its own). Two ranks are test_launchers' (torchrun and deepspeed without --use_cpu).
LAUNCHED_AS = st.sampled_from(["python", "torchrun"])
#: Each flag drawn or not; the values that must stop a run are about one in four (``ABSENT``: not given).
ABSENT = "(absent)"
RUN_FLAG_VALUES = {
    "--use_cpu": st.just(None),  # given or not
    "--max_steps": st.sampled_from(["1", "2", "-1", "0"]),
    "--num_train_epochs": st.sampled_from(["1", "0.5", "2", "0", "-1"]),
    "--gradient_accumulation_steps": st.sampled_from(["1", "2", "0"]),
    "--per_device_train_batch_size": st.sampled_from(["1", "2", "0"]),
    "--deepspeed": st.sampled_from([ABSENT] * 6 + ["GARBAGE", "LISTJSON", "GARBAGE.gone"]),  # configs that work:
    # the RUNNER's case and test_launchers (a ZeRO-3 state in this process would outlive the draw)
    "--prompt": st.sampled_from(["red cat runs", "red cat runs", ""]),
}
#: Resumes of a checkpoint trained with the defaults (LoReFT, rank 4, layers 0,1, positions l1): with its own flags,
#: or with drawn ones; one without its settings (saved before checkpoints held them); one that two runs wrote.
CHECKPOINTS = st.sampled_from(["CHECKPOINT", "OLDCHECKPOINT"]) | st.just("TWOWRITERS")
RESUMES = st.one_of(
    st.just({}),
    st.fixed_dictionaries({"--resume_from_checkpoint": CHECKPOINTS}),
    st.fixed_dictionaries({"--resume_from_checkpoint": CHECKPOINTS}, optional={
        "--intervention": st.sampled_from(["LoreftIntervention", "DireftIntervention"]),
        "--rank": st.sampled_from(["4", "2"]),
        "--layers": st.sampled_from(["all", "0,1", "0"]),
        "--positions": st.sampled_from(["l1", "f1+l1"])}))
RUN_BASE = [*(flag for flag in TRAIN_FLAGS if flag != "--use_cpu"), "--max_new_tokens", "2"]


@contextlib.contextmanager
def _launched(how: str):
    """The process as ``how`` starts it, and as it was afterwards: the environment, no process group, accelerate's
    state, torch's threads (accelerate sets them for a CPU world where OMP_NUM_THREADS is unset)."""
    import torch.distributed as dist
    from accelerate.state import AcceleratorState

    from pyvene_dist.testing.launch import free_port

    saved = dict(os.environ)
    if how == "torchrun":
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()), OMP_NUM_THREADS=str(torch.get_num_threads()))
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        AcceleratorState._reset_state(reset_partial_state=True)
        os.environ.clear()
        os.environ.update(saved)


@settings(max_examples=END_TO_END_DRAWS, deadline=None, suppress_health_check=list(HealthCheck),
          phases=(Phase.explicit, Phase.reuse, Phase.generate))  # a draw trains: shrinking took minutes
@given(how=LAUNCHED_AS, run_flags=st.fixed_dictionaries({}, optional=RUN_FLAG_VALUES), resume_flags=RESUMES)
def test_end_to_end_every_launch_and_resume_trains_as_asked_or_stops_naming_a_flag(
        examples, checkpoints, model_folder, how, run_flags, resume_flags):
    """train_reft.py in-process with drawn launch flags and resumes: it stops with a message naming a flag given (or
    --model, --data), or it trains what the flags ask: the steps of --max_steps, from where a resumed checkpoint
    stopped, saving interventions of the flags' settings that, resumed, are the checkpoint's own (a resume into
    other interventions loaded LoReFT's weights into DiReFT with exit 0), and a trainer_state.json that is JSON."""
    import tempfile

    import pyvene_dist

    train_reft, _ = examples
    flags = {flag: value for flag, value in {**run_flags, **resume_flags}.items() if value != ABSENT}
    if "--resume_from_checkpoint" in flags:  # a step past the checkpoint's two, unless drawn
        flags = {"--max_steps": "3", **flags}
    if flags.get("--resume_from_checkpoint") == "OLDCHECKPOINT":  # its settings are unknown: an intervention of the
        flags.pop("--intervention", None)  # same shapes is taken for its own (docs/troubleshooting.md)
    with tempfile.TemporaryDirectory() as output_dir, _launched(how):
        argv = ["--model", str(model_folder), "--data", str(model_folder / "train.json"), *RUN_BASE,
                "--output_dir", output_dir,
                *(part for flag, value in flags.items() for part in ([flag] if value is None else
                                                                      [flag, _fill(value, checkpoints)]))]
        helpers.patch()
        try:
            stopped = _stopped(train_reft.main, argv)
        finally:
            pyvene_dist.unpatch()
        event(f"{how}: {'stopped' if stopped else 'resumed' if '--resume_from_checkpoint' in flags else 'trained'}")
        if stopped is not None:
            named = [*flags, "--model", "--data", *(part for part in RUN_BASE if part.startswith("--"))]
            assert any(flag in stopped for flag in named), f"{argv}\nstopped naming none of {named}: {stopped}"
            return
        state = json.loads((Path(output_dir) / "trainer_state.json").read_text())  # JSON: one writer
        saved = json.loads((Path(output_dir) / "reft" / "train_settings.json").read_text())
        given = {"intervention": flags.get("--intervention", "LoreftIntervention"), "rank": int(flags.get("--rank", 4)),
                 "positions": flags.get("--positions", "l1"),
                 "layers": [0] if flags.get("--layers") == "0" else [0, 1]}
        assert {name: saved[name] for name in given} == given, argv
        checkpoint = flags.get("--resume_from_checkpoint")
        if checkpoint:  # resumed into the checkpoint's own interventions, past its 2 steps
            trained = json.loads((Path(checkpoints["CHECKPOINT"]) / "train_settings.json").read_text())
            assert {name: trained[name] for name in given} == given, f"{argv}: resumed into other interventions"
        assert state["global_step"] > (2 if checkpoint else 0), argv
        if int(flags.get("--max_steps", 1)) > 0:
            assert state["global_step"] == int(flags.get("--max_steps", 1)), argv
        assert (Path(output_dir) / "answer.pt").is_file() == ("--prompt" in flags), argv
