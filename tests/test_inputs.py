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


def run_cases(cases: list) -> list:
    result = subprocess.run([sys.executable, "-c", RUNNER, json.dumps(cases)], cwd=ROOT, capture_output=True,
                            text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = [line for line in result.stdout.splitlines() if line.startswith("FOUND ")]
    assert result.returncode == 0 and lines, f"the runner failed:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
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
def script_results(model_folder, tmp_path_factory) -> dict:
    """Every train and serve case, in one subprocess. The serve cases read interventions saved here with pyreft's
    ``ReftModel.save`` and train_reft.py's settings beside them (as saved, or copied and broken)."""
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
              "WIDE": str(_wider_model(model_folder, work / "wide")), "MODEL-GONE": str(work / "model-gone")}
    (work / "empty").mkdir()
    for name, corrupt in (("MOVED", None), ("EMPTYBIN", b""), ("CORRUPT", b"not a torch file at all")):
        shutil.copytree(saved, places[name])
        if corrupt is not None:
            next(Path(places[name]).glob("intkey_*.bin")).write_bytes(corrupt)
    settings_file = Path(places["MOVED"]) / "train_settings.json"
    settings_file.write_text(json.dumps({**json.loads(settings_file.read_text()), "model": places["MODEL-GONE"]}))
    # the flag given last wins in HF's parser: an --output_dir in the case replaces the default one
    trains = [["train", ["--model", str(model_folder), "--data", str(model_folder / f"{data}.json"), *TRAIN_FLAGS,
                         "--output_dir", str(work / f"train-{number}"), *_fill(flags, places).split()], None]
              for number, (_, flags, data, _) in enumerate(TRAIN_CASES)]
    serves = [["serve", ["--prompt", "red cat runs", "--max_new_tokens", "3", *_fill(flags, places).split()],
               str(work / f"answer-{number}.pt")] for number, (_, flags, _) in enumerate(SERVE_CASES)]
    results = run_cases(trains + serves)
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


def _run_ranks(commands: list[list[str]], timeout: float, environment: dict | None = None) -> tuple[list, str]:
    """``python COMMAND`` for each rank (RANK, LOCAL_RANK and the rendezvous set as torchrun sets them, unless
    ``environment`` is given), all at once; any still running at ``timeout`` seconds, or 30 s after the first
    ended, is killed with its children.
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
        if number == 1:  # the first has ended: the others get 30 s more (a stopped rank never ends by itself)
            deadline = min(deadline, time.monotonic() + 30)
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
    codes, report = _run_ranks([arguments, arguments], timeout=240)
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
