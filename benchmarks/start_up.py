"""How long a world of ranks takes to start: spawned (each rank imports torch, transformers and pyvene) against
forked from the preloaded server (``pyvene_dist.testing._preloaded``), side by side in one run, as ratios.

    python benchmarks/start_up.py --out benchmarks/results/suite-time-cpu.jsonl
    python benchmarks/start_up.py --check     # also the README's `pyvene-dist check`, each way (minutes)

Each round starts one world of ``--world-size`` ranks each way, in turns, and times it until every rank has
run a body that patches pyvene and returns (``testing.launch.spawn``). The first forked world also starts the
server: it is timed apart (``server_start_s``), and the rounds time the worlds after it. ``--check`` times
``pyvene-dist check`` as the README gives it, with ``PYVENE_DIST_FORKSERVER`` off and on, in turns.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import common  # noqa: E402

from pyvene_dist.testing import _preloaded  # noqa: E402
from pyvene_dist.testing.launch import spawn  # noqa: E402

WAYS = {"spawned": "0", "forked": "1"}


def _body() -> None:
    import pyvene  # noqa: F401

    import pyvene_dist

    pyvene_dist.patch()


def _world(way: str, world_size: int, workdir: str) -> float:
    os.environ[_preloaded.VARIABLE] = WAYS[way]
    try:
        started = time.perf_counter()
        outcome = spawn(_body, world_size=world_size, workdir=workdir)
        seconds = time.perf_counter() - started
    finally:
        os.environ.pop(_preloaded.VARIABLE)
    if outcome.failed:
        raise SystemExit(outcome.report())
    return seconds


def _check(way: str) -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "pyvene_dist", "check"], check=True, capture_output=True,
                   env={**os.environ, _preloaded.VARIABLE: WAYS[way]})
    return time.perf_counter() - started


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--check", action="store_true", help="also time `pyvene-dist check`, each way")
    parser.add_argument("--check-rounds", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/suite-time-cpu.jsonl")
    options = parser.parse_args(argv)
    import torch

    meta = {**common.metadata(torch.device("cpu"), torch.float32), "commit": common.commit(),
            "run_id": common.run_id(), "versions": common.versions(),
            "date": time.strftime("%Y-%m-%d", time.gmtime()), "time": time.strftime("%Y-%m-%dT%H:%M:%S+00:00",
                                                                                   time.gmtime())}
    meta.pop("dtype", None)
    with tempfile.TemporaryDirectory() as workdir:
        server_start = _world("forked", options.world_size, workdir)  # starts the server
        times = {way: [] for way in WAYS}
        for _ in range(options.rounds):
            for way in WAYS:
                times[way].append(_world(way, options.world_size, workdir))
    rows = []
    for way, seconds in times.items():
        rows.append({"measure": "world_start", "provider": way, "world_size": options.world_size,
                     "rounds": options.rounds, "seconds": seconds, "median_s": statistics.median(seconds),
                     "min_s": min(seconds), "max_s": max(seconds), **meta})
    rows[1]["server_start_s"] = server_start
    rows[1]["ratio_to_spawned"] = rows[1]["median_s"] / rows[0]["median_s"]
    if options.check:
        checks = {way: [] for way in WAYS}
        for _ in range(options.check_rounds):
            for way in WAYS:
                checks[way].append(_check(way))
        for way, seconds in checks.items():
            rows.append({"measure": "pyvene_dist_check", "provider": way, "command": "pyvene-dist check",
                         "rounds": options.check_rounds, "seconds": seconds, "median_s": statistics.median(seconds),
                         "min_s": min(seconds), "max_s": max(seconds), **meta})
        rows[-1]["ratio_to_spawned"] = rows[-1]["median_s"] / rows[-2]["median_s"]
    common.append_rows(options.out, rows)
    for row in rows:
        print(f"{row['measure']:>18} {row['provider']:>8}: median {row['median_s']:.2f} s "
              f"({row['min_s']:.2f}-{row['max_s']:.2f}, {row['rounds']} rounds)"
              + (f"; {row['ratio_to_spawned']:.3f} x spawned" if "ratio_to_spawned" in row else ""), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
