"""ReFT against LoRA under FSDP2 and ZeRO-3 on one GPU: the sharded strategies' own per-layer machinery,
with the ReFT step and the LoRA step side by side in one process, as ratios.

    python benchmarks/sharded.py --out benchmarks/results/sharded.jsonl      # Llama 1B-class, bf16, 1 GPU
    python benchmarks/sharded.py --smoke                                      # CPU (gloo), tiny model

One spawned process, a process group of one (``pyvene_dist.testing.spawn``, world size 1). For each
strategy, ReFT (pyreft's LoReFT at ``--interventions`` layers, after ``pyvene_dist.patch()``, its step as
``ReftTrainer.compute_loss`` runs it) and LoRA (peft, rank 8 on q and v of the same layers) are each
prepared as the strategy's parity runs prepare a model (``pyvene_dist.testing.STRATEGIES``: FSDP2 is
``fully_shard`` on every decoder layer and the root, the interventions kept whole; ZeRO-3 is
``deepspeed.initialize``, bf16 on a GPU), and their training steps take turns in ``--rounds`` rounds.
Rows: one per (strategy, provider), the ReFT one with its ratio to LoRA's (median, and each round's) and
its host time per step over LoRA's (``host_minus_baseline_ms``). ``--profile FILE``: each step's top
operators by host and device time.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import sys
import tempfile
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import common  # noqa: E402

from pyvene_dist.testing import models  # noqa: E402


def rank_main(options: dict, out: str) -> None:
    import pyvene_dist
    from pyvene_dist.testing import ParityCase

    pyvene_dist.patch()
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    base = models.llama(options["model"], dtype=dtype, device=device)
    layers = common.middle_layers(base, options["interventions"])
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(base.config.vocab_size, (options["batch"], options["seq_len"]), generator=generator).to(device)
    locations = common.edge_locations(batch=options["batch"], seq_len=options["seq_len"],
                                      positions=options["positions"], interventions=len(layers), device=device)
    batch = common.reft_batch(ids, locations)
    # What the strategies' prepare() reads (the models are the benchmark's own): one micro-batch of the benchmark's
    # size per step, its dtype, and the optimizer's settings below.
    case = ParityCase(batch_size=options["batch"], dtype=str(dtype).removeprefix("torch."), accumulation=1,
                      lr=1e-4, weight_decay=0.0)
    rows = []
    for name in options["strategies"]:
        try:
            rows += _measure(name, base, layers, ids, batch, case, options, device, dtype)
        except Exception as error:  # noqa: BLE001 -- one strategy's failure is a row; the others still run
            traceback.print_exc()
            rows.append({"provider": "pyvene_dist", "measure": "train", "strategy": name, "world_size": 1,
                         "error": f"{type(error).__name__}: {error}"[:2000], **common.metadata(device, dtype)})
        if device.type == "cuda":
            torch.cuda.empty_cache()
    Path(out).write_text(json.dumps(rows))


def _measure(name, base, layers, ids, batch, case, options, device, dtype) -> list[dict]:
    """The ReFT and LoRA steps under strategy ``name``, interleaved: their rows."""
    from pyvene_dist.testing import STRATEGIES

    torch.manual_seed(1)
    reft = common.reft_model(copy.deepcopy(base), layers)
    lora = common.lora_model(base, layers, fp32_adapters=False)  # the model's dtype, as the interventions'
    steps = {}
    for provider, model in (("peft-lora", lora), ("pyvene_dist", reft)):
        if model is None:
            continue
        strategy = STRATEGIES[name](device)
        trainable = [p for p in model.parameters() if p.requires_grad]
        if name.startswith("zero"):
            engine, optimizer = strategy.prepare(model, torch.optim.AdamW(trainable, lr=case.lr), case)
            step = functools.partial(strategy.step, optimizer, engine)  # the engine's boundary step
            hooks = dict(call=engine, backward=strategy.backward, step=step)
        else:  # FSDP2: prepare makes the optimizer again, over the sharded parameters
            _, optimizer = strategy.prepare(model, None, case)
            hooks = dict(call=model, optimizer=optimizer)
        if provider == "pyvene_dist":
            steps[provider] = common.reft_step(reft, batch, hooks.get("optimizer"), call=hooks["call"],
                                               backward=hooks.get("backward"), step=hooks.get("step"))
        else:
            steps[provider] = common.lora_step(hooks["call"], ids, hooks.get("optimizer"),
                                               backward=hooks.get("backward"), step=hooks.get("step"))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for step in steps.values():
        common.timed(step, warmup=options["warmup"], steps=0, device=device)
    host, cpu = {}, {}
    times = common.interleaved(steps, rounds=options["rounds"], steps=options["steps"], device=device, host=host,
                               cpu=cpu)
    meta = common.metadata(device, dtype)
    found = [{"provider": provider, "measure": "train", "strategy": name, "world_size": 1,
              "model": options["model"], "batch": options["batch"], "seq_len": options["seq_len"],
              "tokens": options["batch"] * options["seq_len"], "positions": options["positions"],
              "layers": layers, "rounds": options["rounds"],
              **common.summary(times[provider], host[provider], cpu[provider]),
              "peak_memory_gib": common.peak_memory_gib(device), **meta} for provider in steps]
    common.compare(found, "peft-lora", ("pyvene_dist",))
    for row in found:
        print(common.show(row), flush=True)
    if options["profile"]:
        for provider, step in steps.items():
            common.profile_top_ops(step, path=options["profile"], label=f"{provider} {name} x1 train",
                                   device=device)
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategies", default="fsdp2,zero3")
    common.add_step_arguments(parser)
    parser.add_argument("--out", default="benchmarks/results/sharded.jsonl")
    options = parser.parse_args(argv)
    if options.smoke:
        common.smoke_sizes(options, interventions=2, warmup=1)
    strategies = options.strategies.split(",")
    if not set(strategies) <= {"fsdp2", "zero3"}:
        parser.error(f"--strategies {options.strategies!r}: expected fsdp2 and/or zero3")
    from pyvene_dist.testing import spawn

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    settings = {**vars(options), "strategies": strategies}
    with tempfile.TemporaryDirectory() as workdir:
        out = os.path.join(workdir, "rows.json")
        outcome = spawn(rank_main, world_size=1, backend=backend, workdir=workdir, args=(settings, out),
                        timeout=900)
        if outcome.failed or not os.path.exists(out):
            print(f"sharded run failed:\n{outcome.report()}", file=sys.stderr)
            return 1
        rows = json.loads(Path(out).read_text())
    common.append_rows(options.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
