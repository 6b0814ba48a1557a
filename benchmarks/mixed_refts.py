"""Several ReFTs on one base in one batch (``pyvene_dist.serving.MultiReftModel``): a batch of rows naming
different ReFTs, against one ReFT's batch and against generating each ReFT's rows on their own; side by
side in one run, with the memory each plan holds.

    python benchmarks/mixed_refts.py --out benchmarks/results/mixed-refts-1xH200.jsonl   # Llama 1B-class, bf16
    python benchmarks/mixed_refts.py --every-token --out benchmarks/results/mixed-refts-1xH200.jsonl
    python benchmarks/mixed_refts.py --smoke                                               # CPU, tiny model

``--refts`` LoReFT folders (4 interventions each at ``f1+l1`` of 2 layers, weights drawn from their own
seed) are saved with ``ReftModel.save`` to a scratch folder and loaded onto one base with
``MultiReftModel.load``. The prompts (``--batch`` rows of random tokens, of different lengths from
``--prompt-len`` / 2 to ``--prompt-len``, padded on the left) are generated greedily for exactly
``--new-tokens`` tokens (``min_new_tokens``), in pyreft's prompt mode (``--every-token``: pyvene's every-token
mode). Providers, timed in interleaved rounds, one generation each per round:

- ``one-reft-batch`` (the baseline): every row names the first ReFT;
- ``mixed-refts``: row ``i`` names ReFT ``i mod --refts``;
- ``each-group-alone``: the rows of each ReFT of ``mixed-refts`` generated on their own, one ``generate`` per
  ReFT, one after another (what a server holding one ReFT at a time would run; the time of all of them);
- ``pyreft-one-reft``: pyreft's own ``ReftModel.generate`` of the first ReFT over the batch (patched: the
  one-ReFT path of ``pyvene_dist``), on a copy of the base so that its hooks do not touch the others;
- ``bare``: the base model's ``generate``.

Ratios are to ``one-reft-batch``, the median of the round-by-round ratios (``ratio_median``, with
``ratio_min``/``ratio_max``: the spread). Rows also carry ``same_as_alone``: whether the tokens of every
``mixed-refts`` row equal those of its ReFT's rows generated alone (``each-group-alone``), and
``differs_from_bare``; and the memory plan: ``base_bytes`` (the base model's weights), ``reft_bytes`` (all
ReFTs' weights), ``one_base_bytes`` (one base and every ReFT: ``MultiReftModel``), ``base_per_reft_bytes``
(a base per ReFT: a process per ReFT), and on a GPU each provider's peak memory in its own untimed call.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import common  # noqa: E402

import pyvene_dist  # noqa: E402
from pyvene_dist.serving import SETTINGS, MultiReftModel  # noqa: E402
from pyvene_dist.testing import models  # noqa: E402

POSITIONS = "f1+l1"


def save_refts(model, folder: Path, count: int, layers: list[int]) -> dict[str, Path]:
    """``count`` LoReFT folders as docs/examples/train_reft.py saves them, each drawn from its own seed."""
    folders = {}
    with pyvene_dist.patched():
        for index in range(count):
            reft = models.reft_model(model, layers=layers * 2, dtype=model.dtype, seed=100 + index)
            with torch.no_grad():
                generator = torch.Generator().manual_seed(index)  # a CPU generator: draw there, then copy over
                for intervention in reft.interventions.values():
                    bias = intervention.learned_source.bias
                    bias.copy_(torch.randn(bias.shape, generator=generator, dtype=torch.float32))
            folders[f"reft{index}"] = folder / f"reft{index}"
            reft.save(str(folders[f"reft{index}"]))
            (folders[f"reft{index}"] / SETTINGS).write_text(json.dumps(
                {"positions": POSITIONS, "share_weights": False, "dtype": str(model.dtype).removeprefix("torch.")}))
            del reft
    return folders


def loaded_refts(model, count: int, layers: list[int], prefix: str):
    """``count`` ReFT folders saved to a scratch folder (``save_refts``) and loaded onto ``model``: (the scratch
    folder, to clean up; the ``MultiReftModel``)."""
    scratch = tempfile.TemporaryDirectory(prefix=prefix)
    many = MultiReftModel(model)
    for name, folder in save_refts(model, Path(scratch.name), count, layers).items():
        many.load(name, folder)
    return scratch, many


def prompts(batch: int, length: int, vocab: int, device) -> dict:
    """``batch`` rows of random tokens, ``length / 2`` to ``length`` long, padded on the left with 0."""
    generator = torch.Generator().manual_seed(0)
    lengths = torch.linspace(max(2, length // 2), length, batch).round().long().tolist()
    ids = torch.zeros(batch, length, dtype=torch.long)
    mask = torch.zeros(batch, length, dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, length - n:] = torch.randint(3, vocab, (n,), generator=generator)
        mask[row, length - n:] = 1
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-3.2-1b", choices=sorted(models.LLAMA_SHAPES))
    parser.add_argument("--refts", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2, help="intervened layers per ReFT (two interventions each)")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds, one generation per provider each")
    parser.add_argument("--every-token", action="store_true", help="pyvene's every-token mode instead of the prompt's")
    parser.add_argument("--out", default="benchmarks/results/mixed-refts.jsonl")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny model, 4 new tokens, 2 rounds")
    options = parser.parse_args(argv)
    if options.smoke:
        options.model, options.prompt_len, options.new_tokens, options.rounds = "tiny", 8, 4, 2
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = models.llama(options.model, dtype=dtype, device=device).eval()
    layers = common.middle_layers(model, options.layers)
    inputs = prompts(options.batch, options.prompt_len, model.config.vocab_size, device)
    settings = dict(max_new_tokens=options.new_tokens, min_new_tokens=options.new_tokens, do_sample=False,
                    pad_token_id=0, intervene_on_prompt=not options.every_token)
    bare_settings = {k: v for k, v in settings.items() if k != "intervene_on_prompt"}

    scratch, many = loaded_refts(model, options.refts, layers, "mixed-refts-")
    folders = {name: reft.folder for name, reft in many.refts.items()}
    names = many.names
    mixed = [names[row % len(names)] for row in range(options.batch)]
    groups = {name: [row for row, chosen in enumerate(mixed) if chosen == name] for name in dict.fromkeys(mixed)}

    import pyreft

    pyvene_dist.patch()
    alone_base = copy.deepcopy(model)
    one = pyreft.ReftModel.load(str(folders[names[0]]), alone_base)
    one.set_device(device)
    one.eval()
    first, last = pyreft.parse_positions(POSITIONS)
    lengths = inputs["attention_mask"].sum(1).tolist()
    where = [[[options.prompt_len - n + p for p in pyreft.get_intervention_locations(
        last_position=n, first_n=first, last_n=last, pad_mode="last", num_interventions=len(one.interventions),
        share_weights=False)[k]] for n in lengths] for k in range(len(one.interventions))]
    one_kwargs = ({"unit_locations": {"sources->base": (None, where)}, "intervene_on_prompt": True}
                  if not options.every_token else {"unit_locations": None, "intervene_on_prompt": False})
    outputs: dict = {}

    def one_reft_batch():
        outputs["one-reft-batch"] = many.generate(inputs, refts=[names[0]] * options.batch, **settings)

    def mixed_refts():
        outputs["mixed-refts"] = many.generate(inputs, refts=mixed, **settings)

    def each_group_alone():
        found = {}
        for name, rows in groups.items():
            chosen = {key: value[rows] for key, value in inputs.items()}
            found[name] = many.generate(chosen, refts=[name] * len(rows), **settings)
        outputs["each-group-alone"] = found

    def pyreft_one_reft():
        outputs["pyreft-one-reft"] = one.generate(inputs, **one_kwargs, **bare_settings)[1]

    def bare():
        outputs["bare"] = model.generate(**inputs, **bare_settings)

    steps = {"one-reft-batch": one_reft_batch, "mixed-refts": mixed_refts, "each-group-alone": each_group_alone,
             "pyreft-one-reft": pyreft_one_reft, "bare": bare}
    peaks = {}
    with torch.no_grad():
        for name, step in steps.items():  # untimed, full length: kernels loaded, the allocator's pool grown
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
            step()
            peaks[name] = common.peak_memory_gib(device)
        host, cpu, load = {}, {}, common.host_load()
        times = common.interleaved(steps, rounds=options.rounds, steps=options.rounds, device=device, host=host,
                                   warmup=0, cpu=cpu)
    pyvene_dist.unpatch()

    memory = many.memory()
    reft_bytes = sum(memory["reft_bytes"].values())
    same_as_alone = all(torch.equal(outputs["mixed-refts"][rows].cpu(), outputs["each-group-alone"][name].cpu())
                        for name, rows in groups.items())
    measure = "generate:" + ("every-token" if options.every_token else "prompt")
    meta = common.metadata(device, dtype)
    rows = [{"provider": name, "measure": measure, "strategy": "single", "world_size": 1, "model": options.model,
             "batch": options.batch, "seq_len": options.prompt_len, "new_tokens": options.new_tokens,
             "refts": options.refts, "reft_layers": layers, "torch_threads": torch.get_num_threads(),
             "positions": POSITIONS,
             "groups": len(groups) if name in ("mixed-refts", "each-group-alone") else 1, "rounds": options.rounds,
             **common.summary(times[name], host[name], cpu[name]), "peak_memory_gib": peaks[name],
             "base_bytes": memory["base_bytes"], "reft_bytes": reft_bytes,
             "one_base_bytes": memory["base_bytes"] + reft_bytes,
             "base_per_reft_bytes": options.refts * memory["base_bytes"] + reft_bytes,
             **meta, "load_1min": load["load_1min"], "load_1min_after": common.host_load()["load_1min"]}
            for name in steps]
    for row in rows:
        row["tokens_per_s"] = options.batch * options.new_tokens / (row["median_ms"] / 1000)
    common.compare(rows, "one-reft-batch", tuple(steps))
    by_name = {row["provider"]: row for row in rows}
    by_name["mixed-refts"]["same_as_alone"] = same_as_alone
    by_name["mixed-refts"]["differs_from_bare"] = not torch.equal(outputs["mixed-refts"], outputs["bare"])
    by_name["one-reft-batch"]["same_as_pyreft"] = torch.equal(outputs["one-reft-batch"], outputs["pyreft-one-reft"])
    common.append_rows(options.out, rows)
    for row in rows:
        print(common.show(row) + f", {row['tokens_per_s']:.0f} tokens/s", flush=True)
    print(f"memory: one base and {options.refts} ReFTs {by_name['bare']['one_base_bytes'] / 2**20:.1f} MiB, a base "
          f"per ReFT {by_name['bare']['base_per_reft_bytes'] / 2**20:.1f} MiB; mixed rows equal their groups alone: "
          f"{same_as_alone}; one-ReFT batch equals pyreft's: {by_name['one-reft-batch']['same_as_pyreft']}")
    scratch.cleanup()
    return 0 if same_as_alone else 1


if __name__ == "__main__":
    sys.exit(main())
