"""ReFT generation with the static cache and transformers' default compile of the decoding step (inductor,
``reduce-overhead``: CUDA graphs) on one GPU, in both orders, each case in a fresh process (issue 37).

    source scripts/gpu_env.sh && python3 benchmarks/gpu_generation_check.py --out "$OUT/generation-check.json"
    python3 benchmarks/gpu_generation_check.py --smoke --out /tmp/check.json      # CPU, tiny model, eager backend

Cases: ``bare first`` (the bare model generates compiled, then the ReFT) and ``reft first`` (the reverse), each
patched and stock, in every-token and prompt mode. A case generates, in this order, the two compiled
generations, the ReFT's again (compiled), then eager references of both (dynamic cache, nothing compiled). It
records an error's text where one is raised (issue 37 at b0b1170: ``reft first`` patched raised "accessing
tensor output of CUDAGraphs that has been overwritten by a subsequent run"), the graphs dynamo made in each
generation (``counters["stats"]["unique_graphs"]``), and the share of equal new tokens between: the compiled
ReFT and the eager ReFT, the compiled ReFT and the eager bare model, the eager ReFT and the eager bare model.
``applied`` is true where the compiled ReFT's tokens are nearer the eager ReFT's than the bare model's (at
b0b1170 ``bare first`` gave the bare model's tokens: interventions dropped). In bf16 two eager runs of the bare
model already part after some 68 tokens on the H200 (docs/benchmarks.md); the default is float32 with 32 new
tokens, so that equal tokens are expected where the path is right. Writes one JSON file with a row per case.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent


def agreement(a, b) -> float:
    return (a == b).float().mean().item()


def run_case(options) -> dict:
    import torch
    from torch._dynamo.utils import counters

    sys.path.insert(0, str(HERE))
    import common

    import pyvene_dist
    from pyvene_dist.testing import models

    order, provider, mode = options.case.split(",")
    if provider == "patched":
        pyvene_dist.patch()
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, options.dtype)
    model = models.llama(options.model, dtype=dtype, device=device).eval()
    layers = common.middle_layers(model, options.interventions)
    reft = common.reft_model(model, layers)
    reft.eval()
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (options.batch, options.prompt_len), generator=generator)
    prompt = {"input_ids": ids.to(device), "attention_mask": torch.ones_like(ids).to(device)}
    settings = dict(max_new_tokens=options.new_tokens, min_new_tokens=options.new_tokens, do_sample=False,
                    pad_token_id=0)
    static = {"cache_implementation": "static"}
    if device.type != "cuda":  # the CPU compiles only when told (the smoke run)
        from transformers import CompileConfig

        config = CompileConfig(backend="eager")
        config._compile_all_devices = True
        static["compile_config"] = config
    if mode == "every":
        where = {"unit_locations": None, "intervene_on_prompt": False}
    else:
        locations = pyvene_dist.positions_from_attention_mask(prompt["attention_mask"], "f1+l1",
                                                              num_interventions=len(layers))
        where = {"unit_locations": {"sources->base": (None, locations.tolist())}, "intervene_on_prompt": True}
    row = {"case": options.case, "order": order, "provider": provider, "mode": mode, "model": options.model,
           "dtype": options.dtype, "batch": options.batch, "prompt_len": options.prompt_len,
           "new_tokens": options.new_tokens, "interventions": len(layers), "graphs": {}, "error": None,
           **common.metadata(device, dtype)}
    found = {}

    def generate(name, **extra):
        before = counters["stats"]["unique_graphs"]
        started = time.perf_counter()
        with torch.no_grad():
            if name.startswith("bare"):
                out = model.generate(**prompt, **settings, **extra)
            else:
                out = reft.generate(prompt, **where, **settings, **extra)[1]
        common.drain(device)
        found[name] = out[:, options.prompt_len:].clone().cpu()
        row["graphs"][name] = counters["stats"]["unique_graphs"] - before
        row.setdefault("seconds", {})[name] = round(time.perf_counter() - started, 3)

    steps = [("bare", static), ("reft", static)] if order == "bare-first" else [("reft", static), ("bare", static)]
    try:
        for name, extra in steps + [("reft-again", static), ("reft-eager", {}), ("bare-eager", {})]:
            generate(name, **extra)
    except Exception as error:  # recorded: the check reports what each case does
        row["error"] = f"{type(error).__name__}: {error}"[:2000]
    if "reft" in found and "reft-eager" in found and "bare-eager" in found:
        row["reft_vs_reft_eager"] = agreement(found["reft"], found["reft-eager"])
        row["reft_again_vs_reft_eager"] = agreement(found["reft-again"], found["reft-eager"])
        row["reft_vs_bare_eager"] = agreement(found["reft"], found["bare-eager"])
        row["reft_eager_vs_bare_eager"] = agreement(found["reft-eager"], found["bare-eager"])
        row["bare_vs_bare_eager"] = agreement(found["bare"], found["bare-eager"])
        row["applied"] = row["reft_vs_reft_eager"] > row["reft_vs_bare_eager"]
    return row


CASES = [f"{order},{provider},{mode}" for order in ("bare-first", "reft-first") for provider in ("patched", "stock")
         for mode in ("every", "prompt")]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="the JSON file to write")
    parser.add_argument("--model", default="llama-3.2-1b")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--interventions", type=int, default=4)
    parser.add_argument("--cases", nargs="+", default=CASES, choices=CASES, metavar="ORDER,PROVIDER,MODE",
                        help="the cases to run, each in its own process (default: all eight)")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per case")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny model, eager backend, 6 new tokens")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # the child process's one case
    options = parser.parse_args(argv)
    if options.smoke:
        options.model, options.batch, options.prompt_len, options.new_tokens, options.interventions = \
            "tiny", 2, 8, 6, 2
    if options.case:
        print("ROW " + json.dumps(run_case(options)), flush=True)
        return 0
    rows = []
    for case in options.cases:
        command = [sys.executable, str(Path(__file__).resolve()), "--case", case, "--out", options.out,
                   "--model", options.model, "--dtype", options.dtype, "--batch", str(options.batch),
                   "--prompt-len", str(options.prompt_len), "--new-tokens", str(options.new_tokens),
                   "--interventions", str(options.interventions)]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=options.timeout)
            lines = [line[4:] for line in done.stdout.splitlines() if line.startswith("ROW ")]
            row = json.loads(lines[-1]) if lines else {"case": case, "error": f"exit {done.returncode}: "
                                                       f"{done.stderr[-2000:]}"}
        except subprocess.TimeoutExpired:
            row = {"case": case, "error": f"timed out after {options.timeout} s"}
        rows.append(row)
        print(json.dumps({key: row.get(key) for key in ("case", "error", "graphs", "applied", "reft_vs_reft_eager",
                                                          "reft_vs_bare_eager", "reft_eager_vs_bare_eager")}),
              flush=True)
    Path(options.out).parent.mkdir(parents=True, exist_ok=True)
    Path(options.out).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
