"""How long the README's "Try it on CPU" takes: its commands as written, in order, in a fresh folder.

    python benchmarks/try_it.py --runs 3 --out benchmarks/results/try-it-cpu.jsonl

The commands are read from the README (``tests/docs/test_readme.py``'s ``example_commands``, the block the
test runs) and run with ``shell=True`` in a temporary folder holding links to this checkout's ``.venv`` and
``docs``, so ``.venv/bin/...`` and ``docs/examples/...`` mean what they mean at the repository root and
``out/`` is new each run. Each run is timed from the first command's start to the last one's end; the row
keeps every run's total and each command's time, with the host's load before the first run.
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

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(ROOT / "tests" / "docs"))
import common  # noqa: E402
from test_readme import example_commands  # noqa: E402


def one_run(commands: list[str]) -> list[float]:
    """Each command's seconds, run in a fresh folder; SystemExit with its output when one fails."""
    times = []
    with tempfile.TemporaryDirectory() as folder:
        for name in (".venv", "docs"):
            (Path(folder) / name).symlink_to(ROOT / name)
        for command in commands:
            started = time.perf_counter()
            result = subprocess.run(command, shell=True, cwd=folder, capture_output=True, text=True)
            times.append(time.perf_counter() - started)
            if result.returncode:
                raise SystemExit(f"{command!r} exited {result.returncode}:\n{result.stderr[-3000:]}")
    return times


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/try-it-cpu.jsonl")
    parser.add_argument("--note", default="", help="what else the machine was doing, kept in the row")
    options = parser.parse_args(argv)
    import torch

    meta = common.metadata(torch.device("cpu"), torch.float32)
    meta.pop("dtype")
    commands = example_commands()
    per_command = [one_run(commands) for _ in range(options.runs)]
    totals = [sum(times) for times in per_command]
    row = {"measure": "readme_try_it_cpu", "commands": commands, "runs": options.runs, "seconds": totals,
           "per_command_s": per_command, "median_s": statistics.median(totals), "min_s": min(totals),
           "max_s": max(totals), "spread": f"{min(totals):.1f}-{max(totals):.1f} s over {options.runs} runs",
           **meta, **({"note": options.note} if options.note else {})}
    common.append_rows(options.out, [row])
    print(f"median {row['median_s']:.1f} s ({row['spread']}); per command, each run: "
          + "; ".join(", ".join(f"{seconds:.1f}" for seconds in times) for times in per_command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
