"""What the fingerprint guard adds to ``patch()``: in a fresh process per run (as a user's script pays it once),
torch, transformers and pyvene imported first, then ``patch()`` timed whole and the guard's part of it
(``versions.check``: reading the source of every function the selected fixes depend on and comparing its
fingerprint with the table) timed inside it.

    python benchmarks/patch_guard.py --runs 7 --out benchmarks/results/patch-guard-cpu.jsonl

One row per invocation: each run's patch() and guard milliseconds, their medians and ranges, and the guard's share.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import common  # noqa: E402

#: One run: the imports a user's script has made before ``patch()``, then ``patch()`` with its guard timed apart.
_RUN = """
import json, time
import torch, transformers, pyvene  # noqa: F401
import pyvene_dist
from pyvene_dist import versions

check, spent = versions.check, []

def timed_check(*args, **kwargs):
    start = time.perf_counter()
    try:
        return check(*args, **kwargs)
    finally:
        spent.append(time.perf_counter() - start)

versions.check = timed_check
start = time.perf_counter()
pyvene_dist.patch()
total = time.perf_counter() - start
print(json.dumps({"patch_ms": total * 1e3, "guard_ms": sum(spent) * 1e3}))
import gc
gc.freeze()  # the collections at exit then skip the imports' objects (1.7 s on 2 cores; 0.2 s so)
"""


def one_run() -> dict:
    done = subprocess.run([sys.executable, "-c", _RUN], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--out", type=Path, help="append the row to this JSONL file")
    options = parser.parse_args(argv)
    runs = [one_run() for _ in range(options.runs)]
    patch_ms, guard_ms = ([run[key] for run in runs] for key in ("patch_ms", "guard_ms"))
    row = {
        "measure": "patch_guard_cpu", "runs": options.runs,
        "patch_ms": patch_ms, "guard_ms": guard_ms,
        "patch_median_ms": statistics.median(patch_ms), "guard_median_ms": statistics.median(guard_ms),
        "patch_range_ms": [min(patch_ms), max(patch_ms)], "guard_range_ms": [min(guard_ms), max(guard_ms)],
        "guard_share": statistics.median(g / p for g, p in zip(guard_ms, patch_ms)),
        **common.metadata(common.torch.device("cpu"), "float32"),
    }
    print(json.dumps({key: row[key] for key in ("patch_median_ms", "guard_median_ms", "patch_range_ms",
                                                "guard_range_ms", "guard_share")}))
    if options.out:
        common.append_rows(options.out, [row])


if __name__ == "__main__":
    main()
