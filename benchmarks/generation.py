"""Generation with a ReFT intervention on every generated token, against the bare model's generation:
one GPU, KV cache on, all in one process, interleaved round by round, as time per token.

    python benchmarks/generation.py --out benchmarks/results/generation.jsonl   # Llama 1B-class, bf16, 1,024 tokens
    python benchmarks/generation.py --smoke                                      # CPU, tiny model, 8 tokens

``reft_model.generate(prompt, unit_locations=None, intervene_on_prompt=False, ...)`` is pyvene's
every-token mode: its setter hooks skip the prompt's forward and intervene at position 0 of every later
one, which with the KV cache is the token just generated. Every generation makes exactly
``--new-tokens`` tokens (``min_new_tokens``, greedy). Columns, each timed in every round:

- ``bare``: ``model.generate`` on the same weights, **unpatched** (no ``patch()``, no hooks on the model);
- ``bare-static``: the same with ``cache_implementation="static"``, whose decoding step transformers
  compiles (on CUDA by default, CUDA graphs included; on the CPU only with ``--compile-backend``, which
  passes ``CompileConfig(backend=..., _compile_all_devices=True)``);
- ``pyvene``: stock pyvene/pyreft, unpatched, eager (``--providers``);
- ``pyvene_dist``: after ``pyvene_dist.patch()``, eager (``--providers``);
- ``pyvene_dist-static``: pyvene_dist with the static cache, in its own compiled decoding step
  (``fixes.fast_path.compiled_decoding``; ``--no-static`` leaves both static columns out).

A round is: ``unpatch()``, then the unpatched columns, then ``patch()`` and the patched ones, each block
opened by one untimed generation (after a ``patch()`` the plan is rebuilt, and its compiled step compiled
again: untimed). The order inside each group turns from round to round. Rows carry each column's
p20/p50/p80, median, spread, each round's median; the ratios are the **median of the round ratios**
(``ratio_median``, with ``ratio_min``/``ratio_max``): ``pyvene`` and ``pyvene_dist`` and ``bare-static``
to ``bare``, ``pyvene_dist-static`` to ``bare-static``; ``pyvene_dist-static`` also carries
``speedup_over_stock_median`` (stock pyvene's eager time over its own, round by round). The same for the
process's CPU time (``cpu_ratio_median``: the work done, which other processes on the host do not
stretch), the host's load average before and after, and token checks: ``differs_from_bare`` (the
interventions ran), ``same_as_stock`` (pyvene_dist's eager tokens are stock pyvene's) and ``same_as_eager``
(the static cache's tokens are the eager ones). Only a repeatable generation can equal another: on CPU in
float32 it is; in bf16 on the H200 the bare model's own greedy tokens differ between two runs from about the
68th new token (``gpu-tests/2026-12-03-aeb021d``), so there the equalities are false for 256 tokens
whatever the path. ``--on-prompt`` measures pyreft's prompt-only mode (``intervene_on_prompt=True``, the
last prompt position) instead.

Rows before this layout (``generation-1xH200.jsonl`` up to aeb021d) timed the bare model beside each
provider under that provider's patch state, and their ``ratio`` is the ratio of medians.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import common  # noqa: E402

import pyvene_dist  # noqa: E402
from pyvene_dist.testing import models  # noqa: E402


STOCK, PATCHED = ("bare", "bare-static", "pyvene"), ("pyvene_dist", "pyvene_dist-static")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-3.2-1b", choices=sorted(models.LLAMA_SHAPES))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=1024)
    parser.add_argument("--interventions", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds, one generation per column each")
    parser.add_argument("--on-prompt", action="store_true", help="prompt-only interventions instead")
    parser.add_argument("--providers", default="pyvene,pyvene_dist",
                        help="pyvene (stock) and/or pyvene_dist, timed in the same rounds as the bare model")
    parser.add_argument("--no-static", action="store_true", help="leave out the static-cache (compiled) columns")
    parser.add_argument("--compile-backend", default=None,
                        help="the static cache's compile backend (CompileConfig(backend=...), forced on the CPU "
                        "with _compile_all_devices); default: transformers' own (CUDA only)")
    parser.add_argument("--compile-mode", default=None, help="CompileConfig(mode=...) with --compile-backend")
    parser.add_argument("--out", default="benchmarks/results/generation.jsonl")
    parser.add_argument("--profile", help="append the top operators of a 32-token generation of each column "
                        "here (torch.profiler)")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny model, 8 new tokens, eager compile backend")
    options = parser.parse_args(argv)
    providers = options.providers.split(",")
    if not providers or not set(providers) <= {"pyvene", "pyvene_dist"} or len(set(providers)) != len(providers):
        parser.error(f"--providers {options.providers!r}: expected pyvene, pyvene_dist or pyvene,pyvene_dist")
    if options.smoke:
        options.model, options.batch, options.prompt_len, options.new_tokens = "tiny", 2, 8, 8
        options.interventions, options.rounds = 2, 2
        options.compile_backend = options.compile_backend or "eager"
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not options.no_static and options.compile_backend is None:
        parser.error("--compile-backend: the CPU compiles the static cache's decoding step only when told to "
                     "(for example --compile-backend inductor), or pass --no-static")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    pyvene_dist.unpatch()
    model = models.llama(options.model, dtype=dtype, device=device).eval()
    layers = common.middle_layers(model, options.interventions)
    generator = torch.Generator().manual_seed(0)
    prompt = {"input_ids": torch.randint(3, model.config.vocab_size, (options.batch, options.prompt_len),
                                         generator=generator).to(device)}
    prompt["attention_mask"] = torch.ones_like(prompt["input_ids"])
    settings = dict(max_new_tokens=options.new_tokens, min_new_tokens=options.new_tokens, do_sample=False,
                    use_cache=True, pad_token_id=0)
    static = {"cache_implementation": "static"}
    if options.compile_backend is not None:
        from transformers import CompileConfig

        config = CompileConfig(backend=options.compile_backend,
                               **({"mode": options.compile_mode} if options.compile_mode else {}))
        config._compile_all_devices = True
        static["compile_config"] = config
    if options.on_prompt:
        where = {"unit_locations": {"sources->base": (None, [[[options.prompt_len - 1]] * options.batch]
                                                      * len(layers))}, "intervene_on_prompt": True}
    else:
        where = {"unit_locations": None, "intervene_on_prompt": False}
    measure = "generate:" + ("prompt" if options.on_prompt else "every-token")
    reft = common.reft_model(model, layers)  # unpatched; patch() adopts its rotations, unpatch() gives them back
    reft.eval()
    runs = {
        "bare": lambda chosen: model.generate(**prompt, **chosen),
        "bare-static": lambda chosen: model.generate(**prompt, **chosen, **static),
        "pyvene": lambda chosen: reft.generate(prompt, **where, **chosen)[1],
        "pyvene_dist": lambda chosen: reft.generate(prompt, **where, **chosen)[1],
        "pyvene_dist-static": lambda chosen: reft.generate(prompt, **where, **chosen, **static)[1],
    }
    names = [name for name in (*STOCK, *PATCHED) if (name in ("bare", "bare-static") or name.split("-")[0]
             in providers) and not (options.no_static and name.endswith("-static"))]
    groups = [[name for name in STOCK if name in names], [name for name in PATCHED if name in names]]
    outputs, times, host, cpu = {}, {name: [] for name in names}, {}, {}

    def generation(name, chosen=settings):
        def step():
            with torch.no_grad():
                outputs[name] = runs[name](chosen)
        return step

    def set_patched(on: bool) -> None:
        if on:
            pyvene_dist.patch()
        else:
            pyvene_dist.unpatch()

    meta, load = common.metadata(device, dtype), common.host_load()
    # Load the kernels and compile, then one untimed generation of full length each: the first at a length
    # grows the allocator's pool, and timed it made the first round's bare generation 3-5 x the later ones
    short = {**settings, "max_new_tokens": 16, "min_new_tokens": 16}
    for patched, group in enumerate(groups):
        set_patched(bool(patched))
        for name in group:
            common.timed(generation(name, short), warmup=1, steps=0, device=device)
            common.timed(generation(name), warmup=1, steps=0, device=device)
    for round_ in range(options.rounds):
        for patched, group in enumerate(groups):
            if not group:
                continue
            set_patched(bool(patched))
            turn = round_ % len(group)
            for name in group[turn:] + group[:turn]:
                spent = []
                times[name].append(common.timed(generation(name), warmup=1, steps=1, device=device,
                                                host=host.setdefault(name, []), cpu=spent))
                cpu.setdefault(name, []).append(spent)
    pyvene_dist.unpatch()
    found = [{"provider": name, "measure": measure, "patched": name in PATCHED, "static_cache": "static" in name,
              "compile_backend": options.compile_backend if "static" in name else None,
              "strategy": "single", "world_size": 1, "model": options.model, "batch": options.batch,
              "seq_len": options.prompt_len, "new_tokens": options.new_tokens, "layers": layers,
              "kv_cache": True, "rounds": options.rounds, **common.summary(times[name], host[name], cpu[name]),
              "peak_memory_gib": common.peak_memory_gib(device), **meta, "load_1min": load["load_1min"],
              "load_1min_after": common.host_load()["load_1min"]} for name in names]
    by = {row["provider"]: row for row in found}
    for row in found:
        row["ms_per_token"] = row["median_ms"] / options.new_tokens
    common.compare(found, "bare", ("bare-static", "pyvene", "pyvene_dist"))
    common.compare(found, "bare-static", ("pyvene_dist-static",))
    if "pyvene" in by and "pyvene_dist-static" in by:
        ratios = [stock / ours for stock, ours in zip(by["pyvene"]["round_medians_ms"],
                                                       by["pyvene_dist-static"]["round_medians_ms"])]
        by["pyvene_dist-static"]["speedup_over_stock_median"] = statistics.median(ratios)
        by["pyvene_dist-static"]["speedup_over_stock_rounds"] = ratios
    for name in ("pyvene", "pyvene_dist", "pyvene_dist-static"):
        if name in by:
            by[name]["differs_from_bare"] = not torch.equal(outputs[name], outputs["bare"])
    if "pyvene" in by and "pyvene_dist" in by:
        by["pyvene_dist"]["same_as_stock"] = torch.equal(outputs["pyvene_dist"], outputs["pyvene"])
    if "pyvene_dist-static" in by:
        eager = outputs.get("pyvene_dist", outputs.get("pyvene"))
        by["pyvene_dist-static"]["same_as_eager"] = None if eager is None else \
            torch.equal(outputs["pyvene_dist-static"], eager)
    if "bare-static" in by:  # its column runs whatever --providers says
        by["bare-static"]["same_as_eager"] = torch.equal(outputs["bare-static"], outputs["bare"])
    common.append_rows(options.out, found)
    for row in found:
        median = f"; median of round ratios {row['ratio_median']:.3f} x" if "ratio_median" in row else ""
        print(common.show(row) + median + f", {row['ms_per_token']:.3f} ms per token", flush=True)
    if options.profile:
        profiled = {**settings, "max_new_tokens": 32, "min_new_tokens": 32}
        for patched, group in enumerate(groups):
            set_patched(bool(patched))
            for name in group:
                common.profile_top_ops(generation(name, profiled), path=options.profile, steps=1, rows=30,
                                       label=f"{name} generate, 32 new tokens ({measure})", device=device)
        pyvene_dist.unpatch()
    return 0


if __name__ == "__main__":
    sys.exit(main())
