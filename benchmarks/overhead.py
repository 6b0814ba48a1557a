"""What ReFT costs over the model it rides on: one GPU, side by side in one run, as ratios.

    python benchmarks/overhead.py --out benchmarks/results/overhead.jsonl     # Llama 1.2B-class, bf16
    python benchmarks/overhead.py --smoke                                       # CPU, tiny model

Providers: ``bare`` (the HF model alone), ``peft-lora`` (LoRA rank 8 on q and v at the same layers),
``pyvene`` (ReFT with stock pyvene/pyreft) and ``pyvene_dist`` (the same after ``pyvene_dist.patch()``);
on a GPU also ``pyvene_dist-eager-rotation``, its training step with LoReFT's rotation computed eagerly
(``patches.orthogonal``'s CUDA graphs off), which shows what the graphs save.
Measured: a training step (forward, backward, AdamW step) and a no-grad forward, each step timed on its
own (the GPU drained before and after); p20/p50/p80 over ``--steps``; one JSONL row each.

The compared measurements are interleaved: ``--rounds`` rounds, each timing a block of every provider
in turn (the order rotating), every block after one untimed step. LoRA and pyvene_dist's training
steps (and the bare and pyvene_dist forwards) thus see the same machine, clocks and neighbours, and a
drift during the run moves both. Stock pyvene runs before them, on its own (it needs pyvene unpatched).
No assertion: the ratios are read from the rows.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch

import pyvene_dist


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


def timed(step, *, warmup: int, steps: int, device, host: list | None = None) -> list[float]:
    """Milliseconds of ``steps`` calls of ``step`` after ``warmup`` untimed ones, each timed alone; the
    host's share (until ``step`` returns, before the GPU is drained) is appended to ``host``."""
    times = []
    for i in range(warmup + steps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        step()
        queued = time.perf_counter()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= warmup:
            times.append(1000 * (time.perf_counter() - started))
            if host is not None:
                host.append(1000 * (queued - started))
    return times


def interleaved(steps_by_name: dict, *, rounds: int, steps: int, device, host: dict) -> dict[str, list[float]]:
    """``timed`` for each of ``steps_by_name``, in ``rounds`` blocks of ``steps // rounds`` per name, the
    names taking turns (the first of one round is the last of the next); one untimed step opens a block.
    ``host[name]`` collects the host's share of each timed step."""
    names = list(steps_by_name)
    times = {name: [] for name in names}
    per_round = max(1, steps // rounds)
    for round_ in range(rounds):
        for name in names[round_ % len(names):] + names[:round_ % len(names)]:
            times[name] += timed(steps_by_name[name], warmup=1, steps=per_round, device=device, host=host[name])
    return times


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--positions", type=int, default=10)
    parser.add_argument("--steps", type=int, default=40, help="timed steps per measurement, over all rounds")
    parser.add_argument("--rounds", type=int, default=8, help="interleaved blocks per measurement")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results/overhead.jsonl")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--trace", help="GPU only: write host-device syncs and profiles of each ReFT step here")
    options = parser.parse_args(argv)
    if options.smoke:
        options.batch, options.seq_len, options.positions, options.steps, options.warmup = 2, 16, 4, 2, 1
        options.rounds = 2
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

    def record(provider, measure, times, locations=None, host=()):
        times, host = sorted(times), sorted(host)
        rows.append({
            "provider": provider, "measure": measure, "locations": locations, "strategy": "single", "world_size": 1,
            "batch": options.batch, "tokens": options.batch * options.seq_len, "rounds": options.rounds,
            **{f"p{q}_ms": times[min(len(times) - 1, int(q / 100 * len(times)))] for q in (20, 50, 80)},
            "host_p50_ms": host[len(host) // 2] if host else None,
            "tokens_per_s": options.batch * options.seq_len / (times[len(times) // 2] / 1000),
            "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "versions": {"torch": torch.__version__},
            "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        })
        print(f"{provider:>12} {measure:>8} {locations or '':>6}: p50 {rows[-1]['p50_ms']:.2f} ms"
              + (f", host {rows[-1]['host_p50_ms']:.2f} ms" if host else ""), flush=True)

    trace = tracer(Path(options.trace)) if options.trace and device.type == "cuda" else (lambda name, step: None)
    settle = dict(warmup=options.warmup, steps=0, device=device)
    rounds = dict(rounds=options.rounds, steps=options.steps, device=device)

    def bare_forward():
        with torch.no_grad():
            return model(input_ids=ids)

    lora_step = _lora_step(model, ids, layers)  # on a copy, made before pyvene wraps the model
    stock_reft, stock = _reft_steps(model, ids, locations, layers)  # pyvene unpatched, on its own
    for mode, (measure, form) in ((stock_reft.train, ("train", None)), (stock_reft.eval, ("forward", "list"))):
        mode()
        step, host = stock[measure if form is None else f"{measure}:{form}"], []
        record("pyvene", measure, timed(step, warmup=options.warmup, steps=options.steps, device=device, host=host),
               form, host)
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
                timed(step, **settle)
            host = {name: [] for name in steps}
            for (provider, form), times in interleaved(steps, **rounds, host=host).items():
                record(provider, measure, times, form, host[provider, form])
            for (provider, form), step in steps.items():
                trace(f"{provider} {measure}" + (f" ({form} locations)" if form else ""), step)
    Path(options.out).parent.mkdir(parents=True, exist_ok=True)
    with open(options.out, "a") as out:
        for row in rows:
            out.write(json.dumps(row) + "\n")
    p50 = {(r["provider"], r["measure"]): r["p50_ms"] for r in rows if r["locations"] in (None, "list")}
    if ("peft-lora", "train") in p50:
        print(f"ReFT train / LoRA train: pyvene {p50[('pyvene', 'train')] / p50[('peft-lora', 'train')]:.3f}, "
              f"pyvene_dist {p50[('pyvene_dist', 'train')] / p50[('peft-lora', 'train')]:.3f}"
              + (f", pyvene_dist with the rotation eager {eager / p50[('peft-lora', 'train')]:.3f}"
                 if (eager := p50.get(("pyvene_dist-eager-rotation", "train"))) else ""))
    print(f"ReFT forward / bare forward: pyvene {p50[('pyvene', 'forward')] / p50[('bare', 'forward')]:.3f}, "
          f"pyvene_dist {p50[('pyvene_dist', 'forward')] / p50[('bare', 'forward')]:.3f}")
    return 0


def _without_rotation_graphs(step):
    from pyvene_dist.patches import orthogonal

    def eager_step():
        graphs, orthogonal.GRAPHS = orthogonal.GRAPHS, False
        try:
            step()
        finally:
            orthogonal.GRAPHS = graphs  # as patch() set it (PYVENE_DIST_CUDA_GRAPHS=0 leaves it off)

    return eager_step


def _lora_step(model, ids, layers):
    """A LoRA training step on a copy of ``model``, or ``None`` without peft."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        print("peft is not installed: no LoRA row", file=sys.stderr)
        return None
    import copy

    lora = get_peft_model(copy.deepcopy(model), LoraConfig(r=8, target_modules=["q_proj", "v_proj"],
                                                            layers_to_transform=layers))
    optimizer = torch.optim.AdamW([p for p in lora.parameters() if p.requires_grad], lr=1e-4)
    mask = torch.ones_like(ids)  # as HF Trainer passes it, and pyreft's compute_loss does

    def step():
        lora(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def _reft_steps(model, ids, locations, layers, *, tensor_forward=False):
    """ReFT on ``model`` (under whatever patch state the caller is in) and its steps: ``{"train": step,
    "forward:list": no-grad forward[, "forward:tensor": ...]}``; the caller sets train or eval mode.
    The training step runs as pyreft's ``ReftTrainer`` does:
    its own ``compute_loss`` on a collated batch (``intervention_locations`` on the GPU, batch first),
    then backward and AdamW. The no-grad forward calls pyvene with host lists, as inference code does;
    ``tensor_forward`` adds one with a device tensor (pyvene_dist only)."""
    import pyreft

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

    def train():
        trainer.compute_loss(reft, batch).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

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
