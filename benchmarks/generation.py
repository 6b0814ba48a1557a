"""Generation with a ReFT intervention on every generated token, against the bare model's generation:
one GPU, KV cache on, side by side in one run, as time per token.

    python benchmarks/generation.py --out benchmarks/results/generation.jsonl   # Llama 1B-class, bf16, 1,024 tokens
    python benchmarks/generation.py --smoke                                      # CPU, tiny model, 8 tokens

``reft_model.generate(prompt, unit_locations=None, intervene_on_prompt=False, ...)`` is pyvene's
every-token mode: its setter hooks skip the prompt's forward and intervene at position 0 of every later
one, which with the KV cache is the token just generated. Every generation makes exactly
``--new-tokens`` tokens (``min_new_tokens``, greedy). Providers: ``bare`` (``model.generate`` on the same
weights), ``pyvene`` (stock pyvene/pyreft) and ``pyvene_dist`` (after ``pyvene_dist.patch()``). Stock pyvene
runs unpatched, so its rounds come first, interleaved with the bare model's; then pyvene_dist's, interleaved
with the bare model's again: each ratio is to the bare generations timed beside it (``--providers`` runs
one of the two). Rows are written after each provider's rounds. ``--on-prompt`` measures
pyreft's prompt-only mode (``intervene_on_prompt=True``, the last prompt position) instead.

Each provider's timed rounds follow one untimed generation of full length. Rows: time per generation
(p20/p50/p80, median, spread, each round's), ``ms_per_token``, the ratio to the bare model's (round by
round), the same for the process's CPU time (``cpu_ratio_median``: the work done, which other processes
on the host do not stretch), the host's load average before and after the rounds, and
``differs_from_bare``/``same_as_stock``: whether the tokens differ from the bare model's (the interventions
ran) and equal stock pyvene's. Only a repeatable generation can equal another: on CPU in float32 it is; in
bf16 on the H200 the bare model's own greedy tokens differ between two runs from about the 68th new token
(``gpu-tests/2026-12-03-aeb021d``), so there ``same_as_stock`` is false for 256 tokens whatever the path.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import common  # noqa: E402

import pyvene_dist  # noqa: E402
from pyvene_dist.testing import models  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-3.2-1b", choices=sorted(models.LLAMA_SHAPES))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=1024)
    parser.add_argument("--interventions", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds, one generation per provider each")
    parser.add_argument("--on-prompt", action="store_true", help="prompt-only interventions instead")
    parser.add_argument("--providers", default="pyvene,pyvene_dist",
                        help="pyvene (stock) and/or pyvene_dist, each in its own rounds beside the bare model")
    parser.add_argument("--out", default="benchmarks/results/generation.jsonl")
    parser.add_argument("--profile", help="append the top operators of a 32-token generation of the bare model "
                        "and of each provider here (torch.profiler)")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny model, 8 new tokens")
    options = parser.parse_args(argv)
    if not set(options.providers.split(",")) <= {"pyvene", "pyvene_dist"} or options.providers.endswith(",pyvene"):
        parser.error(f"--providers {options.providers!r}: expected pyvene, pyvene_dist or pyvene,pyvene_dist "
                     "(stock first: pyvene_dist stays patched)")
    if options.smoke:
        options.model, options.batch, options.prompt_len, options.new_tokens = "tiny", 2, 8, 8
        options.interventions, options.rounds = 2, 2
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = models.llama(options.model, dtype=dtype, device=device).eval()
    layers = common.middle_layers(model, options.interventions)
    generator = torch.Generator().manual_seed(0)
    prompt = {"input_ids": torch.randint(3, model.config.vocab_size, (options.batch, options.prompt_len),
                                         generator=generator).to(device)}
    prompt["attention_mask"] = torch.ones_like(prompt["input_ids"])
    settings = dict(max_new_tokens=options.new_tokens, min_new_tokens=options.new_tokens, do_sample=False,
                    use_cache=True, pad_token_id=0)
    if options.on_prompt:
        where = {"unit_locations": {"sources->base": (None, [[[options.prompt_len - 1]] * options.batch]
                                                      * len(layers))}, "intervene_on_prompt": True}
    else:
        where = {"unit_locations": None, "intervene_on_prompt": False}
    measure = "generate:" + ("prompt" if options.on_prompt else "every-token")
    short = {**settings, "max_new_tokens": 16, "min_new_tokens": 16}
    outputs = {}

    def generation(name, run, chosen=settings):
        def step():
            with torch.no_grad():
                outputs[name] = run(chosen)
        return step

    def bare(chosen):
        return model.generate(**prompt, **chosen)

    meta = common.metadata(device, dtype)
    for provider in options.providers.split(","):
        if provider == "pyvene_dist":
            pyvene_dist.patch()
        reft = common.reft_model(model, layers)
        reft.eval()

        def intervened(chosen, reft=reft):
            return reft.generate(prompt, **where, **chosen)[1]

        steps = {"bare": generation("bare", bare), provider: generation(provider, intervened)}
        # Load the kernels, then one untimed generation of full length each: the first at a length grows the
        # allocator's pool, and timed it made the first round's bare generation 3-5 x the later ones
        for name, run in (("bare", bare), (provider, intervened)):
            common.timed(generation(name, run, short), warmup=1, steps=0, device=device)
            common.timed(steps[name], warmup=1, steps=0, device=device)
        host, cpu, load = {}, {}, common.host_load()
        times = common.interleaved(steps, rounds=options.rounds, steps=options.rounds, device=device, host=host,
                                   warmup=0, cpu=cpu)
        found = [{"provider": name, "measure": measure, "bare_of": provider if name == "bare" else None,
                  "strategy": "single", "world_size": 1, "model": options.model, "batch": options.batch,
                  "seq_len": options.prompt_len, "new_tokens": options.new_tokens, "layers": layers,
                  "kv_cache": True, "rounds": options.rounds, **common.summary(times[name], host[name], cpu[name]),
                  "peak_memory_gib": common.peak_memory_gib(device), **meta, "load_1min": load["load_1min"],
                  "load_1min_after": common.host_load()["load_1min"]} for name in steps]
        for row in found:
            row["ms_per_token"] = row["median_ms"] / options.new_tokens
        common.compare(found, "bare", (provider,))
        found[1]["differs_from_bare"] = not torch.equal(outputs[provider], outputs["bare"])
        if provider == "pyvene_dist" and "pyvene" in outputs:
            found[1]["same_as_stock"] = torch.equal(outputs["pyvene_dist"], outputs["pyvene"])
        common.append_rows(options.out, found)
        for row in found:
            print(common.show(row) + f", {row['ms_per_token']:.3f} ms per token", flush=True)
        if options.profile:
            profiled = {**settings, "max_new_tokens": 32, "min_new_tokens": 32}
            for name, run in (("bare", bare), (provider, intervened)):
                common.profile_top_ops(generation(name, run, profiled), path=options.profile, steps=1, rows=30,
                                       label=f"{name} generate, 32 new tokens ({measure})", device=device)
    pyvene_dist.unpatch()
    return 0


if __name__ == "__main__":
    sys.exit(main())
