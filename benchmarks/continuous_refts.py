"""Many ReFTs in transformers' continuous batching (``MultiReftModel.init_continuous_batching``) against the bare
model's continuous batching at the same load, side by side in one run: tokens per second and time to first token.

    python benchmarks/continuous_refts.py --out benchmarks/results/continuous-refts-1xH100.jsonl   # one GPU, 1B bf16
    python benchmarks/continuous_refts.py --every-token --out benchmarks/results/continuous-refts-1xH100.jsonl
    python benchmarks/continuous_refts.py --smoke                                                 # CPU, tiny model

``--requests`` prompts of random tokens (``--prompt-len`` / 2 to ``--prompt-len`` long) are all added at once to a
started manager, each generating exactly ``--new-tokens`` tokens (no end of sequence), greedy. Providers, timed in
interleaved rounds, one pass over all the requests each per round, each with the same ``ContinuousBatchingConfig``:

- ``bare-cb`` (the baseline): the base model's own manager (``model.init_continuous_batching``);
- ``refts-cb``: ``MultiReftModel``'s manager over ``--refts`` LoReFT folders (4 interventions each at ``f1+l1`` of 2
  layers, as benchmarks/mixed_refts.py saves them), request ``i`` naming ReFT ``i mod --refts``;
- ``one-reft-cb``: the same manager, every request naming the first ReFT.

A pass is timed from the first ``add_request`` to the last answer; ``tokens_per_s`` is its generated tokens over
that time (``tokens_per_cpu_s``: over the process's CPU time, which other processes' load on a shared machine
changes less), ``ttft_ms`` the median over requests of their first token's time less their creation
(``record_timestamps``). Rows carry the round-by-round ratios to ``bare-cb`` (``tokens_per_s_ratio_*``: above 1 is
faster; ``ttft_ratio_*``: above 1 is slower), the machine, versions and commit. The goal (issue 48): on one GPU,
64 requests over 8 ReFTs at least 0.90 x the bare tokens per second, and prompt mode's first token at most 1.10 x.
ReFT steps run without CUDA graphs or compile (``continuous``), so both run with ``use_cuda_graph=False``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).parent))
import common  # noqa: E402
from mixed_refts import loaded_refts  # noqa: E402

from pyvene_dist.testing import models  # noqa: E402


def prompts(count: int, length: int, vocab: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    lengths = torch.linspace(max(2, length // 2), length, count).round().long().tolist()
    return [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in lengths]


def one_pass(manager, requests: list[list[int]], names: list | None, new_tokens: int, on_prompt: bool) -> dict:
    """All ``requests`` added at once to the started ``manager``; the pass's wall time, tokens, first-token times."""
    start, cpu_start = time.perf_counter(), time.process_time()
    ids = []
    for index, ids_of_prompt in enumerate(requests):
        extra = {} if names is None else {"reft": names[index], "intervene_on_prompt": on_prompt}
        ids.append(manager.add_request(ids_of_prompt, request_id=f"q{index}", max_new_tokens=new_tokens,
                                       record_timestamps=True, **extra))
    results = {}
    while len(results) < len(ids):
        result = manager.get_result(timeout=60)
        if result is None:
            raise RuntimeError(f"no answer within 60 s ({len(results)} of {len(ids)})")
        if result.is_finished():
            if result.error is not None:
                raise RuntimeError(result.error)
            results[result.request_id] = result
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    tokens = sum(len(result.generated_tokens) for result in results.values())
    first = [(result.timestamps[0] - result.created_time) * 1000 for result in results.values()]
    return {"wall_s": wall, "cpu_s": cpu, "tokens": tokens, "tokens_per_s": tokens / wall,
            "tokens_per_cpu_s": tokens / cpu, "ttft_ms": statistics.median(first),
            "answers": {rid: result.generated_tokens for rid, result in results.items()}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-3.2-1b", choices=sorted(models.LLAMA_SHAPES))
    parser.add_argument("--model-layers", type=int, default=None, help="that many decoder layers (default: the shape's)")
    parser.add_argument("--refts", type=int, default=8)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-batch-tokens", type=int, default=2048)
    parser.add_argument("--every-token", action="store_true", help="every-token mode instead of pyreft's prompt mode")
    parser.add_argument("--out", default="benchmarks/results/continuous-refts.jsonl")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny model, 4 requests, 2 new tokens, 1 round")
    options = parser.parse_args(argv)
    if options.smoke:
        options.model, options.requests, options.prompt_len, options.new_tokens, options.rounds = "tiny", 4, 8, 2, 1
        options.refts, options.max_batch_tokens = min(options.refts, 2), 64
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = models.llama(options.model, dtype=dtype, device=device, layers=options.model_layers).eval()
    layers = common.middle_layers(model, 2)
    requests = prompts(options.requests, options.prompt_len, model.config.vocab_size)
    pages = options.requests * -(-(options.prompt_len + options.new_tokens) // 32) + 8
    batching = dict(page_size=32, num_blocks=pages, max_batch_tokens=options.max_batch_tokens,
                    max_requests_per_batch=options.requests, use_cuda_graph=False)
    config = transformers.GenerationConfig(max_new_tokens=options.new_tokens, do_sample=False, eos_token_id=-1)

    scratch, many = loaded_refts(model, options.refts, layers, "continuous-refts-")
    names = many.names
    mixed = [names[index % len(names)] for index in range(options.requests)]
    on_prompt = not options.every_token

    def run(kind: str) -> dict:
        cb = transformers.ContinuousBatchingConfig(**batching)
        manager = (model.init_continuous_batching(config, cb) if kind == "bare-cb"
                   else many.init_continuous_batching(config, cb))
        manager.start()
        try:
            chosen = None if kind == "bare-cb" else mixed if kind == "refts-cb" else [names[0]] * options.requests
            return one_pass(manager, requests, chosen, options.new_tokens, on_prompt)
        finally:
            manager.stop(block=True, timeout=60)

    providers = ("bare-cb", "refts-cb", "one-reft-cb")
    load = common.host_load()
    if not options.smoke:
        run("bare-cb"), run("refts-cb")  # untimed: kernels loaded, the allocator's pool grown
    passes = {name: [] for name in providers}
    for _ in range(options.rounds):
        for name in providers:
            passes[name].append(run(name))
    meta = common.metadata(device, dtype)
    measure = "continuous:" + ("every-token" if options.every_token else "prompt")
    rows = []
    for name in providers:
        found = passes[name]
        speed = [one["tokens_per_s"] for one in found]
        ttft = [one["ttft_ms"] for one in found]
        row = {"provider": name, "measure": measure, "strategy": "single", "world_size": 1, "model": options.model,
               "model_layers": model.config.num_hidden_layers, "requests": options.requests,
               "seq_len": options.prompt_len, "new_tokens": options.new_tokens, "refts": options.refts,
               "reft_layers": layers, "rounds": options.rounds, "batching": batching,
               "torch_threads": torch.get_num_threads(), "tokens_per_s_median": statistics.median(speed),
               "tokens_per_s_rounds": speed, "ttft_ms_median": statistics.median(ttft), "ttft_ms_rounds": ttft,
               "wall_s_rounds": [one["wall_s"] for one in found],
               "tokens_per_cpu_s_rounds": [one["tokens_per_cpu_s"] for one in found], **meta, "load_1min": load["load_1min"],
               "load_1min_after": common.host_load()["load_1min"]}
        rows.append(row)
    base = rows[0]
    for row in rows:
        row["baseline"] = "bare-cb"
        speed = [a / b for a, b in zip(row["tokens_per_s_rounds"], base["tokens_per_s_rounds"])]
        ttft = [a / b for a, b in zip(row["ttft_ms_rounds"], base["ttft_ms_rounds"])]
        cpu = [a / b for a, b in zip(row["tokens_per_cpu_s_rounds"], base["tokens_per_cpu_s_rounds"])]
        row.update({"tokens_per_cpu_s_ratio_median": statistics.median(cpu), "tokens_per_cpu_s_ratio_min": min(cpu),
                    "tokens_per_cpu_s_ratio_max": max(cpu)})
        row.update({"tokens_per_s_ratio_median": statistics.median(speed), "tokens_per_s_ratio_min": min(speed),
                    "tokens_per_s_ratio_max": max(speed), "ttft_ratio_median": statistics.median(ttft),
                    "ttft_ratio_min": min(ttft), "ttft_ratio_max": max(ttft)})
    changed = passes["refts-cb"][0]["answers"] != passes["bare-cb"][0]["answers"]
    rows[1]["differs_from_bare"] = changed
    common.append_rows(options.out, rows)
    for row in rows:
        print(f"{row['provider']:>12} {measure}: {row['tokens_per_s_median']:.1f} tokens/s "
              f"({row['tokens_per_s_ratio_median']:.3f} x bare, {row['tokens_per_s_ratio_min']:.3f}-"
              f"{row['tokens_per_s_ratio_max']:.3f}), first token {row['ttft_ms_median']:.1f} ms "
              f"({row['ttft_ratio_median']:.3f} x bare); per CPU second {row['tokens_per_cpu_s_ratio_median']:.3f} x bare "
              f"({row['tokens_per_cpu_s_ratio_min']:.3f}-{row['tokens_per_cpu_s_ratio_max']:.3f})", flush=True)
    scratch.cleanup()
    return 0 if changed else 1


if __name__ == "__main__":
    sys.exit(main())
