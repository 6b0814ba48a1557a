"""``pyvene-dist check``: does ReFT training under each strategy give the result of one device, here?

Train the case once on one device in this process (the reference row), then under every strategy and
world size this machine can run, each in a world of processes of its own (forked from a server that imported
torch, transformers and pyvene once: ``testing._preloaded``); compare every run with the reference and print
a table.

A rank is a process with one device: a GPU where there are GPUs (nccl), else a gloo process on the
CPU. On CPU, ``check`` runs at most as many ranks as this process may use CPU cores (2 on a one-core
machine): more would only take turns on the same cores.
"""

from __future__ import annotations

import ctypes
import dataclasses
import importlib.util
import json
import math
import os
import resource
import sys
import tempfile
import time
from pathlib import Path
from types import MappingProxyType
from typing import Iterable

import torch
import torch.distributed as dist

from . import patch
from ._optional import REFT_INSTALL
from .testing import STRATEGIES, TOLERANCES, Record, Strategy, assert_parity, differences, spawn, tolerance, train
from .testing import _preloaded
from .testing.check_runs import CheckCase, has_weights
from .testing.launch import rank_threads

#: The dtypes ``check`` compares in (``--dtype``): those the parity harness has a measured bound for. float16
#: has none, and DeepSpeed would train it with a dynamic loss scale that one device does not have.
DTYPES = tuple(str(dtype).removeprefix("torch.") for dtype in TOLERANCES)

class UsageError(Exception):
    """A mistake in what the user asked for: reported as one line, exit code 2."""


def gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def rank_devices() -> tuple[int, str]:
    """How many ranks this machine runs at once, and what a rank runs on."""
    if gpu_count():
        return gpu_count(), "GPUs (one rank per GPU)"
    return max(cpu_count(), 2), "CPU cores (one gloo rank per core)"


#: What ``pyvene-dist check`` runs, in this order: names of the harness's ``STRATEGIES`` (which say what
#: each needs of the machine), ``+checkpointing`` for the same strategy with non-reentrant gradient
#: checkpointing, compared with the plain reference.
CHECKED = (
    "ddp", "ddp+checkpointing", "fsdp2", "fsdp2+checkpointing", "accelerate", "tp", "tp-fsdp2", "hsdp",
    "zero2", "zero3", "zero3+checkpointing", "fsdp1", "fsdp1+checkpointing", "zero3-offload", "dataparallel",
    "device_map",
)
REFERENCE = "single"
#: What ``check --quantize`` runs by default, and all it takes: the strategies that trained LoReFT over that
#: bitsandbytes base with one process's results on the CPU (tests/strategies/test_quantized.py; FSDP refuses 8-bit).
QUANTIZED_CHECKED = MappingProxyType({
    "4bit": ("ddp", "fsdp2", "fsdp2+checkpointing", "accelerate", "zero3", "zero3+checkpointing"),
    "8bit": ("ddp", "accelerate", "zero3"),
})


@dataclasses.dataclass
class Row:
    strategy: str
    world_size: int
    verdict: str  # "reference", "agrees", "differs", "failed", "unavailable"
    loss: float | None = None
    grad: float | None = None
    weight: float | None = None
    peak_memory_bytes: int = 0
    memory: str = ""  # what peak_memory_bytes measures: CUDA_MEMORY or CPU_MEMORY
    seconds: float = 0.0
    detail: str = ""


def _registered(strategy: str):
    return STRATEGIES[strategy.partition("+")[0]]


def reason(strategy: str, world_size: int) -> str | None:
    """Why this machine cannot run ``strategy`` at ``world_size``; None when it can. Every strategy
    runs in every dtype the check offers (ZeRO's bf16 is judged by DeepSpeed's bf16 bound)."""
    return _registered(strategy).unavailable(world_size, gpu_count())


def validate(strategies: Iterable[str], world_sizes: Iterable[int]) -> None:
    """Raise ``UsageError`` for an unknown strategy, more ranks than this machine has devices, or no pyreft."""
    missing = [name for name in ("pyreft", "datasets") if importlib.util.find_spec(name) is None]
    if missing:
        raise UsageError(f"check trains LoReFT with pyreft; {' and '.join(missing)} not installed here: "
                         f"{REFT_INSTALL}")
    unknown = [name for name in strategies if name not in CHECKED and name != REFERENCE]
    if unknown:
        raise UsageError(f"unknown strategy {', '.join(unknown)}; known: {', '.join(CHECKED)}")
    devices, what = rank_devices()
    too_many = [size for size in world_sizes if size > devices]
    if too_many:
        raise UsageError(f"--world-sizes {','.join(map(str, too_many))}: this machine has {devices} {what}")
    planned = [(name, size, reason(name, size)) for name, size in plan(strategies, world_sizes)]
    if not planned:
        raise UsageError(f"no strategy to compare with {REFERENCE}; known: {', '.join(CHECKED)}")
    if all(why is not None for _, _, why in planned):
        reasons = "; ".join(f"{name} x{size} {why}" for name, size, why in planned)
        raise UsageError(f"none of the strategies asked for can run here: {reasons}")


def quantized_strategies(strategies: list[str], quantize: str) -> list[str]:
    """The strategies ``check --quantize`` runs: all that take ``quantize`` when ``strategies`` is the default (every
    one of ``CHECKED``); ``UsageError`` naming a strategy asked for that does not take it."""
    if importlib.util.find_spec("bitsandbytes") is None:
        raise UsageError(f"--quantize {quantize} loads the model with bitsandbytes, which is not installed here: "
                         'pip install "pyvene_dist[quantize]"')
    allowed = QUANTIZED_CHECKED[quantize]
    if list(strategies) == list(CHECKED):
        return list(allowed)
    refused = [name for name in strategies if name not in allowed and name != REFERENCE]
    if refused:
        raise UsageError(f"--strategies {','.join(refused)} with --quantize {quantize}: check runs a {quantize} base "
                         f"under {', '.join(allowed)} (docs/quantized.md)")
    return list(strategies)


def plan(strategies: Iterable[str], world_sizes: Iterable[int]) -> list[tuple[str, int]]:
    sizes, steps = list(world_sizes), []
    for name in dict.fromkeys(strategies):
        if name == REFERENCE:
            continue
        if _registered(name).one_process:  # one process drives every device here
            steps.append((name, max(gpu_count(), 2)))
        else:
            steps.extend((name, size) for size in sizes)
    return steps


def default_world_sizes() -> list[int]:
    return [min(2, rank_devices()[0])]


def batch_size(case: CheckCase, world_sizes: Iterable[int]) -> int:
    """The case's batch, grown to a multiple of every world size (each rank gets an equal share)."""
    return math.lcm(case.batch_size, *world_sizes, *([gpu_count()] if gpu_count() else []))


def start_ranks_server(strategies: Iterable[str], world_sizes: Iterable[int]) -> None:
    """Start the server the ranks fork from (``testing._preloaded``, started at the first world otherwise) when a
    planned run can go here: its imports of torch, transformers and pyvene then run beside this process's own
    import of pyvene and the reference's training, on another core. It serves this environment, which neither
    ``patch()`` nor the reference's training changes."""
    if any(reason(name, size) is None for name, size in plan(strategies, world_sizes)):
        _preloaded.context()


def run(case: CheckCase, strategies: Iterable[str], world_sizes: Iterable[int], *, progress=None) -> list[Row]:
    """The reference row, then one row per (strategy, world size) of ``plan``. ``progress(done, total, label)``."""
    steps = plan(strategies, world_sizes)
    progress = progress or (lambda done, total, label: None)
    progress(0, len(steps) + 1, f"{REFERENCE} (reference)")
    started = time.monotonic()
    if not gpu_count():
        return_freed_memory()
    try:
        reference = train(case, Strategy("cuda:0" if gpu_count() else "cpu"))
    except Exception as error:
        if not case.local:
            raise
        raise UsageError(f"cannot train ReFT on {case.model}: {type(error).__name__}: {error}") from error
    memory, label = (reference.peak_memory_bytes, CUDA_MEMORY) if gpu_count() else (_peak_rss(), CPU_MEMORY)
    rows = [Row(REFERENCE, 1, "reference", peak_memory_bytes=memory, memory=label,
                seconds=time.monotonic() - started)]
    for done, (strategy, world_size) in enumerate(steps, start=1):
        why = reason(strategy, world_size)
        progress(done, len(steps) + 1, f"{strategy} x{world_size}" + (" (unavailable)" if why else ""))
        if why is not None:
            rows.append(Row(strategy, world_size, "unavailable", detail=why))
            continue
        rows.append(_run_one(case, strategy, world_size, reference))
    progress(len(steps) + 1, len(steps) + 1, "done")
    return rows


def _run_one(case: CheckCase, strategy: str, world_size: int, reference: Record) -> Row:
    started = time.monotonic()
    name, _, variant = strategy.partition("+")
    if variant == "checkpointing":
        case = dataclasses.replace(case, checkpointing="non-reentrant")  # compared with the plain reference
    registered = STRATEGIES.get(name)  # an unknown name fails in the ranks, which report it
    processes = 1 if registered is not None and registered.one_process else world_size
    backend = "nccl" if gpu_count() >= processes else "gloo"
    with tempfile.TemporaryDirectory(prefix="pyvene-dist-check") as workdir:
        out = Path(workdir) / "record.pt"
        outcome = spawn(_train_on_rank, world_size=processes, backend=backend, workdir=workdir,
                        args=(case, name, world_size, workdir))
        seconds = time.monotonic() - started
        if outcome.failed or not out.exists():
            detail = outcome.report() + _log_tail(Path(workdir) / "rank0.log")
            return Row(strategy, world_size, "failed", seconds=seconds, detail=detail)
        saved = torch.load(out)
    candidate = Record(**saved["record"])
    bound = judged(case, name)
    found = differences(reference, candidate, adam_lr=bound.adam_response_lr)
    row = Row(strategy, world_size, "agrees", found.loss, found.grad, found.weight, saved["peak"], saved["memory"],
              seconds)
    try:
        assert_parity(reference, candidate, bound)
    except AssertionError as error:
        row.verdict, row.detail = "differs", str(error)
    else:
        if found.weight > bound.rtol and found.weight_beyond_adam is not None:
            row.detail = (f"final weights up to {found.weight:.1e} apart (relative), beyond the {bound.rtol:.0e} "
                          "bound; "
                          f"the gradients agree within {found.grad:.1e}, and AdamW's own steps on each run's recorded "
                          f"gradients account for all but {found.weight_beyond_adam:.1e} of it: AdamW divides each "
                          "element's step by its gradient's root mean square, so an element whose gradient is near "
                          "zero is stepped by its rounding (docs/troubleshooting.md)")
    return row


def judged(case: CheckCase, strategy: str):
    """The bound ``check`` judges ``strategy`` by: the harness's, and in float32 the final weights compared after
    AdamW's response to the two runs' own gradients (``testing.comparison.adam_response``): on a user's model some
    gradient elements are rounding around zero, which AdamW turns into steps of up to lr (ZeRO-3 on a 206M model
    moved one weight 3.9e-5 apart while its gradients agreed within 1.2e-6)."""
    bound = tolerance(case, strategy)
    if case.torch_dtype != torch.float32:
        return bound
    return dataclasses.replace(bound, adam_response_lr=case.lr,
                               why=bound.why + "; final weights after AdamW's response to each run's gradients")


def _train_on_rank(case: CheckCase, strategy: str, world_size: int, workdir: str) -> None:
    rank = dist.get_rank()
    log = open(Path(workdir) / f"rank{rank}.log", "w")  # the ranks' chatter stays off the progress bar
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed on CPU
        return_freed_memory()
        if "OMP_NUM_THREADS" not in os.environ:  # the user's setting, else this rank's share of the cores
            torch.set_num_threads(rank_threads(dist.get_world_size()))
    patch()
    record = train(case, strategy)
    memory, label = (_peak_cuda(), CUDA_MEMORY) if torch.cuda.is_available() else (_peak_rss(), CPU_MEMORY)
    peaks = [0] * dist.get_world_size()
    dist.all_gather_object(peaks, memory)
    if rank == 0:
        torch.save({"record": dataclasses.asdict(record), "peak": max(peaks), "memory": label},
                   Path(workdir) / "record.pt")


CUDA_MEMORY = "GPU: torch.cuda.max_memory_allocated during training, largest rank"
CPU_MEMORY = ("CPU: peak resident set size of the process (imports included), largest rank; glibc's mmap threshold "
              "fixed at 128 KiB, so that freed buffers go back to the system")
#: glibc's mallopt parameter for the size from which an allocation is mapped on its own (and unmapped when freed).
M_MMAP_THRESHOLD = -3


def return_freed_memory(threshold: int = 128 * 1024) -> None:
    """Fix glibc's mmap threshold (its default start) for this process, so that every buffer of ``threshold`` bytes or
    more is unmapped when freed. glibc raises the threshold to the size of the largest buffer freed so far, and
    later buffers of that size come from heaps it keeps: a CPU rank's gathered layers (FSDP2, ZeRO-3), each freed
    after use, then stay resident (benchmarks/loading.py measures both). The peak a rank reports is then what it
    held, as on a GPU, whose caching allocator reports what is allocated. No effect where the C library is not glibc."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, threshold)
    except (OSError, AttributeError):
        return


def _peak_cuda() -> int:
    return max(torch.cuda.max_memory_allocated(device) for device in range(torch.cuda.device_count()))


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _log_tail(log: Path, lines: int = 20) -> str:
    if not log.exists():
        return ""
    tail = log.read_text(errors="replace").splitlines()[-lines:]
    return "\n--- rank 0 output, last lines:\n" + "\n".join(tail) if tail else ""


def case_summary(case: CheckCase) -> str:
    """One line saying what is trained, including what was chosen to fit the model."""
    if not case.local:
        source = "built-in, built from a config"
    elif has_weights(case.model):
        source = "its weights"
    else:
        source = f"built from its config with random weights, seed {case.seed}"
    quantize = getattr(case, "quantize", None)
    if quantize is not None:
        source += f", loaded in {quantize} by bitsandbytes"
    plural = "s" if len(case.layers) > 1 else ""
    return (f"model {case.model} ({source}); {case.intervention} rank {case.rank} at {case.component} of "
            f"layer{plural} {', '.join(map(str, case.layers))}; {case.dtype}, {case.steps} steps of "
            f"{case.batch_size} sequences x {case.seq_len} tokens")


def table(rows: list[Row]) -> str:
    header = ("strategy", "world", "max |dloss|", "max rel dgrad", "max rel dweight",
              "peak mem" + (" (RSS)" if any(row.memory == CPU_MEMORY for row in rows) else ""), "time", "verdict")
    lines = [header]
    for row in rows:
        lines.append((
            row.strategy,
            str(row.world_size),
            _number(row.loss),
            _number(row.grad),
            _number(row.weight),
            f"{row.peak_memory_bytes / 2**20:.0f} MiB" if row.peak_memory_bytes else "-",
            f"{row.seconds:.1f} s" if row.seconds else "-",
            row.verdict if row.verdict != "unavailable" else f"unavailable: {row.detail}",
        ))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header) - 1)]
    text = "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(line, widths)) + "  " + line[-1] for line in lines
    )
    memory = sorted({row.memory for row in rows if row.memory})
    text += "".join(f"\npeak mem: {label}" for label in memory)
    for row in rows:
        if row.verdict in ("failed", "differs"):
            text += f"\n\n{row.strategy} x{row.world_size} {row.verdict}:\n{row.detail}"
        elif row.verdict == "agrees" and row.detail:
            text += f"\n\n{row.strategy} x{row.world_size} agrees: {row.detail}"
    return text


def to_json(rows: list[Row]) -> str:
    return json.dumps([dataclasses.asdict(row) for row in rows], indent=2)


def passed(rows: list[Row]) -> bool:
    return all(row.verdict in ("reference", "agrees", "unavailable") for row in rows)


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.1e}"


class Progress:
    """A bar on a terminal, one line per step otherwise (logs, CI)."""

    def __init__(self, stream=sys.stderr):
        self.stream, self.started = stream, time.monotonic()
        self.tty, self.line_open = stream.isatty(), False

    def __call__(self, done: int, total: int, label: str) -> None:
        elapsed = f"{time.monotonic() - self.started:.0f} s"
        if self.tty:
            bar = "#" * (20 * done // total) + "-" * (20 - 20 * done // total)
            end = "\n" if done == total else ""
            self.stream.write(f"\r\033[K[{bar}] {done}/{total} {elapsed} {label}{end}")
            self.line_open = done != total
        else:
            self.stream.write(f"[{done}/{total}] {elapsed} {label}\n")
        self.stream.flush()

    def close(self) -> None:
        """End the bar's line, so that what follows (an error) starts on its own."""
        if self.line_open:
            self.stream.write("\n")
            self.line_open = False
