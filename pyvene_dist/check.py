"""``pyvene-dist check``: does ReFT training under each strategy give the result of one device, here?

For every strategy and world size this machine can run, train ``ParityCase`` under it in a world of
spawned processes, train it once on one device in this process, compare, and print a table.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterable

import torch

from .testing import ParityCase, Record, Strategy, assert_parity, differences, spawn, train

#: Given a world size: None when this machine can run it, else why not.
Requirement = Callable[[int], "str | None"]


def gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _ranks(world_size: int) -> str | None:
    """One rank per GPU where there are GPUs, else CPU processes over gloo."""
    if gpu_count():
        return None if world_size <= gpu_count() else f"needs {world_size} GPUs, found {gpu_count()}"
    cores = os.cpu_count() or 1
    return None if world_size <= max(cores, 2) else f"needs {world_size} CPU cores, found {cores}"


def _gpus(world_size: int) -> str | None:
    return None if gpu_count() >= max(world_size, 2) else f"needs {max(world_size, 2)} GPUs, found {gpu_count()}"


def _deepspeed(requirement: Requirement) -> Requirement:
    def check(world_size: int) -> str | None:
        import importlib.util

        if importlib.util.find_spec("deepspeed") is None:
            return "deepspeed not installed"
        return requirement(world_size)

    return check


STRATEGIES: dict[str, Requirement] = {
    "ddp": _ranks,
    "ddp+checkpointing": _ranks,
    "fsdp2": _ranks,
    "zero2": _deepspeed(_ranks),
    "zero3": _deepspeed(_ranks),
    "zero3+checkpointing": _deepspeed(_ranks),
    "fsdp1": _gpus,
    "zero3-offload": _deepspeed(_gpus),
    "dataparallel": _gpus,  # one process over every visible GPU
}


@dataclasses.dataclass
class Row:
    strategy: str
    world_size: int
    verdict: str  # "agrees", "differs", "failed", "unavailable"
    loss: float | None = None
    grad: float | None = None
    weight: float | None = None
    peak_memory_bytes: int = 0
    seconds: float = 0.0
    detail: str = ""


def run(case: ParityCase, strategies: Iterable[str], world_sizes: Iterable[int], *, progress=None) -> list[Row]:
    reference = train(case, Strategy("cuda:0" if gpu_count() else "cpu"))  # this process, one device
    plan = [(s, n) for s in strategies for n in ([1] if s == "dataparallel" else world_sizes)]
    rows = []
    for strategy, world_size in plan:
        if progress:
            progress(f"{strategy} x{world_size}")
        reason = STRATEGIES[strategy](world_size)
        if reason is not None:
            rows.append(Row(strategy, world_size, "unavailable", detail=reason))
            continue
        rows.append(_run_one(case, strategy, world_size, reference))
    return rows


def _run_one(case: ParityCase, strategy: str, world_size: int, reference: Record) -> Row:
    started = time.monotonic()
    name, _, variant = strategy.partition("+")
    if variant == "checkpointing":
        case = dataclasses.replace(case, checkpointing="non-reentrant")  # compared with the plain reference
    processes = 1 if name == "dataparallel" else world_size
    backend = "nccl" if gpu_count() >= processes else "gloo"
    with tempfile.TemporaryDirectory(prefix="pyvene-dist-check") as workdir:
        out = Path(workdir) / "record.pt"
        outcome = spawn(_train_on_rank, world_size=processes, backend=backend, workdir=workdir,
                        args=(case, name, str(out)))
        seconds = time.monotonic() - started
        if outcome.failed or not out.exists():
            return Row(strategy, world_size, "failed", seconds=seconds, detail=outcome.report())
        candidate = Record(**torch.load(out))
    found = differences(reference, candidate)
    row = Row(strategy, world_size, "agrees", found.loss, found.grad, found.weight, candidate.peak_memory_bytes, seconds)
    try:
        assert_parity(reference, candidate, case.tolerance)
    except AssertionError as error:
        row.verdict, row.detail = "differs", str(error)
    return row


def _train_on_rank(case: ParityCase, strategy: str, out: str) -> None:
    import contextlib
    import sys

    import torch.distributed as dist

    from . import patch

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed on CPU
    with contextlib.redirect_stdout(sys.stderr):  # stdout is the table's, or the JSON's
        patch()
        record = train(case, strategy)
    if dist.get_rank() == 0:
        torch.save(dataclasses.asdict(record), out)


def table(rows: list[Row]) -> str:
    header = ("strategy", "world", "max |dloss|", "max rel dgrad", "max rel dweight", "peak mem", "time", "verdict")
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
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(line, widths)) + "  " + line[-1] for line in lines
    )


def to_json(rows: list[Row]) -> str:
    return json.dumps([dataclasses.asdict(row) for row in rows], indent=2)


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.1e}"
