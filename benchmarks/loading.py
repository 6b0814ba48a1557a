"""The memory of loading a base model under each strategy (issue 47): the largest rank's peak host memory through the
load and the first step, on a user-sized model folder and on the tiny model (what the imports cost), as a share of
the model's bytes; with what each rank read from the checkpoint files.

    python benchmarks/loading.py --out benchmarks/results/loading-cpu.jsonl                 # 206M folder, 2 and 4 ranks
    python benchmarks/loading.py --smoke                                                    # tiny folders, 2 ranks

The folders are saved here first with ``save_pretrained`` (float32 safetensors): ``--size 206m`` is
``pyvene-dist tiny-model``'s Llama and tokenizer with hidden 1024, intermediate 2816, 16 layers and 16 heads (787
MiB), the baseline its tiny model. Each (folder, strategy, world size) trains ``pyvene-dist check``'s case (LoReFT
at the first and last layer, ``--steps`` steps) in fresh ranks spawned as ``check`` spawns them
(``pyvene_dist.testing.spawn``); ``single`` is one rank. A rank records its peak resident set (``VmHWM``) when the
model is loaded and wrapped (right before the first step) and at the end, and the bytes it read from the folder's
files (``pyvene_dist.loading``'s log). Rows: one per (strategy, world size), each with the ``--runs`` runs' figures,
their median and spread, and ``model_share``: (the 206M run's largest peak - the tiny run's largest peak) / the
model's bytes, the issue's measure.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import common  # noqa: E402

SIZES = {"206m": dict(hidden=1024, intermediate=2816, layers=16, heads=16, kv_heads=16),
         "50m": dict(hidden=512, intermediate=1408, layers=16, heads=8, kv_heads=8),
         "tiny": dict(hidden=32, layers=2, heads=4, kv_heads=2)}


def vm_hwm() -> int:
    """This process's peak resident set since it started (or since the last reset), bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class _ReadLog(logging.Handler):
    """pyvene_dist.loading's line per load: what this rank read."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.read = []

    def emit(self, record):
        if hasattr(record, "bytes_read"):
            self.read.append((record.bytes_read, record.whole_bytes))


def rank_main(folder: str, strategy_name: str, steps: int, world_size: int, out: str, malloc: str) -> None:
    import torch.distributed as dist

    import pyvene_dist
    from pyvene_dist.check import return_freed_memory
    from pyvene_dist.testing import STRATEGIES, train
    from pyvene_dist.testing.check_runs import CheckCase, model_config, representation_layers

    reads = _ReadLog()
    logging.getLogger("pyvene_dist").addHandler(reads)
    logging.getLogger("pyvene_dist").setLevel(logging.INFO)
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        if malloc == "check":
            return_freed_memory()
    pyvene_dist.patch()
    case = CheckCase(model=folder, steps=steps, batch_size=2 * world_size,
                     layers=representation_layers(model_config(folder)))
    strategy_name, _, quantize = strategy_name.partition("-")
    if quantize:  # "fsdp2-4bit": the base loaded in 4 bits, its storage float32 (FSDP-QLoRA's layout)
        from pyvene_dist.testing.quantized_cases import QuantizedCase

        case = QuantizedCase(**{field: getattr(case, field) for field in ("model", "steps", "batch_size", "layers")},
                             quantize=quantize)
    strategy = STRATEGIES[strategy_name]()
    loaded = {}
    reset = strategy.reset_peak_memory

    def mark_loaded():  # train() resets the peak right after the model is built, placed and wrapped
        loaded["peak"] = vm_hwm()
        reset()

    strategy.reset_peak_memory = mark_loaded
    train(case, strategy)
    mine = {"load_peak": loaded["peak"], "peak": vm_hwm(), "bytes_read": sum(read for read, _ in reads.read),
            "whole_bytes": max((whole for _, whole in reads.read), default=None)}
    everyone = [None] * (dist.get_world_size() if dist.is_initialized() else 1)
    if dist.is_initialized():
        dist.all_gather_object(everyone, mine)
    else:
        everyone = [mine]
    if not dist.is_initialized() or dist.get_rank() == 0:
        Path(out).write_text(json.dumps(everyone))


def measure(folder: str, strategy: str, world_size: int, steps: int, malloc: str) -> list[dict]:
    from pyvene_dist.testing import spawn

    with tempfile.TemporaryDirectory(prefix="pyvene-dist-loading") as workdir:
        out = Path(workdir) / "ranks.json"
        outcome = spawn(rank_main, world_size=world_size, workdir=workdir, timeout=1800,
                        args=(folder, strategy, steps, world_size, str(out), malloc))
        if outcome.failed or not out.exists():
            raise RuntimeError(f"{strategy} x{world_size} on {folder} failed:\n{outcome.report()}")
        return json.loads(out.read_text())


def save_folder(root: Path, size: str) -> Path:
    from pyvene_dist.testing.models import save_checkpoint

    folder = root / size
    if not (folder / "config.json").exists():
        save_checkpoint(str(folder), **SIZES[size])
    return folder


def model_bytes(folder: Path) -> int:
    return sum(file.stat().st_size for file in folder.glob("*.safetensors"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="206m", choices=[s for s in SIZES if s != "tiny"])
    parser.add_argument("--strategies", default="single,ddp,fsdp2,zero3")
    parser.add_argument("--world-sizes", default="2,4")
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--folders", help="keep the saved folders here (default: a scratch folder)")
    parser.add_argument("--malloc", default="check", choices=("check", "glibc"),
                        help="check: glibc's mmap threshold fixed as pyvene-dist check fixes it on CPU ranks "
                        "(check.return_freed_memory); glibc: its default, whose heaps keep freed buffers")
    parser.add_argument("--out", help="append the rows to this JSONL file")
    parser.add_argument("--smoke", action="store_true", help="the 50m folder, 2 ranks, one run")
    options = parser.parse_args(argv)
    if options.smoke:
        options.size, options.world_sizes, options.runs = "50m", "2", 1
    scratch = tempfile.TemporaryDirectory(prefix="pyvene-dist-folders")
    root = Path(options.folders or scratch.name)
    big, tiny = save_folder(root, options.size), save_folder(root, "tiny")
    size = model_bytes(big)
    rows = []
    for world in [int(w) for w in options.world_sizes.split(",")]:
        for strategy in options.strategies.split(","):
            ranks = 1 if strategy == "single" else world
            if strategy == "single" and rows and any(row["strategy"] == "single" for row in rows):
                continue
            runs = []
            for _ in range(options.runs):
                baseline = measure(str(tiny), strategy, ranks, options.steps, options.malloc)
                measured = measure(str(big), strategy, ranks, options.steps, options.malloc)
                runs.append({"peak": max(r["peak"] for r in measured), "tiny_peak": max(r["peak"] for r in baseline),
                             "load_peak": max(r["load_peak"] for r in measured),
                             "tiny_load_peak": max(r["load_peak"] for r in baseline),
                             "bytes_read": [r["bytes_read"] for r in measured]})
            shares = [(run["peak"] - run["tiny_peak"]) / size for run in runs]
            load_shares = [(run["load_peak"] - run["tiny_load_peak"]) / size for run in runs]
            row = {"measure": "load_and_first_step_peak_host_memory", "strategy": strategy, "world_size": ranks,
                   "model": f"{options.size} Llama folder (save_pretrained, float32 safetensors)",
                   "model_bytes": size, "steps": options.steps, "runs": options.runs, "malloc": options.malloc,
                   "per_run": runs,
                   "model_share": statistics.median(shares), "model_share_min": min(shares),
                   "model_share_max": max(shares), "load_model_share": statistics.median(load_shares),
                   "spread": f"{min(shares):.3f}-{max(shares):.3f} over {options.runs} runs",
                   "note": "largest rank's VmHWM on the model's folder less the tiny model's under the same strategy "
                           "(the imports), over the model's bytes; load_model_share: the same when the model is "
                           "built and wrapped, before the first step",
                   **common.metadata(torch.device("cpu"), torch.float32)}
            print(json.dumps({k: row[k] for k in ("strategy", "world_size", "model_share", "load_model_share",
                                                  "spread")}), flush=True)
            rows.append(row)
    if options.out:
        common.append_rows(options.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
