"""What ReFT costs over the model it rides on: one GPU, side by side in one run, as ratios.

    python benchmarks/overhead.py --out benchmarks/results/overhead.jsonl     # Llama 1.2B-class, bf16
    python benchmarks/overhead.py --smoke                                       # CPU, tiny model

Providers: ``bare`` (the HF model alone), ``peft-lora`` (LoRA rank 8 on q and v at the same layers),
``pyvene`` (ReFT with stock pyvene/pyreft) and ``pyvene_dist`` (the same after ``pyvene_dist.patch()``).
Measured: a training step (forward, backward, AdamW step) and a no-grad forward; p20/p50/p80 over
``--steps`` after ``--warmup``; one JSONL row each. No assertion: the ratios are read from the rows.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import sys
import time
from pathlib import Path

import torch


def llama_1b_class(dtype, smoke: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    if smoke:
        config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2)
    else:  # Llama-3.2-1B's shape
        config = LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                             num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096,
                             tie_word_embeddings=True)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(dtype)


def timed(step, *, warmup: int, steps: int, device) -> list[float]:
    times = []
    for i in range(warmup + steps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= warmup:
            times.append(1000 * (time.perf_counter() - started))
    return sorted(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--positions", type=int, default=10)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results/overhead.jsonl")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--trace", help="GPU only: write host-device syncs and profiles of each ReFT step here")
    options = parser.parse_args(argv)
    if options.smoke:
        options.batch, options.seq_len, options.positions, options.steps, options.warmup = 2, 16, 4, 2, 1
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = llama_1b_class(dtype, options.smoke).to(device)
    layers = [i * model.config.num_hidden_layers // 4 + model.config.num_hidden_layers // 8 for i in range(4)]
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(model.config.vocab_size, (options.batch, options.seq_len), generator=generator).to(device)
    half = options.positions // 2
    positions = list(range(half)) + list(range(options.seq_len - (options.positions - half), options.seq_len))
    locations = torch.tensor([[positions] * options.batch] * len(layers), device=device)  # [interventions, batch, pos]
    rows = []

    def record(provider, measure, times, locations=None):
        rows.append({
            "provider": provider, "measure": measure, "locations": locations, "strategy": "single", "world_size": 1,
            "batch": options.batch, "tokens": options.batch * options.seq_len,
            **{f"p{q}_ms": times[min(len(times) - 1, int(q / 100 * len(times)))] for q in (20, 50, 80)},
            "tokens_per_s": options.batch * options.seq_len / (times[len(times) // 2] / 1000),
            "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "versions": {"torch": torch.__version__},
            "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        })
        print(f"{provider:>12} {measure:>8} {locations or '':>6}: p50 {rows[-1]['p50_ms']:.2f} ms", flush=True)

    measure = dict(warmup=options.warmup, steps=options.steps, device=device)
    trace = tracer(Path(options.trace)) if options.trace and device.type == "cuda" else None
    with torch.no_grad():
        record("bare", "forward", timed(lambda: model(input_ids=ids), **measure))
        if trace:
            trace("bare forward", lambda: model(input_ids=ids))
    _lora(model, ids, layers, record, measure, trace)
    for provider in ("pyvene", "pyvene_dist"):
        _reft(provider, model, ids, locations, layers, record, measure, trace)
    Path(options.out).parent.mkdir(parents=True, exist_ok=True)
    with open(options.out, "a") as out:
        for row in rows:
            out.write(json.dumps(row) + "\n")
    p50 = {(r["provider"], r["measure"]): r["p50_ms"] for r in rows if r["locations"] in (None, "list")}
    if ("peft-lora", "train") in p50:
        print(f"ReFT train / LoRA train: pyvene {p50[('pyvene', 'train')] / p50[('peft-lora', 'train')]:.3f}, "
              f"pyvene_dist {p50[('pyvene_dist', 'train')] / p50[('peft-lora', 'train')]:.3f}")
    print(f"ReFT forward / bare forward: pyvene {p50[('pyvene', 'forward')] / p50[('bare', 'forward')]:.3f}, "
          f"pyvene_dist {p50[('pyvene_dist', 'forward')] / p50[('bare', 'forward')]:.3f}")
    return 0


def _lora(model, ids, layers, record, measure, trace):
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        print("peft is not installed: no LoRA row", file=sys.stderr)
        return
    import copy

    lora = get_peft_model(copy.deepcopy(model), LoraConfig(r=8, target_modules=["q_proj", "v_proj"],
                                                            layers_to_transform=layers))
    optimizer = torch.optim.AdamW([p for p in lora.parameters() if p.requires_grad], lr=1e-4)

    mask = torch.ones_like(ids)  # as HF Trainer passes it, and pyreft's compute_loss does

    def step():
        lora(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    record("peft-lora", "train", timed(step, **measure))
    if trace:
        trace("peft-lora train", step)
    del lora, optimizer


def _reft(provider, model, ids, locations, layers, record, measure, trace):
    """ReFT steps as pyreft's ``ReftTrainer`` runs them: its own ``compute_loss`` on a collated batch
    (``intervention_locations`` on the GPU, batch first), then backward and AdamW. The no-grad forward
    calls pyvene with host lists, as inference code does; pyvene_dist also with a device tensor."""
    import pyreft

    import pyvene_dist

    context = pyvene_dist.patched() if provider == "pyvene_dist" else contextlib.nullcontext()
    with context:
        hidden = model.config.hidden_size
        config = pyreft.ReftConfig(representations=[{
            "layer": layer, "component": "block_output", "low_rank_dimension": 4,
            "intervention": pyreft.LoreftIntervention(embed_dim=hidden, low_rank_dimension=4, dtype=model.dtype),
        } for layer in layers])
        reft = pyreft.get_reft_model(model, config)
        reft.set_device(ids.device)
        optimizer = torch.optim.AdamW(reft.get_trainable_parameters(), lr=1e-4, weight_decay=0.0)
        trainer = object.__new__(pyreft.ReftTrainer)  # compute_loss reads nothing of the trainer
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids,
                 "intervention_locations": locations.permute(1, 0, 2).contiguous()}  # [batch, interventions, pos]

        def step():
            trainer.compute_loss(reft, batch).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        listed = {"sources->base": (None, locations.tolist())}
        forwards = {"list": lambda: reft({"input_ids": ids}, unit_locations=listed)}
        if provider == "pyvene_dist":
            forwards["tensor"] = lambda: reft({"input_ids": ids}, unit_locations={"sources->base": (None, locations)})
        reft.train()
        record(provider, "train", timed(step, **measure))
        if trace:
            trace(f"{provider} train", step)
        reft.eval()
        with torch.no_grad():
            for form, forward in forwards.items():
                record(provider, "forward", timed(forward, **measure), locations=form)
                if trace:
                    trace(f"{provider} forward ({form} locations)", forward)
        for intervention in reft.interventions.values():  # leave the shared base model as it was found
            intervention.to("cpu")


def tracer(path: Path):
    """A function that runs ``step`` once under CUDA's sync debug mode, then three times under the
    profiler, and appends every host-device sync (with its Python stack) and the top kernels to ``path``."""
    import traceback

    from pyvene_dist.testing.syncs import host_device_syncs

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
