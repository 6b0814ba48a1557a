"""Draw the benchmark rows as PNG: throughput and peak memory per strategy, and ReFT's overhead.

    python benchmarks/plot.py benchmarks/results/scaling.jsonl benchmarks/results/overhead.jsonl --out docs/figures
    python benchmarks/plot.py benchmarks/results/compiled-1xH200.jsonl --ratios compiled --goal 1.03 --out docs/figures
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
                "peak_memory_gib", "parameter_gib", "versions", "zero_optimization", "commit", "gpu", "median_ms",
                "spread", "steps_timed", "round_medians_ms", "ratio", "ratio_rounds", "ratio_median", "ratio_min",
                "ratio_max", "host_minus_baseline_ms", "ms_per_token", "compile_s", "graph_breaks", "break_reasons",
                "graphs_compiled", "graphs_compiled_while_timing", "differs_from_bare", "same_as_stock"}
    newest = {}
    for row in sorted(rows, key=lambda r: r.get("time", "")):
        newest[json.dumps({k: v for k, v in row.items() if k not in measured}, sort_keys=True)] = row
    return list(newest.values())


def main(argv=None) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("jsonl", nargs="+")
    parser.add_argument("--out", default="docs/figures")
    parser.add_argument("--checkpointing", default="none", help="the scaling rows to draw")
    parser.add_argument("--ratios", metavar="NAME", help="also draw ratios-NAME.png: every row's ratio to its "
                        "baseline (the rows of compiled.py, sharded.py, generation.py, overhead.py)")
    parser.add_argument("--goal", type=float, help="the goal line on the ratios figure")
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

    scaling = [r for r in rows if "measure" not in r and "tokens_per_s" in r
               and r.get("checkpointing", "none") == options.checkpointing]
    if scaling:
        figure, (throughput, memory) = plt.subplots(1, 2, figsize=(11, 4))
        by_strategy = defaultdict(list)
        for row in scaling:
            by_strategy[row["strategy"]].append(row)
        for strategy, runs in sorted(by_strategy.items()):
            runs.sort(key=lambda r: r["world_size"])
            sizes, rates = [r["world_size"] for r in runs], [r["tokens_per_s"] for r in runs]
            line = throughput.errorbar(sizes, rates, yerr=_throughput_spread(runs), marker="o", capsize=3,
                                       label=strategy)[0]
            if strategy == "ddp" and sizes[0] == 1:  # what perfect scaling of the one-GPU run would give
                throughput.plot(sizes, [rates[0] * size for size in sizes], linestyle=":", color=line.get_color(),
                                label="ddp, ideal (1 GPU x GPUs)")
        throughput.set(xlabel="GPUs", ylabel="tokens/s",
                       title="ReFT training throughput (bars: p20-p80 of step times)")
        throughput.xaxis.set_major_locator(MaxNLocator(integer=True))
        throughput.legend()
        widest = {s: max(runs, key=lambda r: r["world_size"]) for s, runs in by_strategy.items()}
        names = sorted(widest)
        memory.bar(names, [widest[s]["peak_memory_gib"] or 0 for s in names])
        memory.set(ylabel="GiB", title=f"peak memory per GPU at {max(r['world_size'] for r in scaling)} GPUs")
        figure.tight_layout()
        figure.savefig(out / "scaling.png", dpi=120)

    runs = overhead_runs(sorted((r for r in every if "locations" in r and r.get("model", DEFAULT_MODEL) == DEFAULT_MODEL),
                                key=lambda r: r.get("time", "")))
    if runs:
        newest = runs[-1]
        overhead = list(newest.values())
        figure, axis = plt.subplots(figsize=(8, 4))
        labels = [f"{_wrapped(r['provider'])}\n{r['measure']}" + (f" ({r['locations']})" if r.get("locations") else "")
                  for r in overhead]
        medians = [_median(r) for r in overhead]
        bars = axis.bar(labels, medians, yerr=[[m - r["p20_ms"] for m, r in zip(medians, overhead)],
                                               [r["p80_ms"] - m for m, r in zip(medians, overhead)]], capsize=3)
        for bar, row in zip(bars, overhead):
            base = _first(newest, *REFERENCES[row["measure"]])
            if base is not None and base is not row:
                axis.annotate(f"{_median(row) / _median(base):.3f}x\n{_short(base['provider'])}",
                              (bar.get_x() + bar.get_width() / 2, row["p80_ms"]), ha="center", va="bottom", fontsize=7)
        axis.set(ylabel="ms (median; bars p20-p80)",
                 title="ReFT against the bare model (forward) and LoRA (training), one GPU")
        axis.tick_params(axis="x", labelsize=7)
        figure.tight_layout()
        figure.savefig(out / "overhead.png", dpi=120)

        figure, axis = plt.subplots(figsize=(8, 4))
        series = (("pyvene_dist", "train", 1.03, "o"), ("pyvene_dist", "forward", 1.05, "s"),
                  ("pyvene_dist-eager-rotation", "train", None, "x"))  # the last: without the rotation's graphs
        for provider, measure, goal, marker in series:
            pairs = [(i, _first(run, provider, measure), _first(run, *REFERENCES[measure]))
                     for i, run in enumerate(runs)]
            points = [(i, _median(row) / _median(base), row) for i, row, base in pairs if row and base]
            if points:
                xs, ys, measured = zip(*points)
                spread = [[y - r.get("ratio_min", y) for y, r in zip(ys, measured)],
                          [r.get("ratio_max", y) - y for y, r in zip(ys, measured)]]
                line = axis.errorbar(xs, ys, yerr=spread, marker=marker, linestyle="", capsize=3,
                                     label=f"{provider} {measure} / {REFERENCES[measure][0]}")[0]
                if goal is not None:
                    axis.axhline(goal, color=line.get_color(), linewidth=0.8, linestyle="--")
        axis.set(xlabel="run (oldest first, from 0)", ylabel="x reference (median; bars: rounds' min-max)",
                 title="ReFT / LoRA (training) and ReFT / bare (forward) per run; dashed: the goals")
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))
        axis.legend(loc="upper right")
        figure.tight_layout()
        figure.savefig(out / "overhead-runs.png", dpi=120)

    if options.ratios:
        compared = [r for r in rows if "baseline" in r]
        if compared:
            draw_ratios(plt, compared, out / f"ratios-{options.ratios}.png", options.goal)
    return 0


def draw_ratios(plt, rows, path, goal=None):
    """Each row's ratio to its baseline (named on the label): the median of the round-by-round ratios, bars
    from the smallest to the largest round; the ratio of medians where rounds were not recorded."""
    figure, axis = plt.subplots(figsize=(8, 0.6 * len(rows) + 1.5))
    labels, values, low, high = [], [], [], []
    for row in rows:
        value = row.get("ratio_median", row["ratio"])
        labels.append(f"{row['provider']} {row.get('measure', '')} {row.get('strategy', '')}"
                      f" {row.get('batch')}x{row.get('seq_len')}\n/ {row['baseline']}")
        values.append(value)
        low.append(value - row.get("ratio_min", value))
        high.append(row.get("ratio_max", value) - value)
    axis.errorbar(values, range(len(rows)), xerr=[low, high], marker="o", linestyle="", capsize=3)
    axis.axvline(1.0, color="grey", linewidth=0.8)
    if goal:
        axis.axvline(goal, color="red", linewidth=0.8, linestyle="--", label=f"goal {goal}")
        axis.legend(loc="lower right")
    axis.set_yticks(range(len(rows)), labels, fontsize=7)
    axis.invert_yaxis()
    axis.set(xlabel="x baseline (median of rounds; bars: min-max over rounds)")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def _median(row):
    return row.get("median_ms", row["p50_ms"])  # rows before benchmarks/common.py carry p50 only


def _short(provider):
    return {"peft-lora": "LoRA", "bare": "bare"}.get(provider, provider)


def _throughput_spread(runs):
    """The window's tokens/s spread as its step times spread: p20-p80 of the drained steps, scaled to it."""
    low = [r["tokens_per_s"] * (1 - r["p50_ms"] / r["p80_ms"]) if r.get("p80_ms") else 0 for r in runs]
    high = [r["tokens_per_s"] * (r["p50_ms"] / r["p20_ms"] - 1) if r.get("p20_ms") else 0 for r in runs]
    return [low, high]


#: overhead.py's default model: the runs drawn in overhead.png and overhead-runs.png (rows before the option
#: carry no ``model``).
DEFAULT_MODEL = "llama-3.2-1b"
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
