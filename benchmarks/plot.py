"""Draw the benchmark rows as PNG: throughput and peak memory per strategy, and ReFT's overhead.

    python benchmarks/plot.py benchmarks/results/scaling.jsonl benchmarks/results/overhead.jsonl --out docs/figures
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path


def read(paths):
    rows = []
    for path in paths:
        rows += [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return rows


def latest(rows):
    """The newest row of each configuration (rows differing only in timings and time are reruns)."""
    measured = {"time", "p20_ms", "p50_ms", "p80_ms", "host_p50_ms", "window_ms_per_step", "tokens_per_s",
                "peak_memory_gib", "parameter_gib", "versions", "zero_optimization"}
    newest = {}
    for row in sorted(rows, key=lambda r: r.get("time", "")):
        newest[json.dumps({k: v for k, v in row.items() if k not in measured}, sort_keys=True)] = row
    return list(newest.values())


def main(argv=None) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("jsonl", nargs="+")
    parser.add_argument("--out", default="docs/figures")
    parser.add_argument("--checkpointing", default="none", help="the scaling rows to draw")
    parser.add_argument("--only", action="append", default=[], metavar="KEY=VALUE",
                        help="keep rows whose KEY prints as VALUE (e.g. hidden=None); repeatable")
    options = parser.parse_args(argv)
    every = read(options.jsonl)
    for condition in options.only:
        key, _, value = condition.partition("=")
        every = [row for row in every if str(row.get(key)) == value]
    rows = latest(every)
    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)

    scaling = [r for r in rows if "checkpointing" in r and r.get("checkpointing", "none") == options.checkpointing]
    if scaling:
        figure, (throughput, memory) = plt.subplots(1, 2, figsize=(11, 4))
        by_strategy = defaultdict(list)
        for row in scaling:
            by_strategy[row["strategy"]].append(row)
        for strategy, runs in sorted(by_strategy.items()):
            runs.sort(key=lambda r: r["world_size"])
            throughput.plot([r["world_size"] for r in runs], [r["tokens_per_s"] for r in runs], marker="o",
                            label=strategy)
        throughput.set(xlabel="GPUs", ylabel="tokens/s", title="ReFT training throughput")
        throughput.legend()
        widest = {s: max(runs, key=lambda r: r["world_size"]) for s, runs in by_strategy.items()}
        names = sorted(widest)
        memory.bar(names, [widest[s]["peak_memory_gib"] or 0 for s in names])
        memory.set(ylabel="GiB", title=f"peak memory per GPU at {max(r['world_size'] for r in scaling)} GPUs")
        figure.tight_layout()
        figure.savefig(out / "scaling.png", dpi=120)

    runs = overhead_runs(sorted((r for r in every if "measure" in r), key=lambda r: r.get("time", "")))
    if runs:
        newest = runs[-1]
        overhead = list(newest.values())
        figure, axis = plt.subplots(figsize=(8, 4))
        labels = [f"{_wrapped(r['provider'])}\n{r['measure']}" + (f" ({r['locations']})" if r.get("locations") else "")
                  for r in overhead]
        bars = axis.bar(labels, [r["p50_ms"] for r in overhead])
        for bar, row in zip(bars, overhead):
            base = _first(newest, *REFERENCES[row["measure"]])
            if base is not None and base is not row:
                axis.annotate(f"{row['p50_ms'] / base['p50_ms']:.3f}x", (bar.get_x() + bar.get_width() / 2,
                              bar.get_height()), ha="center", va="bottom", fontsize=8)
        axis.set(ylabel="ms (p50)", title="ReFT against the bare model (forward) and LoRA (training), one GPU")
        axis.tick_params(axis="x", labelsize=7)
        figure.tight_layout()
        figure.savefig(out / "overhead.png", dpi=120)

        figure, axis = plt.subplots(figsize=(8, 4))
        series = (("pyvene_dist", "train", 1.03, "o"), ("pyvene_dist", "forward", 1.05, "s"),
                  ("pyvene_dist-eager-rotation", "train", None, "x"))  # the last: without the rotation's graphs
        for provider, measure, goal, marker in series:
            pairs = [(i, _first(run, provider, measure), _first(run, *REFERENCES[measure]))
                     for i, run in enumerate(runs)]
            points = [(i, row["p50_ms"] / base["p50_ms"]) for i, row, base in pairs if row and base]
            if points:
                line = axis.plot(*zip(*points), marker=marker, linestyle="", label=f"{provider} {measure}")[0]
                if goal is not None:
                    axis.axhline(goal, color=line.get_color(), linewidth=0.8, linestyle="--")
        axis.set(xlabel="run (oldest first, from 0)", ylabel="x reference (p50)",
                 title="ReFT / LoRA (training) and ReFT / bare (forward) per run; dashed: the goals")
        axis.legend(loc="upper right")
        figure.tight_layout()
        figure.savefig(out / "overhead-runs.png", dpi=120)
    return 0


#: What each overhead measurement is compared with: (provider, measure).
REFERENCES = {"train": ("peft-lora", "train"), "forward": ("bare", "forward")}


def overhead_runs(rows):
    """Overhead rows (oldest first) split into runs, each ``{(provider, measure, locations): row}``: a run
    ends where such a key repeats."""
    runs, current = [], {}
    for row in rows:
        key = (row["provider"], row["measure"], row.get("locations"))
        if key in current:
            runs.append(current)
            current = {}
        current[key] = row
    if current:
        runs.append(current)
    return runs


def _wrapped(name: str) -> str:
    """A provider's name on lines of at most 14 characters, broken after hyphens."""
    import textwrap

    return "\n".join(textwrap.wrap(name, 14, break_on_hyphens=True))


def _first(run, provider, measure):
    """The run's first row of ``provider``'s ``measure`` (for a forward, the list-location one), or None."""
    return next((row for (p, m, _), row in run.items() if (p, m) == (provider, measure)), None)


if __name__ == "__main__":
    raise SystemExit(main())
