"""Run one function in N spawned processes that form a ``torch.distributed`` group, and report every rank.

The process handling follows PyTorch's ``common_distributed``: a context of its own (never the global start
method; spawn's, or ranks forked from a server that imported torch, transformers and pyvene once:
``_preloaded``), a ``FileStore`` rendezvous in a folder the caller owns, each rank's outcome (passed, skipped
with its reason, failed with its traceback) sent back to the parent, and a deadline after which every
live rank dumps its stack (``faulthandler``) and is killed, so a hang becomes a report instead of a
stuck run. When one rank fails or skips, the others get ``grace`` seconds to report before they are
presumed stuck in a collective that will never complete.
"""

from __future__ import annotations

import dataclasses
import datetime
import faulthandler
import os
import queue
import signal
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from . import _preloaded

PASSED, SKIPPED, FAILED, TIMED_OUT, CRASHED = "passed", "skipped", "failed", "timed out", "crashed"
INITIALISED = "pyvene_dist/initialised"  # store keys a rank sets once its process group is up


@dataclasses.dataclass(frozen=True)
class RankOutcome:
    rank: int
    status: str
    detail: str = ""
    #: False where the rank's process cannot serve another run (``testing.worlds``): it is leaving.
    reusable: bool = True


@dataclasses.dataclass(frozen=True)
class WorldOutcome:
    world_size: int
    backend: str
    ranks: tuple[RankOutcome, ...]

    @property
    def failed(self) -> bool:
        return any(r.status in (FAILED, TIMED_OUT, CRASHED) for r in self.ranks)

    @property
    def skipped(self) -> tuple[RankOutcome, ...]:
        return tuple(r for r in self.ranks if r.status == SKIPPED)

    def report(self) -> str:
        lines = [f"world of {self.world_size} ({self.backend}):"]
        for outcome in self.ranks:
            lines.append(f"--- rank {outcome.rank}: {outcome.status}")
            if outcome.detail:
                lines.append(outcome.detail.rstrip())
        return "\n".join(lines)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def world_env(world_size: int) -> dict[str, str]:
    """What torchrun sets for every rank of a one-node world (each rank adds its ``RANK`` and ``LOCAL_RANK``)."""
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size)}


def spawn(
    fn: Callable[..., Any],
    *,
    world_size: int,
    workdir: str | os.PathLike,
    backend: str = "gloo",
    timeout: float = 300.0,
    grace: float = 20.0,
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
) -> WorldOutcome:
    """Call ``fn(*args, **kwargs)`` on ranks ``0..world_size-1``, each in its own spawned process.

    ``fn`` and its arguments must be picklable (a module-level function is). Every rank sees
    ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` and ``MASTER_ADDR``/``MASTER_PORT`` as torchrun sets
    them, with the default process group already initialised; with ``nccl`` each rank owns
    ``cuda:<rank>``.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    store = workdir / "rendezvous"
    store.unlink(missing_ok=True)
    context = _preloaded.context()
    results = context.Queue()
    env = world_env(world_size)
    processes = [
        context.Process(
            target=_rank_main,
            args=(fn, rank, world_size, backend, str(store), env, results, str(_stack_file(workdir, rank)),
                  tuple(args), dict(kwargs or {}), timeout),
            name=f"rank{rank}",
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    outcomes: dict[int, RankOutcome] = {}
    try:
        outcomes = _collect(processes, results, workdir, timeout=timeout, grace=grace)
    finally:
        _reap(processes, reported={rank for rank, o in outcomes.items() if o.status in (PASSED, SKIPPED, FAILED)})
    return WorldOutcome(world_size, backend, tuple(outcomes[rank] for rank in range(world_size)))


def _reap(processes, reported: set[int], *, exit_seconds: float = 30.0) -> None:
    """End every rank: those that reported get ``exit_seconds`` to exit by themselves, the rest are killed.

    A rank reports before it leaves its process group and runs its exit handlers. Killed there, it never
    releases the semaphores it made (DeepSpeed's and accelerate's among them), and the parent's
    resource tracker warns at shutdown: "There appear to be 1 leaked semaphore objects to clean up".
    """
    deadline = time.monotonic() + exit_seconds
    for rank, process in enumerate(processes):
        if rank in reported:
            process.join(timeout=max(deadline - time.monotonic(), 0.0))
        if process.is_alive():
            process.kill()
        process.join(timeout=10)


def _collect(processes, results, workdir: Path, *, timeout: float, grace: float,
             expected: str = PASSED) -> dict[int, RankOutcome]:
    """Every rank's report (``expected`` from a rank that went as it should), or its stack at the deadline."""
    outcomes: dict[int, RankOutcome] = {}
    deadline = time.monotonic() + timeout
    timed_out_status = TIMED_OUT
    while len(outcomes) < len(processes):
        if any(o.status != expected for o in outcomes.values()):
            # A rank left early; the others may wait forever in a collective it will never join.
            deadline = min(deadline, time.monotonic() + grace)
            timed_out_status = f"stuck after another rank stopped (no report within {grace:g}s)"
        try:
            outcome = results.get(timeout=min(1.0, max(deadline - time.monotonic(), 0.01)))
            outcomes[outcome.rank] = outcome
            continue
        except queue.Empty:
            pass
        for rank, process in enumerate(processes):
            if rank not in outcomes and not process.is_alive():
                _drain(results, outcomes)
                if rank not in outcomes:
                    outcomes[rank] = RankOutcome(rank, CRASHED, f"exited with code {process.exitcode} without reporting")
        if time.monotonic() >= deadline:
            _drain(results, outcomes)
            stuck = [rank for rank in range(len(processes)) if rank not in outcomes]
            for rank in stuck:
                outcomes[rank] = RankOutcome(rank, timed_out_status, _dump_stack(processes[rank], workdir, rank))
    return outcomes


def _drain(results, outcomes: dict[int, RankOutcome]) -> None:
    while True:
        try:
            outcome = results.get(timeout=0.2)
        except queue.Empty:
            return
        outcomes[outcome.rank] = outcome


def _stack_file(workdir: Path, rank: int) -> Path:
    return workdir / f"stack-rank{rank}.txt"


def _dump_stack(process, workdir: Path, rank: int) -> str:
    if process.is_alive():
        os.kill(process.pid, signal.SIGUSR1)
        time.sleep(1.0)
    stack = _stack_file(workdir, rank)
    text = stack.read_text() if stack.exists() else ""
    return "stack at the deadline:\n" + (text or "(no stack written)")


def _rank_main(fn, rank, world_size, backend, store_path, env, results, stack_path, args, kwargs, timeout):
    enter_rank(rank, env, stack_path)

    def body():
        _init_process_group(backend, store_path, rank, world_size, timeout)
        fn(*args, **kwargs)

    try:
        results.put(outcome_of(rank, body))
    finally:
        _destroy_process_group()
        results.close()
        results.join_thread()


def rank_threads(world_size: int) -> int:
    """Intra-op threads for a CPU rank: the cores this process may use, shared out among the world's ranks, as
    accelerate sets them for its CPU ranks (``PartialState``, unless ``OMP_NUM_THREADS`` is set). Each rank would
    otherwise run a thread per core: on 2 cores a world of 2 ran 4 threads, which waited for each other (``pyvene-dist
    check --strategies ddp,zero3,fsdp2`` on a quiet 2-core machine: its zero3 and fsdp2 rows 2.1 and 1.3 s so, 1.4
    and 0.8 s with one thread a rank)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // world_size)


def enter_rank(rank: int, env: dict[str, str], stack_path: str) -> None:
    """Make this process rank ``rank`` (torchrun's variables) and let SIGUSR1 write every thread's stack to
    ``stack_path``, which the parent reads at a deadline (``_dump_stack``)."""
    os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank))
    faulthandler.register(signal.SIGUSR1, file=open(stack_path, "w"), all_threads=True)  # open while the rank lives


def outcome_of(rank: int, body: Callable[[], Any]) -> RankOutcome:
    """``body()``'s outcome on this rank: passed, skipped with pytest's reason, or failed with the traceback."""
    try:
        body()
    except BaseException as exc:  # noqa: BLE001 -- every outcome goes back to the parent
        if _is_skip(exc):
            return RankOutcome(rank, SKIPPED, str(exc))
        return RankOutcome(rank, FAILED, traceback.format_exc())
    return RankOutcome(rank, PASSED)


def _init_process_group(backend: str, store_path: str, rank: int, world_size: int, timeout: float) -> None:
    if backend == "nccl":
        torch.cuda.set_device(rank)
    store = dist.FileStore(store_path, world_size)
    deadline = datetime.timedelta(seconds=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=deadline)
    # gloo's connectFullMesh returns on a rank as soon as its own side of every pair is up. A rank whose
    # test body is short then leaves and closes pairs a slower rank is still connecting ("Gloo
    # connectFullMesh failed ... Connection closed by peer"). No rank starts the body, so none leaves,
    # before every rank is through init_process_group.
    store.set(f"{INITIALISED}/{rank}", "1")
    store.wait([f"{INITIALISED}/{other}" for other in range(world_size)], deadline)


def _destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _is_skip(exc: BaseException) -> bool:
    outcomes = sys.modules.get("_pytest.outcomes")  # only a test that imported pytest can have skipped
    return outcomes is not None and isinstance(exc, outcomes.Skipped)
