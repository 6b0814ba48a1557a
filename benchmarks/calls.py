"""Host work of the intervention path, counted: Python calls per forward and per generated token, for the
bare model, stock pyvene and pyvene_dist, as rows. Call counts do not depend on the machine or its load,
so the script runs on CPU and repeats exactly (CI runs ``--smoke`` and the trend shows per commit).

    python benchmarks/calls.py --out benchmarks/results/calls-cpu.jsonl   # the issue's setting
    python benchmarks/calls.py --smoke                                     # the same, fewer tokens

A call is one profiler ``call`` or ``c_call`` event (``sys.setprofile``): a Python function, or a C function
called from Python (a torch op, a ``dict.get``). Work inside C++ (kernels, the autograd engine) is not seen,
only what the host runs in Python to get there.

The setting: a tiny Llama of 8 layers (hidden 32), batch 2 x 32 tokens; pyreft's LoReFT rank 4 at
``block_output`` of 4 layers (``pyreft.get_reft_model``), at 10 positions each, the first and last 5, built by
``pyreft.get_intervention_locations(share_weights=True, first_n=5, last_n=5)`` and collated as pyreft does
(``[batch, interventions, positions]`` on the device). Measures:

- ``forward``: a no-grad forward; the intervened model is called with host lists, as inference code does.
- ``train``: a training forward and backward, as pyreft's ``ReftTrainer.compute_loss`` runs it (its own
  ``compute_loss`` on the collated batch: a device tensor of locations it turns into lists), then
  ``loss.backward()``; the bare model's is the same forward with labels and backward, its weights trainable.
- ``generate``: greedy ``generate`` with the KV cache and an intervention on every generated token (pyvene's
  every-token mode: ``unit_locations=None, intervene_on_prompt=False``; its hooks skip the prompt's forward and
  intervene at position 0 of each later one, the token just generated), beside the bare model's ``generate``.
  ``calls_per_token`` is the slope between two generations of ``--tokens`` and twice as many tokens (what one
  more token costs, the prompt and the setup left out); ``calls`` is the longer generation's whole count.

Each measure runs ``--warmup`` times uncounted (first-call caches, lazy imports), then is counted twice with
the garbage collector off; ``repeats`` says whether the two counts were equal. Rows: ``provider`` (``bare``,
``pyvene``: stock pyvene/pyreft unpatched, ``pyvene_dist``: after ``pyvene_dist.patch()``), ``measure``,
``calls``, ``ratio_to_bare``, ``calls_over_bare``, and the row metadata of ``common.metadata``.
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import common  # noqa: E402

import pyvene_dist  # noqa: E402
from pyvene_dist.testing import models  # noqa: E402

_COUNTED = ("call", "c_call")


def count_calls(step) -> int:
    """The Python calls (profiler ``call`` and ``c_call`` events) that ``step()`` makes, garbage collection
    off (a collection would run finalizers at a point that varies)."""
    calls = 0

    def profiler(frame, event, arg):
        nonlocal calls
        if event in _COUNTED:
            calls += 1

    gc.collect()
    gc.disable()
    sys.setprofile(profiler)
    try:
        step()
    finally:
        sys.setprofile(None)
        gc.enable()
    return calls - 1  # setprofile(None) itself is reported as a c_call


def counted(step, *, warmup: int) -> tuple[int, bool]:
    """``step``'s calls after ``warmup`` uncounted runs, and whether two counted runs agreed."""
    for _ in range(warmup):
        step()
    first, second = count_calls(step), count_calls(step)
    return second, first == second


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--positions", type=int, default=10, help="per intervention, the first and last half")
    parser.add_argument("--interventions", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=8, help="generations of this many tokens and twice as many")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--providers", default="pyvene,pyvene_dist",
                        help="beside the bare model: pyvene (stock) and/or pyvene_dist (stock first)")
    parser.add_argument("--out", default="benchmarks/results/calls-cpu.jsonl")
    parser.add_argument("--smoke", action="store_true", help="2 and 4 generated tokens, one warm-up run")
    options = parser.parse_args(argv)
    providers = options.providers.split(",")
    if not set(providers) <= {"pyvene", "pyvene_dist"} or providers == ["pyvene_dist", "pyvene"]:
        parser.error(f"--providers {options.providers!r}: expected pyvene, pyvene_dist or pyvene,pyvene_dist")
    if options.smoke:
        options.tokens, options.warmup = 2, 1
    device, dtype = torch.device("cpu"), torch.float32
    model = models.llama("tiny", dtype=dtype, device=device, layers=options.layers)
    layers = common.middle_layers(model, options.interventions)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (options.batch, options.seq_len), generator=generator)
    batch = _collated(ids, options)
    prompt = {"input_ids": ids[:, :options.prompt_len], "attention_mask": torch.ones_like(ids[:, :options.prompt_len])}
    # What the imports (pyreft's, in _collated, the last) and the bare model made lives to the end: frozen, out of
    # every count's collection, which then walks only newer objects (0.3 s a collection with them, 24 collections).
    gc.freeze()
    lengths = (options.tokens, 2 * options.tokens)
    settings = [dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, use_cache=True, pad_token_id=0)
                for n in lengths]

    def measures(forward, train, generate):
        return {"forward": forward, "train": train,
                **{f"generate:{n}": (lambda chosen=chosen: generate(chosen)) for n, chosen in zip(lengths, settings)}}

    def bare_forward():
        with torch.no_grad():
            model(input_ids=ids)

    def bare_train():
        model(input_ids=ids, attention_mask=batch["attention_mask"], labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)

    def bare_generate(chosen):
        with torch.no_grad():
            model.generate(**prompt, **chosen)

    counts = {"bare": _count(measures(bare_forward, bare_train, bare_generate), options.warmup)}
    for provider in providers:
        if provider == "pyvene_dist":
            pyvene_dist.patch()
        counts[provider] = _count(_reft_measures(model, layers, ids, batch, prompt, measures), options.warmup)
    pyvene_dist.unpatch()

    rows = _rows(counts, lengths, options, layers, common.metadata(device, dtype))
    common.append_rows(options.out, rows)
    for row in rows:
        over = f", {row['ratio_to_bare']:.3f} x bare (+{row['calls_over_bare']})" if "ratio_to_bare" in row else ""
        print(f"{row['provider']:>12} {row['measure']:>8}: {row['calls']} calls{over}"
              + ("" if row["repeats"] else " (the two counts differed)"), flush=True)
    return 0


def _collated(ids, options) -> dict:
    """The batch as pyreft's data module and collator make it."""
    import pyreft

    locations = pyreft.get_intervention_locations(
        last_position=options.seq_len, first_n=options.positions // 2, last_n=options.positions - options.positions // 2,
        num_interventions=options.interventions, share_weights=True)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids,
            "intervention_locations": torch.tensor([locations] * ids.shape[0])}


def _reft_measures(model, layers, ids, batch, prompt, measures) -> dict:
    """pyreft's LoReFT on ``model`` (under whatever patch state the caller is in) and its steps."""
    import pyreft

    reft = common.reft_model(model, layers)
    trainer = object.__new__(pyreft.ReftTrainer)  # compute_loss reads nothing of the trainer
    parameters = reft.get_trainable_parameters()
    hosted = {"sources->base": (None, batch["intervention_locations"].permute(1, 0, 2).tolist())}

    def forward():
        _set_training(reft, False)
        with torch.no_grad():
            reft({"input_ids": ids}, unit_locations=hosted)

    def train():
        _set_training(reft, True)
        trainer.compute_loss(reft, batch).backward()
        for parameter in parameters:
            parameter.grad = None

    def generate(chosen):
        _set_training(reft, False)
        with torch.no_grad():
            reft.generate(prompt, unit_locations=None, intervene_on_prompt=False, **chosen)

    return measures(forward, train, generate)


def _set_training(reft, training: bool) -> None:
    """Train or eval mode, set only when it changes: ``train()`` walks every module, which the warm-up runs
    then leave out of the count. pyvene's ``train``/``eval`` set the base model's mode, not its own."""
    if reft.model.training != training:
        reft.train(training)


def _count(steps: dict, warmup: int) -> dict:
    return {name: counted(step, warmup=warmup) for name, step in steps.items()}


def _rows(counts: dict, lengths, options, layers, meta) -> list[dict]:
    shared = {"strategy": "single", "world_size": 1, "model": f"tiny-{options.layers}-layers", "layers": layers,
              "batch": options.batch, "seq_len": options.seq_len, "positions": options.positions,
              "interventions": options.interventions, "counted": "call+c_call", **meta}
    rows = []
    for provider, found in counts.items():
        short, long = (found[f"generate:{n}"] for n in lengths)
        rows += [{"provider": provider, "measure": measure, "calls": found[measure][0], "repeats": found[measure][1],
                  **shared} for measure in ("forward", "train")]
        rows.append({"provider": provider, "measure": "generate", "calls": long[0], "repeats": short[1] and long[1],
                     "calls_per_token": (long[0] - short[0]) / (lengths[1] - lengths[0]),
                     "prompt_len": options.prompt_len, "new_tokens": lengths[1], "kv_cache": True, **shared})
    bare = {row["measure"]: row for row in rows if row["provider"] == "bare"}
    for row in rows:
        if row["provider"] != "bare":
            base = bare[row["measure"]]
            row["baseline"] = "bare"
            row["ratio_to_bare"] = row["calls"] / base["calls"]
            row["calls_over_bare"] = row["calls"] - base["calls"]
            if "calls_per_token" in row:
                row["per_token_ratio_to_bare"] = row["calls_per_token"] / base["calls_per_token"]
                row["per_token_over_bare"] = row["calls_per_token"] - base["calls_per_token"]
    return rows


if __name__ == "__main__":
    sys.exit(main())
