"""The HF side of docs/examples/train_reft.py's command line: its parser, and the checks of the ``TrainingArguments``,
the launcher and the folders that stop a run before anything is loaded, or before its first step.

- A mistake is one line (``train_reft.py: error: ...``) and a hint, not the usage of every flag first; an unknown
  flag is named with the closest one.
- ``--max_steps 0``, no epochs, a batch or accumulation of 0, or a resume from a checkpoint that trained them already
  would train nothing (or fail in the first step).
- ``--deepspeed``: a config file that is not there or not JSON is named; without a launcher the run is a world of
  one process; on CPU, what DeepSpeed waits for as it joins the group is said before the wait.
- Each checkpoint holds the run's ``train_settings.json`` (``RecordSettings``), which train_reft.py checks a
  resume against; a folder the run cannot write stops every rank, naming it.
"""

import base64
import binascii
import contextlib
import difflib
import glob
import json
import os
import socket
import tempfile
import time

import torch
import transformers
from torch.utils import cpp_extension
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from serve_reft import SETTINGS  # this folder

logger = transformers.utils.logging.get_logger("train_reft")


class ArgumentParser(transformers.HfArgumentParser):
    """HF's parser, whose mistakes are one line and a hint: argparse printed them after the usage of every flag of
    ``TrainingArguments`` (116 lines)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n{self.prog}: --help lists every flag\n")


def closest_flag(parser, unknown: list[str]) -> str:
    """`` (did you mean --max_steps?)`` for the first of the ``unknown`` arguments, where a flag is close to it."""
    known = [option for action in parser._actions for option in action.option_strings]
    close = difflib.get_close_matches(unknown[0].split("=")[0], known, n=1)
    return f" (did you mean {close[0]}?)" if close else ""


def check_steps(parser, training_args) -> None:
    """Stop where HF Trainer would run no step (and the script save untrained interventions), or fail in its
    first one (``ZeroDivisionError`` for ``--gradient_accumulation_steps 0``)."""
    if training_args.max_steps == 0:
        parser.error("--max_steps 0: trains nothing; give at least 1, or leave it out to train --num_train_epochs")
    if training_args.max_steps < 0 and training_args.num_train_epochs <= 0:
        parser.error(f"--num_train_epochs {training_args.num_train_epochs:g}: trains nothing; give more than 0 "
                     "(default 3), or --max_steps N")
    for flag in ("gradient_accumulation_steps", "per_device_train_batch_size"):
        if getattr(training_args, flag) < 1:
            parser.error(f"--{flag} {getattr(training_args, flag)}: expected at least 1")


def prepare_deepspeed(parser, config) -> None:
    """``--deepspeed``, before the ``TrainingArguments`` that read it and join DeepSpeed's process group: a config
    that is not there or not JSON stops here, named (HF's was a bare ``JSONDecodeError``); without a launcher the
    run is a world of one process, as ``deepspeed --num_gpus 1`` starts it (DeepSpeed looked for MPI instead: ``No
    module named 'mpi4py'``); on CPU, what DeepSpeed waits for as it joins the group is said first."""
    if config is None:
        return
    text = config.strip()
    if not text.startswith("{") and os.path.isfile(config):
        with open(config) as file:
            text = file.read()
    elif not text.startswith("{"):
        try:  # HF takes a config encoded in base64 too
            text = base64.urlsafe_b64decode(config).decode()
        except (binascii.Error, UnicodeDecodeError, ValueError):
            parser.error(f"--deepspeed {config}: no such file; expected a DeepSpeed config file such as "
                         "docs/configs/deepspeed-zero3.json, or its JSON")
    try:
        found = json.loads(text)
    except json.JSONDecodeError as error:
        parser.error(f"--deepspeed {config} is not JSON ({error}); expected a DeepSpeed config such as "
                     "docs/configs/deepspeed-zero3.json")
    if not isinstance(found, dict):
        parser.error(f"--deepspeed {config} holds a JSON {type(found).__name__}; expected an object, a DeepSpeed "
                     "config such as docs/configs/deepspeed-zero3.json")
    if not any(name in os.environ for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")):
        with socket.socket() as free:
            free.bind(("127.0.0.1", 0))
            os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                              MASTER_ADDR=os.environ.get("MASTER_ADDR", "127.0.0.1"),
                              MASTER_PORT=os.environ.get("MASTER_PORT", str(free.getsockname()[1])))
        logger.warning("train_reft.py: --deepspeed without a launcher: one process, as `deepspeed --num_gpus 1` "
                       "starts it; start it with deepspeed or torchrun for more")
    if not torch.cuda.is_available() and os.environ.get("LOCAL_RANK") == "0":
        say_what_deepspeed_waits_for()


def say_what_deepspeed_waits_for() -> None:
    """On CPU each DeepSpeed process loads DeepSpeed's shared-memory communication op as it joins the process group:
    the first builds it (minutes), the others wait on its lock file, and a build that was killed leaves the lock for
    every later process to wait on forever, all without a word. Said here, before the wait."""
    build = getattr(cpp_extension, "_get_build_directory", None)  # torch's folder for the op's build (private)
    folder = build("deepspeed_shm_comm", False) if build else None
    if folder and os.path.exists(lock := os.path.join(folder, "lock")):
        minutes = (time.time() - os.path.getmtime(lock)) / 60
        logger.warning(f"train_reft.py: DeepSpeed waits for {lock} (there for {minutes:.0f} min) before it joins the "
                       "process group: another process is building its CPU communication op, or a build that was "
                       "killed left the lock behind; if no DeepSpeed process runs, delete it (docs/troubleshooting.md: "
                       "DeepSpeed stalls before the first step on CPU)")
    elif folder and not glob.glob(os.path.join(folder, "*.so")):
        logger.warning(f"train_reft.py: DeepSpeed builds its CPU communication op in {folder} before it joins the "
                       "process group: minutes, the first time only (scripts/setup.sh builds it ahead)")


def checkpoint_to_resume(parser, training_args):
    """``--resume_from_checkpoint`` as HF Trainer reads ``train(resume_from_checkpoint=...)``: a checkpoint folder,
    or ``True`` (also ``last``) for the newest ``checkpoint-N`` in ``--output_dir``; None to start afresh. A
    folder that is not there, or no checkpoint to take the newest of, stops here, before any model is loaded."""
    from transformers.trainer_utils import get_last_checkpoint

    given = training_args.resume_from_checkpoint
    if given is None or given.lower() in ("false", "none"):
        return None
    if given.lower() in ("true", "last"):
        found = get_last_checkpoint(training_args.output_dir) if os.path.isdir(training_args.output_dir) else None
        if found is None:
            parser.error(f"--resume_from_checkpoint {given}: --output_dir {training_args.output_dir} holds no "
                         "checkpoint-N folder to resume from; name a checkpoint folder, or leave the flag out")
        return found
    if not os.path.isdir(given):
        parser.error(f"--resume_from_checkpoint {given}: no such folder; name a checkpoint folder that a run saved "
                     "(OUTPUT_DIR/checkpoint-N), or pass True for the newest one in --output_dir")
    if not os.path.isfile(os.path.join(given, "trainer_state.json")):
        parser.error(f"--resume_from_checkpoint {given}: not a checkpoint (no trainer_state.json in it); name a "
                     "checkpoint-N folder that HF Trainer saved, or pass True for the newest one in --output_dir")
    return given


def trained_steps(checkpoint: str) -> int:
    """The steps ``checkpoint`` has trained, from its ``trainer_state.json``."""
    with open(os.path.join(checkpoint, "trainer_state.json")) as file:
        return json.load(file).get("global_step", 0)


def check_steps_left(parser, training_args) -> None:
    """Stop a resume that would train nothing: HF Trainer resumes a checkpoint that trained ``--max_steps`` already
    without a step, and the script saved its interventions again (epochs left are known once the data is:
    ``check_trained_after_resume``). A ``trainer_state.json`` that is not JSON (two runs wrote it at once) is named
    here, not by a bare ``JSONDecodeError`` from HF."""
    checkpoint = training_args.resume_from_checkpoint
    try:
        step = trained_steps(checkpoint)
    except json.JSONDecodeError as error:
        parser.error(f"--resume_from_checkpoint {checkpoint}: its trainer_state.json is not JSON ({error}); resume "
                     "from another checkpoint, or start afresh")
    if 0 < training_args.max_steps <= step:
        parser.error(f"--max_steps {training_args.max_steps}: the checkpoint {checkpoint} has trained {step} steps "
                     f"already, and resuming it would train nothing; give --max_steps above {step}")


def check_trained_after_resume(trainer, checkpoint: str, step: int) -> None:
    """Stop, before saving, a resumed run that trained no step: its checkpoint had trained ``--num_train_epochs``."""
    if trainer.state.global_step <= step:
        raise SystemExit(f"train_reft.py: --num_train_epochs {trainer.args.num_train_epochs:g}: the checkpoint "
                         f"{checkpoint} had trained them already ({step} steps), and resuming it trained nothing; give "
                         "more epochs")


class RecordSettings(transformers.TrainerCallback):
    """Writes ``settings`` (the run's train_settings.json) into each checkpoint, as beside the final interventions:
    a resume from it is checked against it. The state dicts alone do not tell LoReFT from DiReFT."""

    def __init__(self, settings: dict):
        self.settings = settings

    def on_save(self, args, state, control, **kwargs):
        folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        if state.is_world_process_zero and os.path.isdir(folder):
            with open(os.path.join(folder, SETTINGS), "w") as file:
                json.dump(self.settings, file, indent=1)


def unwritable(flag: str, folder: str) -> str | None:
    """Why ``folder`` cannot take the run's files, naming ``flag``; None where it can. Checked at once, rather than
    after training, with a bare ``open file failed with strerror: Operation not permitted`` that names no file."""
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder):
            pass
    except OSError as error:
        return f"{flag} {folder} cannot be written ({type(error).__name__}: {error.strerror or error})"
    return None


def check_writable(training_args, folders: list[tuple[str, str]]) -> None:
    """Stop when a folder the run saves to cannot be written. Every rank checks its own (a node's disk may be
    read-only on one node) and, in a run of several, all stop together naming each rank that cannot write: one
    rank leaving alone left the others waiting in their first collective."""
    problems = [problem for flag, folder in folders if (problem := unwritable(flag, folder))]
    # the process group's size: arguments made without --use_cpu on a machine without a GPU see one process
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else training_args.world_size
    if world > 1:
        everyone = [None] * world
        torch.distributed.all_gather_object(everyone, problems)
        problems = [f"rank {rank}: {problem}" for rank, found in enumerate(everyone) for problem in found]
    if problems:
        raise SystemExit(f"train_reft.py: {'; '.join(problems)}; choose a folder this process may create files in")


@contextlib.contextmanager
def leaving_the_process_group_on_error():
    """Leave the process group HF Trainer joined when the run stops with an error (a refusal such as an unwritable
    folder on one rank), as ``main`` does at its end: gloo's threads otherwise outlive the group and abort the
    process ("terminate called without an active exception", exit -6 where exit 1 was meant). No barrier here:
    another rank may never come to it."""
    try:
        yield
    except BaseException:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        raise
