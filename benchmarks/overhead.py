"""What ReFT costs over the model it rides on: one GPU, side by side in one run, as ratios.

    python benchmarks/overhead.py --out benchmarks/results/overhead.jsonl     # Llama 1.2B-class, bf16
    python benchmarks/overhead.py --model llama-2-7b --checkpointing --batch 1 --seq-len 4096 --no-stock
    python benchmarks/overhead.py --smoke                                       # CPU, tiny model

``--model``: a shape of ``testing.models.LLAMA_SHAPES`` (Llama-3.2-1B's by default, Llama-2-7B's), random
weights made on the GPU; ``--checkpointing``: non-reentrant activation checkpointing of every layer, for LoRA
and ReFT alike; ``--no-stock``: leave stock pyvene out (it takes as long as the rest); ``--profile FILE``: each
step's top operators by host and device time.

Providers: ``bare`` (the HF model alone), ``peft-lora`` (LoRA rank 8 on q and v at the same layers),
``pyvene`` (ReFT with stock pyvene/pyreft) and ``pyvene_dist`` (the same after ``pyvene_dist.patch()``);
on a GPU also ``pyvene_dist-eager-rotation``, its training step with LoReFT's rotation computed eagerly
(``fixes.orthogonal``'s CUDA graphs off), which shows what the graphs save.
Measured: a training step (forward, backward, AdamW step) and a no-grad forward, each step timed on its
own (the GPU drained before and after); p20/p50/p80, the median and the spread over ``--steps``, each
round's median, and the ratio to the reference (LoRA's step, the bare forward) by round; one JSONL row each.

The compared measurements are interleaved: ``--rounds`` rounds, each timing a block of every provider
in turn (the order rotating), every block after one untimed step. LoRA and pyvene_dist's training
steps (and the bare and pyvene_dist forwards) thus see the same machine, clocks and neighbours, and a
drift during the run moves both. Stock pyvene runs before them, on its own (it needs pyvene unpatched).
No assertion: the ratios are read from the rows.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import common  # noqa: E402

import pyvene_dist  # noqa: E402
from pyvene_dist.testing import models  # noqa: E402
from pyvene_dist.testing.syncs import host_device_syncs  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-3.2-1b", choices=sorted(models.LLAMA_SHAPES))
    parser.add_argument("--checkpointing", action="store_true", help="non-reentrant activation checkpointing")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--positions", type=int, default=10)
    parser.add_argument("--steps", type=int, default=40, help="timed steps per measurement, over all rounds")
    parser.add_argument("--rounds", type=int, default=8, help="interleaved blocks per measurement")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--no-stock", dest="stock", action="store_false", help="leave stock pyvene out")
    parser.add_argument("--out", default="benchmarks/results/overhead.jsonl")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--trace", help="GPU only: write host-device syncs and profiles of each ReFT step here")
    parser.add_argument("--profile", help="append every provider's top operators (host and device time) here")
    options = parser.parse_args(argv)
    if options.smoke:
        options.model, options.batch, options.seq_len, options.positions = "tiny", 2, 16, 4
        options.steps, options.warmup, options.rounds = 2, 1, 2
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = models.llama(options.model, dtype=dtype, device=device, checkpointing=options.checkpointing)
    layers = common.middle_layers(model)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(model.config.vocab_size, (options.batch, options.seq_len), generator=generator).to(device)
    locations = common.edge_locations(batch=options.batch, seq_len=options.seq_len, positions=options.positions,
                                      interventions=len(layers), device=device)
    rows = []
    meta = common.metadata(device, dtype)

    def record(provider, measure, times, locations=None, host=()):
        stats = common.summary(times, host)
        rows.append({
            "provider": provider, "measure": measure, "locations": locations, "strategy": "single", "world_size": 1,
            "model": options.model, "checkpointing": "non-reentrant" if options.checkpointing else "none",
            "batch": options.batch, "seq_len": options.seq_len, "tokens": options.batch * options.seq_len,
            "positions": options.positions, "layers": layers, "rounds": options.rounds, **stats,
            "tokens_per_s": options.batch * options.seq_len / (stats["median_ms"] / 1000),
            "peak_memory_gib": common.peak_memory_gib(device), **meta,
        })

    trace = tracer(Path(options.trace)) if options.trace and device.type == "cuda" else (lambda name, step: None)
    settle = dict(warmup=options.warmup, steps=0, device=device)
    rounds = dict(rounds=options.rounds, steps=options.steps, device=device)

    def bare_forward():
        with torch.no_grad():
            return model(input_ids=ids)

    lora = common.lora_model(model, layers)  # a copy, made before pyvene wraps the model
    lora_step = common.lora_step(lora, ids) if lora is not None else None
    if options.stock:  # pyvene unpatched, on its own
        stock_reft, stock = _reft_steps(model, ids, locations, layers)
        for mode, (measure, form) in ((stock_reft.train, ("train", None)), (stock_reft.eval, ("forward", "list"))):
            mode()
            step, host = stock[measure if form is None else f"{measure}:{form}"], []
            record("pyvene", measure, common.timed(step, warmup=options.warmup, steps=options.steps, device=device,
                                                   host=host), form, host)
            trace(f"pyvene {measure}" + (f" ({form} locations)" if form else ""), step)

    with pyvene_dist.patched():  # LoRA's and the bare model's steps do not touch what it wraps
        reft, fast = _reft_steps(model, ids, locations, layers, tensor_forward=True)
        trains = {**({("peft-lora", None): lora_step} if lora_step else {}), ("pyvene_dist", None): fast["train"]}
        if device.type == "cuda":  # the same step with LoReFT's rotation eager, as before its CUDA graphs
            trains["pyvene_dist-eager-rotation", None] = _without_rotation_graphs(fast["train"])
        forwards = {("bare", None): bare_forward, ("pyvene_dist", "list"): fast["forward:list"],
                    ("pyvene_dist", "tensor"): fast["forward:tensor"]}
        for measure, steps, mode in (("train", trains, reft.train), ("forward", forwards, reft.eval)):
            mode()
            for step in steps.values():
                common.timed(step, **settle)
            host = {}
            for (provider, form), times in common.interleaved(steps, **rounds, host=host).items():
                record(provider, measure, times, form, host[provider, form])
            for (provider, form), step in steps.items():
                trace(f"{provider} {measure}" + (f" ({form} locations)" if form else ""), step)
                if options.profile:
                    common.profile_top_ops(step, path=options.profile, device=device,
                                           label=f"{options.model} {options.batch}x{options.seq_len} {provider} "
                                                 f"{measure}" + (f" ({form} locations)" if form else ""))
    for measure, baseline in (("train", "peft-lora"), ("forward", "bare")):
        measured = [r for r in rows if r["measure"] == measure and r["locations"] in (None, "list")]
        common.compare(measured, baseline, {r["provider"] for r in measured} - {baseline})
    common.append_rows(options.out, rows)
    for row in rows:
        print(common.show(row) + (f" ({row['locations']} locations)" if row["locations"] else ""), flush=True)
    return 0


def _without_rotation_graphs(step):
    from pyvene_dist._registry import OPTIONS

    def eager_step():
        options = OPTIONS.current
        OPTIONS.current = options.replace(cuda_graphs=False)
        try:
            step()
        finally:
            OPTIONS.current = options  # as patch() set it (PYVENE_DIST_CUDA_GRAPHS=0 leaves it off)

    return eager_step


def _reft_steps(model, ids, locations, layers, *, tensor_forward=False):
    """ReFT on ``model`` (under whatever patch state the caller is in) and its steps: ``{"train": step,
    "forward:list": no-grad forward[, "forward:tensor": ...]}``; the caller sets train or eval mode.
    The training step runs as pyreft's ``ReftTrainer`` does:
    its own ``compute_loss`` on a collated batch (``intervention_locations`` on the GPU, batch first),
    then backward and AdamW. The no-grad forward calls pyvene with host lists, as inference code does;
    ``tensor_forward`` adds one with a device tensor (pyvene_dist only)."""
    reft = common.reft_model(model, layers)
    train = common.reft_step(reft, common.reft_batch(ids, locations))

    def forward(unit_locations):
        def step():
            with torch.no_grad():
                return reft({"input_ids": ids}, unit_locations=unit_locations)
        return step

    steps = {"train": train, "forward:list": forward({"sources->base": (None, locations.tolist())})}
    if tensor_forward:
        steps["forward:tensor"] = forward({"sources->base": (None, locations)})
    return reft, steps


def tracer(path: Path):
    """A function that runs ``step`` once under CUDA's sync debug mode, then three times under the
    profiler, and appends every host-device sync (with its Python stack) and the top kernels to ``path``."""

    def trace(name: str, step) -> None:
        syncs = ["".join(traceback.format_list(stack[-12:])) for stack in host_device_syncs(step)]
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiler:
            for _ in range(3):
                step()
            torch.cuda.synchronize()
        events = profiler.key_averages()
        gpu_ms = sum(e.self_device_time_total for e in events) / 3 / 1000
        launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernelEx")) / 3
        operators = sum(e.count for e in events if e.key.startswith("aten::")) / 3
        summary = (f"{name}: {len(syncs)} host-device syncs per step; per step under the profiler: "
                   f"GPU busy {gpu_ms:.1f} ms, {launches:.0f} kernel launches, {operators:.0f} aten calls")
        with open(path, "a") as out:
            out.write(f"=== {summary}\n")
            for sync in syncs[:12]:
                out.write(sync + "\n")
            if "train" in name:
                table = events.table(sort_by="device_time_total", row_limit=25)
                cpu = events.table(sort_by="self_cpu_time_total", row_limit=25)
                out.write(f"--- {name}: profile of 3 steps, by GPU time\n{table}\n--- by host time\n{cpu}\n")
        print(summary, flush=True)

    return trace


if __name__ == "__main__":
    sys.exit(main())
