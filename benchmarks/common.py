"""What the benchmark scripts share: Llama models built on the device from configs, LoRA and ReFT training
steps, steps timed and interleaved, rows with their metadata, and profiles.

Every row carries the same metadata (``metadata``): the GPU (or ``cpu``) and the machine (how many GPUs),
package versions, the commit (``git rev-parse HEAD``, or ``PYVENE_DIST_COMMIT`` where the tree has no
``.git``, as on the device machines), a run id shared by the rows of one invocation, the dtype, the date
and the time. ``summary`` gives p20/p50/p80, the median, the spread (p80 - p20 over
the median) and each interleaved round's median; ``compare`` adds a row's ratio to its baseline's, round by
round, so that a ratio's median and spread are read from rows timed side by side.

A script that imports this module has its objects left out of the interpreter's collections at its exit
(``gc.freeze``, at exit): those walk every object, about a million with torch, transformers and pyvene imported,
1.7 s of a 2-core machine after the rows are written; 0.2 s frozen.
"""

from __future__ import annotations

import atexit
import copy
import datetime
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import uuid
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch

from pyvene_dist.testing import models

ROOT = Path(__file__).resolve().parents[1]
atexit.register(gc.freeze)

def middle_layers(model, count: int = 4) -> list[int]:
    """``count`` layers spread over the model (the intervened ones, and LoRA's)."""
    layers = model.config.num_hidden_layers
    return [i * layers // count + layers // (2 * count) for i in range(count)]


def edge_locations(*, batch: int, seq_len: int, positions: int, interventions: int, device) -> torch.Tensor:
    """pyvene's layout ``[interventions, batch, positions]``: the first and last positions, as pyreft's
    ``first_n``/``last_n`` locations."""
    half = positions // 2
    chosen = list(range(half)) + list(range(seq_len - (positions - half), seq_len))
    return torch.tensor([[chosen] * batch] * interventions, device=device)


def lora_model(model, layers, *, fp32_adapters: bool = True):
    """peft LoRA rank 8 on q and v of ``layers``, on a copy of ``model``; ``None`` without peft.
    ``fp32_adapters``: peft's default, float32 adapters on a bf16 model; off, the model's dtype (FSDP2 wants
    one dtype per unit)."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        print("peft is not installed: no LoRA row", file=sys.stderr)
        return None
    return get_peft_model(copy.deepcopy(model), LoraConfig(r=8, target_modules=["q_proj", "v_proj"],
                                                            layers_to_transform=layers),
                          autocast_adapter_dtype=fp32_adapters)


def lora_step(lora, ids, optimizer=None, *, backward=None, step=None):
    """A LoRA training step: forward with labels (and an all-ones mask, as HF Trainer passes it and
    pyreft's ``compute_loss`` does), backward, AdamW. ``backward``/``step`` replace ``loss.backward()`` and
    the optimizer step (a DeepSpeed engine's)."""
    mask = torch.ones_like(ids)
    if optimizer is None and step is None:
        optimizer = torch.optim.AdamW([p for p in lora.parameters() if p.requires_grad], lr=1e-4)
    return _training_step(lambda: lora(input_ids=ids, attention_mask=mask, labels=ids).loss, optimizer,
                          backward, step)


def _training_step(loss, optimizer, backward, step):
    """``loss()``, then ``backward(loss)`` (or ``loss.backward()``), then ``step()`` (or the optimizer's)."""
    def train():
        value = loss()
        backward(value) if backward else value.backward()
        if step:
            step()
        else:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    return train


def reft_model(model, layers):
    """``testing.models.reft_model``'s LoReFT rank 4 at ``block_output`` of ``layers`` on ``model`` (under
    whatever patch state the caller is in), in the model's dtype and on its device, the interventions drawn
    from seed 1: the same for every provider."""
    reft = models.reft_model(model, layers=layers, dtype=model.dtype, seed=1)
    reft.set_device(model.device)
    return reft


def reft_batch(ids, locations) -> dict:
    """A batch as pyreft's collator makes it: locations on the device, batch first."""
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids,
            "intervention_locations": locations.permute(1, 0, 2).contiguous()}


def reft_step(reft, batch, optimizer=None, *, call=None, backward=None, step=None):
    """A ReFT training step as pyreft's ``ReftTrainer`` runs it: its own ``compute_loss`` on a collated
    batch, backward, AdamW. ``call`` is what ``compute_loss`` calls (a compiled or engine-wrapped ``reft``);
    ``backward``/``step`` as in ``lora_step``."""
    import pyreft

    if optimizer is None and step is None:
        optimizer = torch.optim.AdamW(reft.get_trainable_parameters(), lr=1e-4, weight_decay=0.0)
    trainer = object.__new__(pyreft.ReftTrainer)  # compute_loss reads nothing of the trainer
    target = reft if call is None else call
    return _training_step(lambda: trainer.compute_loss(target, batch), optimizer, backward, step)


def add_step_arguments(parser, *, model: str = "llama-3.2-1b") -> None:
    """The options of a script that times training steps: model shape, batch, locations, rounds."""
    parser.add_argument("--model", default=model, choices=sorted(models.LLAMA_SHAPES))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--positions", type=int, default=10)
    parser.add_argument("--interventions", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per provider, over all rounds")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--profile", help="append each step's top operators (host and device time) here")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny model, 2 timed steps")


def smoke_sizes(options, *, interventions: int, warmup: int) -> None:
    """``--smoke``'s sizes: the tiny model, 2 x 16 tokens, 2 steps in 2 rounds."""
    options.model, options.batch, options.seq_len, options.positions = "tiny", 2, 16, 4
    options.interventions, options.steps, options.rounds, options.warmup = interventions, 2, 2, warmup


# --- timing -----------------------------------------------------------------------------------------------

def drain(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(step, *, warmup: int, steps: int, device, host: list | None = None,
          cpu: list | None = None) -> list[float]:
    """Milliseconds of ``steps`` calls of ``step`` after ``warmup`` untimed ones, each timed alone; the
    host's share (until ``step`` returns, before the GPU is drained) is appended to ``host``, and the CPU
    time the process spent in the call (all its threads, ``time.process_time``) to ``cpu``. Where the host
    sets the pace, CPU time is the work done: unlike wall time, it does not count the time the process
    waited for a core another process held."""
    times = []
    for i in range(warmup + steps):
        drain(device)
        started, started_cpu = time.perf_counter(), time.process_time()
        returned = step()
        queued = time.perf_counter()
        if callable(returned):  # lambda: lora_step(...) builds a step and runs none: microseconds, not a step
            raise TypeError(f"timed: step returned {returned!r}, a function; pass the step itself "
                            "(lora_step and reft_step return one), not a function that builds it")
        drain(device)
        if i >= warmup:
            times.append(1000 * (time.perf_counter() - started))
            if host is not None:
                host.append(1000 * (queued - started))
            if cpu is not None:
                cpu.append(1000 * (time.process_time() - started_cpu))
    return times


def interleaved(steps_by_name: dict, *, rounds: int, steps: int, device, host: dict,
                warmup: int = 1, cpu: dict | None = None) -> dict[str, list[list[float]]]:
    """``timed`` for each of ``steps_by_name``, in ``rounds`` blocks of ``steps // rounds`` per name, the
    names taking turns (the first of one round is the last of the next); ``warmup`` untimed steps open a
    block. Returns each name's times, one list per round; ``host[name]`` collects the host's share of each,
    and ``cpu[name]``, where given, the CPU time of each (one list per round)."""
    names = list(steps_by_name)
    times = {name: [] for name in names}
    per_round = max(1, steps // rounds)
    for round_ in range(rounds):
        for name in names[round_ % len(names):] + names[:round_ % len(names)]:
            spent = None if cpu is None else []
            times[name].append(timed(steps_by_name[name], warmup=warmup, steps=per_round, device=device,
                                     host=host.setdefault(name, []), cpu=spent))
            if cpu is not None:
                cpu.setdefault(name, []).append(spent)
    return times


def summary(times, host=(), cpu=None) -> dict:
    """p20/p50/p80 and the median of ``times`` (ms; a flat list, or one list per interleaved round), the
    spread (p80 - p20, as a share of the median), each round's median, and the host's median share; with
    ``cpu`` (``interleaved``'s, one list per round), the CPU time's median and each round's."""
    per_round = times if times and isinstance(times[0], list) else None
    flat = sorted(t for block in per_round for t in block) if per_round else sorted(times)
    at = lambda q: flat[min(len(flat) - 1, int(q / 100 * len(flat)))]  # noqa: E731
    median = statistics.median(flat)
    return {
        **{f"p{q}_ms": at(q) for q in (20, 50, 80)},
        "median_ms": median,
        "spread": (at(80) - at(20)) / median,
        "steps_timed": len(flat),
        "round_medians_ms": [statistics.median(block) for block in per_round] if per_round else None,
        "host_p50_ms": statistics.median(host) if host else None,
        **({"cpu_p50_ms": statistics.median(t for block in cpu for t in block),
            "cpu_round_medians_ms": [statistics.median(block) for block in cpu]} if cpu else {}),
    }


def compare(rows: list[dict], baseline: str, providers) -> None:
    """Name ``baseline`` (a provider) on the rows of ``providers`` of the same measure, strategy and shape,
    and add the ratio of medians, the median, min and max of the round-by-round ratios (the spread), the
    host time per step over the baseline's, and where both carry CPU times, the same ratios of those."""
    def key(row):
        return row.get("measure"), row.get("strategy"), row.get("batch"), row.get("seq_len")

    bases = {key(r): r for r in rows if r["provider"] == baseline and "median_ms" in r}
    for row in rows:
        base = bases.get(key(row))
        if base is None or row["provider"] not in providers or "median_ms" not in row:
            continue
        row["baseline"] = baseline
        row["ratio"] = row["median_ms"] / base["median_ms"]
        if row.get("host_p50_ms") is not None and base.get("host_p50_ms") is not None:
            row["host_minus_baseline_ms"] = row["host_p50_ms"] - base["host_p50_ms"]
        ratios = _round_ratios(row, base, "round_medians_ms")
        if ratios:
            row["ratio_rounds"] = ratios
            row.update(_spread("ratio", ratios))
        ratios = _round_ratios(row, base, "cpu_round_medians_ms")
        if ratios:
            row["cpu_ratio"] = row["cpu_p50_ms"] / base["cpu_p50_ms"]
            row.update(_spread("cpu_ratio", ratios))


def _round_ratios(row: dict, base: dict, field: str) -> list | None:
    """``row``'s per-round ``field`` over ``base``'s, round by round; None where they do not pair up."""
    mine, theirs = row.get(field), base.get(field)
    if mine and theirs and len(mine) == len(theirs):
        return [a / b for a, b in zip(mine, theirs)]
    return None


def _spread(name: str, ratios: list) -> dict:
    return {f"{name}_median": statistics.median(ratios), f"{name}_min": min(ratios), f"{name}_max": max(ratios)}


# --- rows -------------------------------------------------------------------------------------------------

def commit() -> str | None:
    """``PYVENE_DIST_COMMIT``, else ``git rev-parse HEAD`` (``+dirty`` when tracked files differ), else None."""
    if os.environ.get("PYVENE_DIST_COMMIT"):
        return os.environ["PYVENE_DIST_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def versions() -> dict:
    found = {"torch": torch.__version__}
    for name in ("transformers", "pyvene", "pyreft", "peft", "deepspeed", "accelerate", "pyvene_dist"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            pass
    return found


def gpu_name(device) -> str:
    device = torch.device(device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"


def machine(device) -> str:
    """What ran the rows: ``2 x NVIDIA H200`` (the GPUs this process sees), or the CPU and its core count."""
    device = torch.device(device)
    if device.type == "cuda":
        return f"{torch.cuda.device_count()} x {gpu_name(device)}"
    return f"{gpu_name(device)}, {os.cpu_count()} cores"


def run_id() -> str:
    """One id for every row of one invocation: ``PYVENE_DIST_RUN_ID`` when set (``run_h200.sh`` sets one for
    all its parts), else made here and set in the environment, so that the processes this one starts (the
    ranks of a scaling run) write the same id."""
    if not os.environ.get("PYVENE_DIST_RUN_ID"):
        now = datetime.datetime.now(datetime.timezone.utc)
        os.environ["PYVENE_DIST_RUN_ID"] = f"{now:%Y%m%dT%H%M%SZ}-{uuid.uuid4().hex[:6]}"
    return os.environ["PYVENE_DIST_RUN_ID"]


def metadata(device, dtype) -> dict:
    now = datetime.datetime.now(datetime.timezone.utc)
    return {"gpu": gpu_name(device), "machine": machine(device), "dtype": str(dtype).removeprefix("torch."),
            "versions": versions(), "commit": commit(), "run_id": run_id(), "date": now.date().isoformat(),
            "time": now.isoformat(timespec="seconds"), **host_load()}


def host_load() -> dict:
    """The host's load when asked: the 1-minute load average against the cores this process may use. Other
    processes' load is what makes host-bound rounds of one run disagree."""
    return {"load_1min": round(os.getloadavg()[0], 2), "cores": len(os.sched_getaffinity(0))}


def peak_memory_gib(device) -> float | None:
    device = torch.device(device)
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def append_rows(path, rows) -> None:
    """Append ``rows`` to the JSONL file ``path`` (its folder made)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as out:
        for row in rows:
            out.write(json.dumps(row) + "\n")


def show(row: dict) -> str:
    """One line for the log: provider, measure, median and spread, ratio to the baseline."""
    text = (f"{row['provider']:>26} {row.get('measure', ''):>8} {row.get('strategy', ''):>6}: "
            f"median {row['median_ms']:.2f} ms (p20-p80 {row['p20_ms']:.2f}-{row['p80_ms']:.2f})")
    if row.get("host_p50_ms") is not None:
        text += f", host {row['host_p50_ms']:.2f} ms"
    if "ratio" in row:
        text += f"; {row['ratio']:.3f} x {row['baseline']}"
        if "ratio_min" in row:
            text += f" (rounds {row['ratio_min']:.3f}-{row['ratio_max']:.3f})"
        if "cpu_ratio_median" in row:
            text += f"; CPU time {row['cpu_ratio_median']:.3f} x (rounds {row['cpu_ratio_min']:.3f}-" \
                    f"{row['cpu_ratio_max']:.3f})"
    return text


# --- profiles ---------------------------------------------------------------------------------------------

def profile_top_ops(step, *, path, label: str, device, steps: int = 3, rows: int = 25) -> None:
    """Append to ``path`` the top operators of ``steps`` calls of ``step`` under torch.profiler, by host
    time and by device time: where the time goes when a goal is missed."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.device(device).type == "cuda" else [])
    with profile(activities=activities) as profiler:
        for _ in range(steps):
            step()
        drain(torch.device(device))
    events = profiler.key_averages()
    device_ms = sum(e.self_device_time_total for e in events) / steps / 1000
    host_ms = sum(e.self_cpu_time_total for e in events) / steps / 1000
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as out:
        out.write(f"=== {label}: per step under the profiler, device busy {device_ms:.1f} ms, host (self) "
                  f"{host_ms:.1f} ms; {steps} steps\n--- by host time\n"
                  f"{events.table(sort_by='self_cpu_time_total', row_limit=rows)}\n")
        if device_ms:
            out.write(f"--- by device time\n{events.table(sort_by='self_device_time_total', row_limit=rows)}\n")
