"""Resuming from a checkpoint continues the run exactly: pyreft's git main (its own ``_load_from_checkpoint``) and
0.1.0 (the patch's ``Trainer._load_from_checkpoint``), under DDP, FSDP2 and ZeRO-3, and docs/examples/train_reft.py's
``--resume_from_checkpoint``.

Each strategy trains one uninterrupted run of 4 steps under torchrun (2 processes, gloo on CPU) that saves a checkpoint
every 2 steps; each resumed run starts from its ``checkpoint-2`` in a new output folder. The steps after the checkpoint
must log the uninterrupted run's losses and end with its intervention weights (float32, to 1e-5). pyreft's git main is
``../shared/upstream/pyreft-main-dafd099`` beside the repository, copied and put first on the launched processes'
``PYTHONPATH``; 0.1.0 is the installed release. FSDP2 runs HF Trainer's own FSDP2 on CPU (see
tests/scripts/train_with_trainer.py) with the head frozen: a trained ``lm_head`` is a sharded ``DTensor`` beside the
whole intervention weights, which HF's fused AdamW refuses to step together (``aten._fused_adamw_.default got mixed
torch.Tensor and DTensor``).
"""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from launchers import SCRIPTS, launch_runs, run_forked, run_together
from pyvene_dist.testing import Record

pytestmark = pytest.mark.slow

ROOT = Path(__file__).parents[2]
PYREFT_MAIN = ROOT.parent / "shared" / "upstream" / "pyreft-main-dafd099"
STEPS, SAVE_STEPS = 4, 2
STRATEGIES = {"ddp": (), "fsdp2": ("--fsdp", "2", "--frozen-head"), "zero3": ("--deepspeed", "3")}
#: What pyreft's git main logs when its ``_load_from_checkpoint`` runs (HF Trainer calls it but under DeepSpeed,
#: which loads DeepSpeed's own checkpoint).
MAIN_LOADS = "Loading checkpoint from {}."
RTOL = 1e-5


def torchrun(folder: Path, pyreft_path: Path | None, runs: list[tuple[str, ...]]):
    """train_with_trainer.py under torchrun with 2 processes, making ``runs`` (their arguments) one after the other
    in one launch (launchers.launch_runs); ``(record, output)``: ``record(i)`` is run ``i``'s Record. ``pyreft_path``
    goes first on the processes' PYTHONPATH (None: the installed pyreft)."""
    from pyvene_dist.testing.launch import free_port

    path = [str(pyreft_path)] if pyreft_path else []
    env = {"PYTHONPATH": os.pathsep.join(path + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
    command = ["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
               str(SCRIPTS / "train_with_trainer.py")]
    return launch_runs(folder, command, runs, env=env)


@pytest.fixture(scope="module")
def pyreft_main(tmp_path_factory) -> Path:
    if not (PYREFT_MAIN / "pyreft" / "reft_trainer.py").is_file():
        pytest.skip(f"pyreft's git main is not at {PYREFT_MAIN} (shared/upstream beside the repository)")
    folder = tmp_path_factory.mktemp("pyreft-main")
    shutil.copytree(PYREFT_MAIN / "pyreft", folder / "pyreft")
    return folder


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, pyreft_main):
    """strategy -> (the uninterrupted run's Record, its checkpoint-2). Every strategy's run is made in one launch, one
    after the other in the same processes, by the first test that asks (each gives the Record it gives alone)."""
    folder = tmp_path_factory.mktemp("uninterrupted")
    runs = {}

    def get(strategy):
        if not runs:
            record, _ = torchrun(folder, pyreft_main, [
                ("--steps", str(STEPS), "--output-dir", str(folder / name), "--save-steps", str(SAVE_STEPS), *arguments)
                for name, arguments in STRATEGIES.items()])
            runs.update({name: (lambda number=number: record(number)) for number, name in enumerate(STRATEGIES)})
        return runs[strategy](), folder / strategy / f"checkpoint-{SAVE_STEPS}"
    return get


@pytest.fixture(scope="module")
def resumed(tmp_path_factory, pyreft_main, uninterrupted):
    """(form, strategy) -> (the run resumed from the uninterrupted run's checkpoint-2, the output of its launch).
    Each form's resumed runs (CASES) are made in one launch, one after the other in the same processes, by the first
    test that asks; the checkpoint each resumes from is in its strategy's own folder."""
    launched = {}

    def get(form, strategy):
        if form not in launched:
            strategies = [case.values[1] for case in CASES if case.values[0] == form]
            checkpoints = [uninterrupted(name)[1] for name in strategies]
            folder = tmp_path_factory.mktemp(f"resumed-{form}")
            record, output = torchrun(folder, pyreft_main if form == "main" else None, [
                ("--steps", str(STEPS), "--output-dir", str(folder / name), "--resume-from", str(checkpoint),
                 *STRATEGIES[name]) for name, checkpoint in zip(strategies, checkpoints)])
            launched[form] = strategies, record, output
        strategies, record, output = launched[form]
        return record(strategies.index(strategy)), output
    return get


def assert_continues(resumed: Record, whole: Record) -> None:
    print("uninterrupted:", whole.losses, "\nresumed:      ", resumed.losses)
    assert len(resumed.losses) == STEPS  # the log holds the steps before the checkpoint too, restored from it
    torch.testing.assert_close(torch.tensor(resumed.losses[SAVE_STEPS:]), torch.tensor(whole.losses[SAVE_STEPS:]),
                               rtol=RTOL, atol=0)
    assert resumed.weights.keys() == whole.weights.keys()
    for name, value in whole.weights.items():
        torch.testing.assert_close(resumed.weights[name], value, rtol=RTOL, atol=RTOL * value.abs().max().item(),
                                   msg=lambda message, name=name: f"{name}: {message}")


#: pyreft 0.1.0 resumes under DDP and ZeRO-3 in tests/strategies/test_launchers.py
#: (test_torchrun_resume_from_checkpoint_continues_exactly); FSDP2 is new here.
CASES = [pytest.param("main", strategy, id=f"main-{strategy}") for strategy in STRATEGIES] + \
    [pytest.param("0.1.0", "fsdp2", id="0.1.0-fsdp2")]


@pytest.mark.parametrize("form, strategy", CASES)
def test_resume_continues_the_uninterrupted_run(uninterrupted, resumed, form, strategy):
    whole, checkpoint = uninterrupted(strategy)
    if strategy == "zero3":
        assert list(checkpoint.glob(f"global_step{SAVE_STEPS}/*optim_states.pt")), f"{checkpoint} is not DeepSpeed's"
    record, output = resumed(form, strategy)
    # The resume went the way this form takes: pyreft main's _load_from_checkpoint, except under DeepSpeed. The
    # launch's output holds its other runs' too, each naming its own checkpoint.
    took_mains = MAIN_LOADS.format(checkpoint) in output
    assert took_mains == (form == "main" and strategy != "zero3"), output[-3000:]
    assert_continues(record, whole)


# --- docs/examples/train_reft.py --resume_from_checkpoint --------------------------------------------------------

TRAIN = ROOT / "docs" / "examples" / "train_reft.py"
FLAGS = ("--positions", "f1+l1", "--max_steps", str(STEPS), "--learning_rate", "1e-2", "--logging_steps", "1",
         "--lr_scheduler_type", "constant", "--train_sampling_strategy", "sequential", "--save_strategy", "steps",
         "--save_steps", str(SAVE_STEPS), "--report_to", "none", "--disable_tqdm", "true", "--use_cpu",
         "--per_device_train_batch_size", "2")


def train_reft(model: Path, output_dir: Path, *extra: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """train_reft.py under torchrun with 2 processes; the losses it logged and the interventions it saved."""
    from pyvene_dist.testing.launch import free_port

    run_together([["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
                   str(TRAIN), "--model", str(model), "--data", str(model / "train.json"), *FLAGS,
                   "--output_dir", str(output_dir), *extra]], cwd=ROOT, timeout=600)
    log = json.loads((output_dir / "trainer_state.json").read_text())["log_history"]
    weights = {f"{path.name}:{key}": value for path in sorted((output_dir / "reft").glob("intkey_*.bin"))
               for key, value in torch.load(path).items()}
    return [entry["loss"] for entry in log if "loss" in entry], weights


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory) -> Path:
    from pyvene_dist.testing.models import instruction_examples, save_checkpoint

    folder = save_checkpoint(tmp_path_factory.mktemp("model"))
    (folder / "train.json").write_text(json.dumps(instruction_examples(4 * STEPS)))
    return folder


def test_train_reft_resumes_from_the_newest_checkpoint(model_folder, tmp_path):
    """``--resume_from_checkpoint True`` in an output folder holding the uninterrupted run's checkpoint-2 (the
    script used to ignore the flag and start again at step 1). The resumed run is given another seed, which draws
    other initial interventions: only the checkpoint's weights give it the uninterrupted run's losses (the data
    come in order), where a run that ignored the flag would repeat the uninterrupted run with the same seed."""
    losses, weights = train_reft(model_folder, tmp_path / "whole")
    shutil.copytree(tmp_path / "whole" / f"checkpoint-{SAVE_STEPS}", tmp_path / "resumed" / f"checkpoint-{SAVE_STEPS}")
    resumed_losses, resumed_weights = train_reft(model_folder, tmp_path / "resumed", "--resume_from_checkpoint", "True",
                                                 "--seed", "1")
    print("uninterrupted:", losses, "\nresumed:      ", resumed_losses)
    assert len(losses) == len(resumed_losses) == STEPS
    torch.testing.assert_close(torch.tensor(resumed_losses[SAVE_STEPS:]), torch.tensor(losses[SAVE_STEPS:]),
                               rtol=RTOL, atol=0)
    assert resumed_weights.keys() == weights.keys() and weights
    for name, value in weights.items():
        torch.testing.assert_close(resumed_weights[name], value, rtol=RTOL, atol=RTOL * value.abs().max().item(),
                                   msg=lambda message, name=name: f"{name}: {message}")


#: (--resume_from_checkpoint, the folders in --output_dir (a name ending in / is a folder without HF Trainer's
#: trainer_state.json), what parsing gives: the checkpoint or the error's words)
RESUME_ARGUMENTS = [
    ("OUT/checkpoint-3", ["checkpoint-3"], "OUT/checkpoint-3"),
    ("True", ["checkpoint-2", "checkpoint-10"], "OUT/checkpoint-10"),
    ("last", ["checkpoint-2"], "OUT/checkpoint-2"),
    ("OUT/checkpoint-9", ["checkpoint-3"], "error: --resume_from_checkpoint OUT/checkpoint-9: no such folder"),
    ("True", [], "error: --resume_from_checkpoint True: --output_dir OUT holds no checkpoint-N folder"),
    ("OUT/checkpoint-3", ["checkpoint-3/"], "error: --resume_from_checkpoint OUT/checkpoint-3: not a checkpoint (no "
                                            "trainer_state.json in it)"),
    ("False", ["checkpoint-3"], None),
]

PARSE = """
import contextlib, io, json, sys
sys.path.insert(0, "docs/examples")
import train_reft
found = []
for argv in json.loads(sys.argv[1]):
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            found.append(train_reft.parse_arguments(argv)[1].resume_from_checkpoint)
    except SystemExit:
        found.append(stderr.getvalue())
print("PARSED " + json.dumps(found))
"""


def test_train_reft_resume_argument(tmp_path):
    """What ``--resume_from_checkpoint`` resumes from, or the error that names the flag and the folder; parsed
    in one process, before any model is loaded. A folder that is not there used to train from step 1 and exit 0."""
    argvs = []
    for number, (given, folders, _) in enumerate(RESUME_ARGUMENTS):
        out = tmp_path / str(number)
        for name in folders:
            (out / name).mkdir(parents=True)
            if not name.endswith("/"):
                (out / name / "trainer_state.json").write_text("{}")
        argvs.append(["--model", "m", "--data", "d.json", "--output_dir", str(out),
                      "--resume_from_checkpoint", given.replace("OUT", str(out))])
    program = tmp_path / "parse.py"  # python -c PARSE, in a process forked from the preloaded server
    program.write_text(PARSE)
    output = run_forked(program, [json.dumps(argvs)], cwd=ROOT, timeout=300)
    lines = [line for line in output.splitlines() if line.startswith("PARSED ")]
    assert lines, output[-4000:]
    for number, ((given, _, expected), found) in enumerate(zip(RESUME_ARGUMENTS, json.loads(lines[0][7:]))):
        expected = expected and expected.replace("OUT", str(tmp_path / str(number)))
        if expected and expected.startswith("error: "):
            assert expected[len("error: "):] in found, (given, found)
        else:
            assert found == expected, (given, found)
