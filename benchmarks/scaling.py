"""Throughput and memory of ReFT training over strategies and world sizes; one JSONL row per run.

    python benchmarks/scaling.py --strategies ddp,zero2,zero3,zero3-offload --world-sizes 1,2 \
        --model llama-1b --batch 2 --seq-len 512 --out benchmarks/results/scaling.jsonl
    python benchmarks/scaling.py --smoke          # CPU, tiny model, under two minutes
    python benchmarks/scaling.py --strategies single --world-sizes 1 --seq-len 2048 \
        --checkpointing none,non-reentrant       # what activation checkpointing saves on one GPU

Each (strategy, world size) runs in its own world of spawned processes (pyvene_dist.testing.spawn):
``--warmup`` untimed steps, ``--steps`` steps timed one by one (the GPU drained before and after each:
p20/p50/p80 latency, and ``host_p50_ms``, the time until the host has queued a step), then ``--steps``
more timed as one window with no drain between them, as a training loop runs: ``tokens_per_s`` is
all ranks' tokens over that window. Rows also hold per-GPU batch, tokens per step, peak memory on rank 0,
parameter bytes held by rank 0, GPU, versions, time. No assertion: speed is read from the rows, as
ratios within one run.

``--profile DIR``: after the window, every rank profiles a few more steps (each timed on its own) and
writes its operators by host time to ``DIR/<strategy>-x<world size>-rank<rank>.txt``: where a rank's
host time goes, and whether it waits for another rank.

Strategy ``independent`` is a diagnostic, not a parallel strategy: every process trains its own copy on
its own GPU with no communication at all. Against world size 1 it shows what sharing one host costs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import common  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Run:
    strategy: str
    world_size: int
    model: str
    batch: int  # per GPU (per process)
    seq_len: int
    steps: int
    warmup: int
    dtype: str
    checkpointing: str = "none"
    component: str = "block_output"
    attention: str = "sdpa"
    hidden: int | None = None  # None: the model's own (llama-1b: 2048; 3072 with 26 layers is 2.8B parameters)
    layers: int | None = None
    zero: str = ""  # JSON merged into DeepSpeed's zero_optimization


def rank_main(run: Run, out: str, profile: str = "") -> None:
    import torch.distributed as dist

    import pyvene_dist
    from pyvene_dist.optim import param_groups
    from pyvene_dist.testing import ParityCase, STRATEGIES
    from pyvene_dist.testing.runners import DeepSpeed
    from pyvene_dist.testing.training import parameter_bytes, summed_loss

    pyvene_dist.patch()
    torch.set_num_threads(1)  # as torchrun sets OMP_NUM_THREADS=1: ranks must not fight over host cores
    independent = run.strategy == "independent"
    ranks_in_batch = 1 if independent else run.world_size
    case = ParityCase(model=run.model, hidden_size=run.hidden, num_layers=run.layers,
                      batch_size=run.batch * ranks_in_batch, seq_len=run.seq_len,
                      steps=run.warmup + 2 * run.steps + (PROFILED_STEPS if profile else 0),
                      dtype=run.dtype, component=run.component,
                      layers=(2, 8) if run.model == "llama-1b" else (0, 1),
                      checkpointing=None if run.checkpointing == "none" else run.checkpointing,
                      accumulation=1, trainable_head=False)  # one micro-batch per step, the interventions alone
    strategy = STRATEGIES["single" if independent else run.strategy]()
    if isinstance(strategy, DeepSpeed) and run.zero:
        strategy.zero.update(json.loads(run.zero))
    with torch.device(strategy.device):  # random weights made where they are used: faster than on the host
        model = case.build().to(strategy.device)
    model.model.config._attn_implementation = run.attention  # read at every forward
    model.train()
    optimizer = torch.optim.AdamW(param_groups(model, 0.0), lr=1e-4)
    wrapped, optimizer = strategy.prepare(model, optimizer, case)
    held = parameter_bytes(model)
    cuda = strategy.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(strategy.device)
    drain = torch.cuda.synchronize if cuda else (lambda: None)

    def train_step(batch) -> None:
        strategy.backward(summed_loss(wrapped, strategy.shard(batch), strategy.device))
        strategy.step(optimizer, wrapped)

    times, host = [], []
    batches = iter(case.batches())
    for step in range(run.warmup + run.steps):
        batch = next(batches)
        drain()
        started = time.perf_counter()
        train_step(batch)
        queued = time.perf_counter()
        drain()
        if step >= run.warmup:
            times.append(time.perf_counter() - started)
            host.append(queued - started)
    window = [next(batches) for _ in range(run.steps)]
    dist.barrier()
    drain()
    started = time.perf_counter()
    for batch in window:  # as a training loop runs: the host queues ahead, nothing waits between steps
        train_step(batch)
    drain()
    window_s = time.perf_counter() - started
    if profile:
        _profile(train_step, [next(batches) for _ in range(PROFILED_STEPS)], drain,
                 Path(profile) / f"{run.strategy}-x{run.world_size}-rank{dist.get_rank()}.txt")
    if dist.get_rank() == 0:
        tokens_per_step = run.batch * run.world_size * case.seq_len  # all ranks
        row = {
            **dataclasses.asdict(run),
            "provider": "pyvene_dist",
            "tokens_per_step": tokens_per_step,
            **common.summary([1000 * t for t in times], [1000 * h for h in host]),
            "window_ms_per_step": 1000 * window_s / len(window),
            "tokens_per_s": tokens_per_step * len(window) / window_s,
            "peak_memory_gib": torch.cuda.max_memory_allocated(strategy.device) / 2**30 if cuda else None,
            "parameter_gib": held / 2**30,
            **common.metadata(strategy.device, case.torch_dtype),
        }
        if getattr(strategy, "engine", None) is not None:  # what DeepSpeed ran with, knobs included
            row["zero_optimization"] = strategy.engine.config["zero_optimization"]
        Path(out).write_text(json.dumps(row))


PROFILED_STEPS = 3


def _profile(train_step, batches, drain, path: Path) -> None:
    """Each rank's host time by operator over a few steps, each timed on its own (``--profile``)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as profiler:
        for batch in batches:
            drain()
            train_step(batch)
            drain()
    events = profiler.key_averages()
    path.write_text(f"{len(batches)} steps\n" + events.table(sort_by="self_cpu_time_total", row_limit=40))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategies", default="ddp,fsdp2,zero2,zero3",
                        help="names of pyvene_dist.testing.STRATEGIES, or independent (see above)")
    parser.add_argument("--world-sizes", default="1,2")
    parser.add_argument("--model", default="llama-1b")
    parser.add_argument("--batch", type=int, default=2, help="per GPU")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--checkpointing", default="none", help="comma-separated: none, reentrant, non-reentrant")
    parser.add_argument("--component", default="block_output")
    parser.add_argument("--hidden", type=int, help="hidden size (llama-1b: 2048)")
    parser.add_argument("--layers", type=int, help="number of layers (llama-1b: 22)")
    parser.add_argument("--attention", default="sdpa", help="eager, sdpa, ... (the parity tests use eager)")
    parser.add_argument("--zero", default="", help='JSON merged into zero_optimization, e.g. '
                        '\'{"stage3_max_live_parameters": 5e7, "stage3_max_reuse_distance": 0}\'')
    parser.add_argument("--out", default="benchmarks/results/scaling.jsonl")
    parser.add_argument("--profile", help="a folder: each rank writes its profile of a few more steps there")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny model, few steps")
    options = parser.parse_args(argv)
    if options.smoke:
        options.model, options.seq_len, options.steps, options.warmup, options.batch = "llama", 16, 2, 1, 2
    from pyvene_dist.testing import spawn

    common.run_id()  # set in the environment now: the spawned ranks' rows share it
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    Path(options.out).parent.mkdir(parents=True, exist_ok=True)
    if options.profile:
        Path(options.profile).mkdir(parents=True, exist_ok=True)
    plan = [(s, int(w), c) for s in options.strategies.split(",") for w in options.world_sizes.split(",")
            for c in options.checkpointing.split(",")]
    for strategy, world_size, checkpointing in plan:
        if backend == "nccl" and world_size > torch.cuda.device_count():
            print(f"skip {strategy} x{world_size}: needs {world_size} GPUs", file=sys.stderr)
            continue
        run = Run(strategy, world_size, options.model, options.batch, options.seq_len, options.steps,
                  options.warmup, options.dtype, checkpointing, options.component, options.attention,
                  options.hidden, options.layers, options.zero if strategy.startswith("zero") else "")
        with tempfile.TemporaryDirectory() as workdir:
            out = os.path.join(workdir, "row.json")
            outcome = spawn(rank_main, world_size=world_size, backend=backend, workdir=workdir,
                            args=(run, out, options.profile or ""), timeout=900)
            if outcome.failed or not os.path.exists(out):
                print(f"{strategy} x{world_size} failed:\n{outcome.report()}", file=sys.stderr)
                continue
            row = Path(out).read_text()
        with open(options.out, "a") as jsonl:
            jsonl.write(row + "\n")
        shown = json.loads(row)
        print(f"{strategy:>14} x{world_size} checkpointing={checkpointing} zero={run.zero or '-'}: "
              f"p50 {shown['p50_ms']:.1f} ms, {shown['tokens_per_s']:.0f} tok/s, peak {shown['peak_memory_gib']} GiB, "
              f"parameters {shown['parameter_gib']:.3f} GiB", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
