"""Worlds that stay up between tests: process start-up paid once per world, not once per test.

``spawn`` (``launch.py``) starts N processes, forms their process group, runs one function and ends them.
On the 2-core CPU machine the start-up (a Python per rank importing torch, transformers and pyvene, then
the rendezvous) took 16 s for two ranks under load, more than many small multi-process tests' bodies. A
``World`` starts its ranks once; each ``run`` sends the function to every rank, which calls it in its live
process group and reports as ``spawn``'s ranks do (passed, skipped, failed with the traceback; a deadline
past which every live rank's stack is printed).

Between runs a rank puts back what a test may leave behind: the environment variables, the working
directory, ``pyvene_dist.patch()`` (unpatched), accelerate's process-wide state, transformers' ZeRO-3 switch (a
ZeRO-3 ``TrainingArguments`` kept alive by a cycle left it on, and the next test's models were built partitioned:
``'weight' must be 2-D``), and the default process group (initialised again if a test destroyed it). A world
in which a run failed, timed out or crashed is ended (a rank may be stuck in a collective, or hold state nobody
can vouch for); the next run starts a new one; so is a world whose rank could not be put back (the test's outcome
stands). A test that needs fresh processes asks for them (``world_size(..., fresh=True)`` in the pytest plugin),
and gets ``spawn``.

Each rank writes its output for a run to a file the parent reads back after the run (a process started
before the test cannot share the test's captured stdout), so the output shows in the test's report.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import itertools
import os
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any, Callable, Sequence

import torch.distributed as dist

from . import _preloaded
from .launch import (FAILED, PASSED, SKIPPED, RankOutcome, WorldOutcome, _collect, _destroy_process_group,
                     _init_process_group, _reap, _stack_file, enter_rank, outcome_of, world_env)


#: A rank's report that its process group is up (``World._start``), and how long a world may take to get there.
READY = "ready"
START_SECONDS = 300.0


class World:
    """``world_size`` ranks over ``backend``, started at the first ``run`` and kept until ``close`` or a failed
    run."""

    def __init__(self, world_size: int, backend: str = "gloo") -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {world_size}")
        self.world_size, self.backend = world_size, backend
        self._processes: list = []
        self._tasks: list = []
        self._results = None
        self._workdir: tempfile.TemporaryDirectory | None = None
        self.runs = 0  # how many runs the live ranks have served (0: none started)

    @property
    def alive(self) -> bool:
        return bool(self._processes) and all(process.is_alive() for process in self._processes)

    def _start(self, timeout: float, grace: float) -> WorldOutcome | None:
        """Start the ranks and wait until each has formed the process group: a world's start-up does not count
        against a test's timeout. The outcome where they did not, else None."""
        self._workdir = tempfile.TemporaryDirectory(prefix="pyvene-dist-world")
        workdir = Path(self._workdir.name)
        context = _preloaded.context()
        self._results = context.Queue()
        self._tasks = [context.Queue() for _ in range(self.world_size)]
        env = world_env(self.world_size)
        self._processes = [
            context.Process(target=_serve, name=f"rank{rank}", daemon=True,
                            args=(rank, self.world_size, self.backend, str(workdir / "rendezvous"), env,
                                  self._tasks[rank], self._results, str(_stack_file(workdir, rank)), timeout))
            for rank in range(self.world_size)
        ]
        for process in self._processes:
            process.start()
        self.runs = 0
        ready = _collect(self._processes, self._results, workdir, timeout=max(timeout, START_SECONDS), grace=grace,
                         expected=READY)
        if any(outcome.status != READY for outcome in ready.values()):
            self.close(reported=set())
            return WorldOutcome(self.world_size, self.backend, tuple(
                ready[rank] if ready[rank].status != READY else RankOutcome(rank, PASSED, "(started)")
                for rank in range(self.world_size)))
        return None

    def run(self, fn: Callable[..., Any], *, timeout: float = 300.0, grace: float = 20.0,
            args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None) -> WorldOutcome:
        """Call ``fn(*args, **kwargs)`` on every rank of the live world (started if none is), as ``spawn`` does."""
        if not self.alive:
            self.close()
            failed = self._start(timeout, grace)
            if failed is not None:
                return failed
        workdir = Path(self._workdir.name)
        self.runs += 1
        outputs = [workdir / f"output-{self.runs}-rank{rank}.txt" for rank in range(self.world_size)]
        for rank, tasks in enumerate(self._tasks):
            tasks.put((fn, tuple(args), dict(kwargs or {}), str(outputs[rank])))
        outcomes: dict[int, RankOutcome] = {}
        try:
            outcomes = _collect(self._processes, self._results, workdir, timeout=timeout, grace=grace)
        finally:
            if len(outcomes) < self.world_size or any(o.status not in (PASSED, SKIPPED) or not o.reusable
                                                      for o in outcomes.values()):
                self.close(reported={rank for rank, o in outcomes.items() if o.status in (PASSED, SKIPPED, FAILED)})
            for output in outputs:  # what each rank printed, into the test's captured output
                if output.exists():
                    sys.stdout.write(output.read_text(errors="replace"))
        return WorldOutcome(self.world_size, self.backend, tuple(outcomes[rank] for rank in range(self.world_size)))

    def close(self, reported: set[int] | None = None) -> None:
        """End the ranks: asked to leave if they are waiting for a run, killed otherwise."""
        if self._processes:
            waiting = set(range(self.world_size)) if reported is None else reported
            for rank in waiting:
                self._tasks[rank].put(None)
            _reap(self._processes, reported=waiting)
        self._processes, self._tasks = [], []
        if self._workdir is not None:
            self._workdir.cleanup()
            self._workdir = None


class Worlds:
    """One ``World`` per (size, backend), made on first use; ``close`` ends them all (a pytest session's end)."""

    def __init__(self) -> None:
        self._worlds: dict[tuple[int, str], World] = {}

    def get(self, world_size: int, backend: str) -> World:
        key = (world_size, backend)
        if key not in self._worlds:
            self._worlds[key] = World(world_size, backend)
        return self._worlds[key]

    def close(self) -> None:
        for world in self._worlds.values():
            world.close()
        self._worlds.clear()


def _serve(rank, world_size, backend, store_path, env, tasks, results, stack_path, timeout) -> None:
    enter_rank(rank, env, stack_path)
    try:
        _init_process_group(backend, store_path, rank, world_size, timeout)
    except BaseException:  # noqa: BLE001 -- reported as the world's start-up
        results.put(RankOutcome(rank, FAILED, f"the process group did not form:\n{traceback.format_exc()}"))
        return
    results.put(RankOutcome(rank, READY))
    environ, cwd = dict(os.environ), os.getcwd()
    try:
        while True:
            task = tasks.get()
            if task is None:
                return
            fn, args, kwargs, output = task
            with _output_to(output):
                outcome = outcome_of(rank, functools.partial(fn, *args, **kwargs))
                try:
                    _put_back(environ, cwd, backend, store_path, rank, world_size, timeout)
                except BaseException:  # noqa: BLE001 -- the test's outcome stands; its world is not reused
                    print(f"pyvene_dist: rank {rank} could not be reset after the test, so its world ends "
                          f"here:\n{traceback.format_exc()}", file=sys.stderr)
                    outcome = dataclasses.replace(outcome, reusable=False)
            results.put(outcome)
            if not outcome.reusable:  # e.g. DeepSpeed's zero.Init left every module class's __init__ replaced
                return
    finally:
        _destroy_process_group()
        results.close()
        results.join_thread()


class _output_to:
    """Point this process's stdout and stderr (file descriptors 1 and 2) at ``path`` for a run."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __enter__(self):
        sys.stdout.flush(), sys.stderr.flush()
        self.saved = os.dup(1), os.dup(2)
        file = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(file, 1), os.dup2(file, 2)
        os.close(file)

    def __exit__(self, *exc_info):
        sys.stdout.flush(), sys.stderr.flush()
        for fd, saved in zip((1, 2), self.saved):
            os.dup2(saved, fd)
            os.close(saved)


def _put_back(environ: dict, cwd: str, backend: str, store_path: str, rank: int, world_size: int,
              timeout: float) -> None:
    """Undo what a test may leave in the rank's process (see the module docstring)."""
    pyvene_dist = sys.modules.get("pyvene_dist")
    if pyvene_dist is not None and pyvene_dist.is_patched():
        pyvene_dist.unpatch()
    state = sys.modules.get("accelerate.state")
    if state is not None:  # process-wide singletons: a later Accelerator may ask for other settings
        state.AcceleratorState._reset_state(reset_partial_state=True)
        state.GradientState._reset_state()
    deepspeed_config = sys.modules.get("transformers.integrations.deepspeed")
    if deepspeed_config is not None:  # a ZeRO-3 TrainingArguments kept alive: later models would be partitioned
        deepspeed_config.unset_hf_deepspeed_config()
    if os.getcwd() != cwd:
        os.chdir(cwd)
    os.environ.clear()
    os.environ.update(environ)
    gc.collect()
    if not dist.is_initialized():  # the test destroyed it (on every rank alike); its store's keys are spent
        _init_process_group(backend, f"{store_path}-{next(_formed_again)}", rank, world_size, timeout)


#: How many times this rank formed its process group again (the same count on every rank: they ran the same tests).
_formed_again = itertools.count(1)
