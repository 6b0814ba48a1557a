"""The slower tier: real launchers (torchrun, accelerate launch, deepspeed) with the scripts users write."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from launchers import SCRIPTS, THEN, launch_runs, run_forked, run_launcher, run_together
from pyvene_dist.testing import ParityCase, Record, assert_parity

pytestmark = pytest.mark.slow


def torchrun(nproc):
    from pyvene_dist.testing.launch import free_port

    return ["-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port", str(free_port()),
            str(SCRIPTS / "train_with_trainer.py")]


def launch(tmp_path, nproc, *script_args):
    return run_launcher(tmp_path, torchrun(nproc), script_args)


TRAINERS = {
    "ReftTrainer": ("--trainer", "ReftTrainer"),
    "ReftTrainerForCausalLM": ("--trainer", "ReftTrainerForCausalLM"),
    "ReftTrainerForSequenceClassification+evaluate": ("--trainer", "ReftTrainerForSequenceClassification", "--model",
                                                      "llama-cls", "--eval-examples", "7"),
}
#: The strategies resumed from a checkpoint: under ZeRO-3 the checkpoint is DeepSpeed's own (each rank's partitions
#: of weights and optimizer state).
RESUMED = {"ddp": (), "zero3": ("--deepspeed", "3")}


class TrainerRuns:
    """This module's train_with_trainer.py runs under torchrun, made in three launches by the first test that asks for
    one of their runs; each launch makes its runs one after the other in the same processes (launchers.launch_runs),
    and each run gives the Record it gives when launched alone, to the bit. With 1 process: each trainer. With 2
    processes: each trainer, then for each strategy of RESUMED the uninterrupted run of 4 steps
    (``{strategy}-whole``) and the same run saving a checkpoint every 2 steps in ``first(strategy)``
    (``{strategy}-first``). With 2 processes again: each strategy resumed from its ``checkpoint-2``
    (``{strategy}-resumed``)."""

    def __init__(self, folder: Path):
        self.folder = folder
        resume = {strategy: ("--steps", "4", *arguments) for strategy, arguments in RESUMED.items()}
        self.groups = {
            "one": (1, TRAINERS),
            "two": (2, {**TRAINERS, **{name: run for strategy, arguments in resume.items() for name, run in (
                (f"{strategy}-whole", arguments),
                (f"{strategy}-first", (*arguments, "--output-dir", str(self.first(strategy)), "--save-steps", "2")))}}),
            "resumed": (2, {f"{strategy}-resumed": (*arguments, "--output-dir", str(folder / f"{strategy}-second"),
                                                    "--resume-from", str(self.first(strategy) / "checkpoint-2"))
                            for strategy, arguments in resume.items()}),
        }
        self.launched = {}

    def first(self, strategy: str) -> Path:
        return self.folder / f"{strategy}-first"

    def __call__(self, processes: int, name: str) -> Record:
        group = next(group for group, (count, runs) in self.groups.items() if count == processes and name in runs)
        if group == "resumed":
            self(2, name.replace("-resumed", "-first"))  # its checkpoint first
        if group not in self.launched:
            runs = self.groups[group][1]
            record, _ = launch_runs(self.folder, torchrun(processes), list(runs.values()))
            self.launched[group] = {name: number for number, name in enumerate(runs)}, record
        numbers, record = self.launched[group]
        return record(numbers[name])


@pytest.fixture(scope="module")
def trainer_runs(tmp_path_factory):
    return TrainerRuns(tmp_path_factory.mktemp("trainer-runs"))


@pytest.mark.ranks(2)  # train_with_trainer.py runs on the GPUs where there are some: rank 1 takes cuda:1
@pytest.mark.parametrize("trainer", TRAINERS)
def test_torchrun_pyreft_trainer_matches_one_process(trainer_runs, trainer):
    single = trainer_runs(1, trainer)
    double = trainer_runs(2, trainer)
    print(f"{trainer} losses, 1 process:  ", single.losses, single.metrics)
    print(f"{trainer} losses, 2 processes:", double.losses, double.metrics)
    assert len(double.losses) == ParityCase().steps
    assert_parity(single, double, ParityCase().tolerance)
    assert double.metrics == single.metrics
    if "--eval-examples" in TRAINERS[trainer]:
        assert single.metrics["eval_examples"] == 7


@pytest.mark.ranks(2)
@pytest.mark.parametrize("strategy", RESUMED)
def test_torchrun_resume_from_checkpoint_continues_exactly(trainer_runs, strategy):
    """Under ZeRO-3 the checkpoint is DeepSpeed's own (each rank's partitions of weights and optimizer state)."""
    whole = trainer_runs(2, f"{strategy}-whole")
    trainer_runs(2, f"{strategy}-first")
    if RESUMED[strategy]:
        checkpoint = trainer_runs.first(strategy) / "checkpoint-2"
        assert list(checkpoint.glob("global_step2/*optim_states.pt")), "not DeepSpeed's"
    resumed = trainer_runs(2, f"{strategy}-resumed")
    print("uninterrupted:", whole.losses, "\nresumed:      ", resumed.losses)
    assert len(resumed.grads) == (0 if RESUMED[strategy] else 2)  # two steps after the checkpoint (none read under ZeRO)
    assert len(resumed.losses) == 4  # the log holds the first two too, restored from the checkpoint
    torch.testing.assert_close(torch.tensor(resumed.losses[2:]), torch.tensor(whole.losses[2:]), rtol=1e-6, atol=0)
    for name, value in whole.weights.items():
        torch.testing.assert_close(resumed.weights[name], value, rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.gpus(2)
@pytest.mark.parametrize("version", [2, 1])
def test_torchrun_hf_trainer_fsdp_matches_one_process(tmp_path, trainer_runs, version):
    import transformers
    from packaging.version import Version

    if version == 1 and Version(transformers.__version__) >= Version("5.20"):
        pytest.skip("HF Trainer dropped FSDP1 in transformers 5.20")
    single = trainer_runs(1, "ReftTrainer")
    sharded = launch(tmp_path, 2, "--fsdp", str(version))
    print(f"HF Trainer FSDP{version}: 1 process {single.losses}\n2 processes {sharded.losses}")
    assert_parity(single, sharded, ParityCase().tolerance)


# --- docs/examples/train_reft.py on a checkpoint folder, under every launcher --------------------------------

ROOT = Path(__file__).parents[2]
EXAMPLES = ROOT / "docs" / "examples"
CONFIGS = ROOT / "docs" / "configs"
TRAIN = str(EXAMPLES / "train_reft.py")
PROMPT = "red cat runs"
POSITIONS = "f1+l1"  # first and last prompt token: two interventions at each of the two layers
GLOBAL_BATCH, STEPS = 4, 3
FLAGS = ("--positions", POSITIONS, "--max_steps", str(STEPS), "--learning_rate", "1e-2", "--logging_steps", "1",
         "--lr_scheduler_type", "constant", "--train_sampling_strategy", "sequential", "--save_strategy", "no",
         "--report_to", "none", "--disable_tqdm", "true", "--use_cpu", "--prompt", PROMPT)


def _torchrun(port, folder):
    return [["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port), TRAIN]]


def _torchrun_two_nodes(port, folder):
    """Two nodes of one process each, simulated on this machine: one torchrun per node, c10d rendezvous."""
    return [["-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1", "--node_rank", str(rank),
             "--rdzv_backend", "c10d", "--rdzv_endpoint", f"localhost:{port}", TRAIN] for rank in (0, 1)]


def _accelerate(config):
    def command(port, folder):
        return [["-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / config),
                 "--main_process_port", str(port), TRAIN]]
    return command


ZERO3 = ("--deepspeed", str(CONFIGS / "deepspeed-zero3.json"))


def _deepspeed(port, folder):
    """The ``deepspeed`` launcher on one node. ``--num_gpus`` sets the process count on CPU too (DeepSpeed's
    CPU accelerator counts one device per NUMA node, but ``--num_gpus`` overrides the count)."""
    return [["-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(port), TRAIN, *ZERO3]]


def _deepspeed_two_nodes(port, folder):
    """Two nodes of one process each, simulated on this machine: a hostfile naming this machine twice (under
    two names: DeepSpeed refuses a host listed twice), and one launcher per node started here with
    ``--no_ssh --node_rank N`` instead of by the first node over ssh."""
    hostfile = folder / "hostfile"
    hostfile.write_text("localhost slots=1\n127.0.0.1 slots=1\n")
    return [["-m", "deepspeed.launcher.runner", "--hostfile", str(hostfile), "--no_ssh", "--node_rank", str(rank),
             "--master_addr", "127.0.0.1", "--master_port", str(port), TRAIN, *ZERO3] for rank in (0, 1)]


#: Each takes a free port and a folder for the launch's own files, and starts 2 processes in all. On CPU
#: accelerate's FSDP config trains DDP (accelerate applies FSDP on GPUs only); its DeepSpeed configs, and
#: the deepspeed launcher with deepspeed-zero3.json, run DeepSpeed.
LAUNCHES = {
    "torchrun": _torchrun,
    "torchrun-2-nodes": _torchrun_two_nodes,
    "accelerate-ddp.yaml": _accelerate("accelerate-ddp.yaml"),
    "accelerate-fsdp2.yaml": _accelerate("accelerate-fsdp2.yaml"),
    "accelerate-zero2.yaml": _accelerate("accelerate-zero2.yaml"),
    "accelerate-zero3.yaml": _accelerate("accelerate-zero3.yaml"),
    "accelerate-zero3-offload.yaml": _accelerate("accelerate-zero3-offload.yaml"),
    "deepspeed": _deepspeed,
    "deepspeed-2-nodes": _deepspeed_two_nodes,
}


@dataclasses.dataclass
class Trained:
    """What train_reft.py wrote: HF Trainer's log, pyreft's saved interventions, the answer to PROMPT."""

    output_dir: Path
    losses: list[float]
    weights: dict[str, torch.Tensor]
    answer: dict


def read_trained(output_dir: Path) -> Trained:
    log = json.loads((output_dir / "trainer_state.json").read_text())["log_history"]
    saved = output_dir / "reft"
    assert (saved / "config.json").is_file(), f"{saved} is not in pyreft's layout"
    weights = {f"{path.name}:{key}": value for path in sorted(saved.glob("intkey_*.bin"))
               for key, value in torch.load(path).items()}
    return Trained(output_dir, [entry["loss"] for entry in log if "loss" in entry], weights,
                   torch.load(output_dir / "answer.pt"))


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """A model folder as users bring one (tiny Llama, a real BPE tokenizer) and a JSON file of examples."""
    from pyvene_dist.testing.models import instruction_examples, save_checkpoint

    folder = save_checkpoint(tmp_path_factory.mktemp("checkpoint"))
    (folder / "train.json").write_text(json.dumps(instruction_examples(GLOBAL_BATCH * STEPS)))
    return folder


#: Launched without --use_cpu on a machine without a GPU, as the README and launchers.md print them: HF's arguments
#: took each rank for the only process, and each trained alone on all the data (pyvene_dist.fixes.hf_trainer).
AS_PRINTED = ("torchrun", "deepspeed")


def train_reft_arguments(checkpoint, output_dir: Path, launcher=None, world_size=1) -> list[str]:
    flags = [flag for flag in FLAGS if flag != "--use_cpu" or launcher not in AS_PRINTED or torch.cuda.is_available()]
    return ["--model", str(checkpoint), "--data", str(checkpoint / "train.json"), *flags,
            "--output_dir", str(output_dir), "--per_device_train_batch_size", str(GLOBAL_BATCH // world_size)]


def train_reft(checkpoint, output_dir: Path, launcher, world_size=2) -> Trained:
    """train_reft.py under ``launcher`` (its run without one: one_process_runs)."""
    from pyvene_dist.testing.launch import free_port

    arguments = train_reft_arguments(checkpoint, output_dir, launcher, world_size)
    run_together([[*command, *arguments] for command in LAUNCHES[launcher](free_port(), output_dir)], cwd=ROOT,
                 timeout=600)
    return read_trained(output_dir)


@pytest.fixture(scope="module")
def one_process_runs(checkpoint, tmp_path_factory) -> Path:
    """The module's runs of train_reft.py without a launcher, made in one process one after the other
    (tests/scripts/train_reft_each.py: train_reft.py as ``__main__`` for each, one start, one import of pyreft; the
    process is forked from the preloaded server by launchers.run_forked):
    first ``one-process``, the reference of every launcher (``FLAGS``), made first so that it runs as it runs alone;
    then test_a_tokenizer_saved_without_a_length_trains_to_the_model_length's two runs of one step on ``no-length``,
    a copy of the checkpoint whose tokenizer was saved without a ``model_max_length``: ``default`` and ``flag``
    (``--model_max_length 5``). Returns ``(folder, failed)``: the folder holding the three output folders and
    ``no-length``, and the process's report if it failed or ran past its timeout, else ``""`` (each test
    that reads a run fails with it, as a launch of its own would have, but one_process where its own run completed
    before: its folder's last file, answer.pt, is written)."""
    import shutil

    folder = tmp_path_factory.mktemp("one-process-runs")
    no_length = folder / "no-length"
    shutil.copytree(checkpoint, no_length)
    settings = json.loads((no_length / "tokenizer_config.json").read_text())
    del settings["model_max_length"]
    (no_length / "tokenizer_config.json").write_text(json.dumps(settings))
    flags = [flag for flag in FLAGS if flag not in ("--prompt", PROMPT)]
    runs = [train_reft_arguments(checkpoint, folder / "one-process")] + [
        ["--model", str(no_length), "--data", str(checkpoint / "train.json"), *flags, "--max_steps", "1",
         "--output_dir", str(folder / name), *extra]
        for extra, name in (([], "default"), (["--model_max_length", "5"], "flag"))]
    try:  # a process of its own, forked from the preloaded server
        run_forked(SCRIPTS / "train_reft_each.py", [a for run in runs for a in (THEN, *run)][1:], timeout=600)
    except pytest.fail.Exception as failed:
        return folder, str(failed)
    return folder, ""


@pytest.fixture(scope="module")
def one_process(one_process_runs):
    folder, failed = one_process_runs
    if failed and not (folder / "one-process" / "answer.pt").is_file():
        pytest.fail(failed)
    return read_trained(folder / "one-process")


@pytest.fixture(scope="session")
def launched(checkpoint, tmp_path_factory):
    """Each launcher's run, made once in the session by the first test that asks for it."""
    runs = {}

    def get(launcher):
        if launcher not in runs:
            runs[launcher] = train_reft(checkpoint, tmp_path_factory.mktemp(launcher), launcher, world_size=2)
        return runs[launcher]
    return get


def test_a_tokenizer_saved_without_a_length_trains_to_the_model_length(one_process_runs):
    """pyreft's data helpers truncate to ``tokenizer.model_max_length``: a tokenizer saved without one holds
    1e30, and they stopped with ``OverflowError: int too big to convert``. The script passes the model's
    ``max_position_embeddings`` (or ``--model_max_length``). Both runs (``default`` and ``flag``) are made by
    one_process_runs, in its one process."""
    from transformers import AutoTokenizer

    one_process_runs, failed = one_process_runs
    if failed:
        pytest.fail(failed)
    assert AutoTokenizer.from_pretrained(one_process_runs / "no-length").model_max_length > 2 ** 63  # saved: no length
    logged = {name: json.loads((one_process_runs / name / "trainer_state.json").read_text())["log_history"][0]
              for name in ("default", "flag")}
    # The examples are 6 tokens long: kept whole at the model's 128 positions, cut to 5 by the flag.
    assert logged["default"]["loss"] != logged["flag"]["loss"]


def test_one_process_logs_saves_and_answers(one_process):
    assert len(one_process.losses) == STEPS
    assert len({name.split(":")[0] for name in one_process.weights}) == 4  # 2 layers x first and last position
    assert one_process.answer["ids"].shape[0] > 3 and one_process.answer["text"].startswith(f" {PROMPT}")


@pytest.mark.parametrize("launcher", LAUNCHES)
def test_train_reft_under_a_launcher_matches_one_process(one_process, launched, launcher):
    trained = launched(launcher)
    deviation = max((abs(a - b) / abs(b) for a, b in zip(trained.losses, one_process.losses)), default=float("nan"))
    print(f"{launcher}: losses {trained.losses}, one process {one_process.losses} (max rel deviation {deviation:.1e})")
    torch.testing.assert_close(torch.tensor(trained.losses), torch.tensor(one_process.losses), rtol=1e-5, atol=0)
    assert trained.weights.keys() == one_process.weights.keys()
    for name, expected in one_process.weights.items():
        torch.testing.assert_close(trained.weights[name], expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item(),
                                   msg=lambda message, name=name: f"{launcher}, {name}: {message}")


#: Where the interventions were trained: DDP, FSDP2 (on GPUs; on CPU accelerate trains DDP), ZeRO-3.
def test_accelerate_fsdp2_on_one_process_matches_one_process(checkpoint, one_process, tmp_path):
    """The docs' FSDP2 line with ``--num_processes 1`` (FSDP's applied on the CPU too: train_reft_fsdp_on_cpu.py). A
    world of one loads the base whole, and accelerate, under ``cpu_ram_efficient_loading``, moves the whole model to
    the meta device before ``fully_shard``: the broadcast of what no file held copied into shards with no storage, and
    the first forward failed ("FSDP parameters should be materialized from meta device before training"; on an
    H100 at 3d8fa9c, and here)."""
    from pyvene_dist.testing.launch import free_port

    command = ["-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / "accelerate-fsdp2.yaml"),
               "--num_processes", "1", "--main_process_port", str(free_port()),
               str(SCRIPTS / "train_reft_fsdp_on_cpu.py")]
    run_together([[*command, "--model", str(checkpoint), "--data", str(checkpoint / "train.json"), *FLAGS,
                   "--output_dir", str(tmp_path), "--per_device_train_batch_size", str(GLOBAL_BATCH)]], cwd=ROOT,
                 timeout=600)
    trained = read_trained(tmp_path)
    torch.testing.assert_close(torch.tensor(trained.losses), torch.tensor(one_process.losses), rtol=1e-5, atol=0)
    assert trained.weights.keys() == one_process.weights.keys()
    for name, expected in one_process.weights.items():
        torch.testing.assert_close(trained.weights[name], expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


SERVED = {"ddp": "torchrun", "fsdp2": "accelerate-fsdp2.yaml", "zero3": "accelerate-zero3.yaml"}


@pytest.fixture(scope="session")
def served(launched, tmp_path_factory):
    """A process of its own (forked from the preloaded server: launchers.run_forked) loads each saved set with
    pyreft's ReftModel.load and answers PROMPT: serve_each.py runs docs/examples/serve_reft.py's ``load`` for each
    folder in turn (one process instead of three), with the model, positions and dtype train_reft.py saved beside
    the interventions (none is passed here)."""
    folders = {strategy: str(launched(launcher).output_dir / "reft") for strategy, launcher in SERVED.items()}
    out = tmp_path_factory.mktemp("served") / "answers.pt"
    run_forked(ROOT / "tests" / "scripts" / "serve_each.py", [str(out), PROMPT, *folders.values()])
    answers = torch.load(out)
    return {strategy: answers[folder] for strategy, folder in folders.items()}


@pytest.mark.parametrize("strategy", SERVED)
def test_reloaded_interventions_answer_as_the_trained_model(launched, served, strategy):
    trained = launched(SERVED[strategy]).answer
    print(f"{strategy}: trained {trained['text']!r}, reloaded {served[strategy]['text']!r}")
    torch.testing.assert_close(served[strategy]["logits"], trained["logits"], rtol=1e-5,
                               atol=1e-5 * trained["logits"].abs().max().item())
    assert served[strategy]["ids"].tolist() == trained["ids"].tolist()


def test_zero3_loads_the_checkpoint_partitioned(checkpoint, tmp_path):
    """Arguments first, then from_pretrained: every parameter arrives partitioned (zero.Init), none whole."""
    from safetensors import safe_open

    from pyvene_dist.testing.launch import free_port

    out = tmp_path / "state.pt"
    run_together([["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
                   str(ROOT / "tests" / "scripts" / "zero3_load_probe.py"), str(out), "--model", str(checkpoint),
                   "--data", str(checkpoint / "train.json"), "--use_cpu", "--output_dir", str(tmp_path),
                   "--deepspeed", str(CONFIGS / "deepspeed-zero3.json")]], cwd=ROOT)
    state = torch.load(out)
    with safe_open(checkpoint / "model.safetensors", "pt") as weights:
        sizes = {name: weights.get_slice(name).get_shape() for name in weights.keys()}
    assert set(state) == set(sizes)
    for name, shape in sizes.items():
        assert state[name] == {"ds_id": True, "ds_status": "ZeroParamStatus.NOT_AVAILABLE", "numel": 0,
                               "ds_numel": torch.Size(shape).numel()}, name


def test_ray_train_torch_trainer_matches_one_process(tmp_path, trainer_runs):
    """Ray Train's TorchTrainer as the launcher (a local Ray cluster on CPU, 2 workers, the gloo group Ray sets
    up): pyreft's ReftTrainer in each worker, patched there, trains as one process does."""
    pytest.importorskip("ray.train.torch", reason="Ray Train is not installed (pip install 'pyvene_dist[ray]')")
    single = trainer_runs(1, "ReftTrainer")
    on_ray = run_launcher(tmp_path, [str(SCRIPTS / "train_with_ray.py")], ("--workers", "2"))
    print("ReftTrainer losses, 1 process:    ", single.losses, "\n                  2 Ray workers:", on_ray.losses)
    assert len(on_ray.losses) == ParityCase().steps
    assert_parity(single, on_ray, ParityCase().tolerance)
