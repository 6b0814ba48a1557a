"""Draw every figure in docs/figures from the rows in benchmarks/results, each stamped with the rows it plots.

    python benchmarks/plot.py                                   # FIGURES, from benchmarks/results into docs/figures
    python benchmarks/plot.py --results DIR --out DIR

Which rows: each figure draws one results file (``FIGURES`` names it). Its newest rows are those of the newest
commit in the file, the commit of the row with the latest ``time``; where several runs measured that commit,
each run is drawn and labelled with its run id. ``overhead.png`` draws the newest of those runs alone, and
``overhead-runs.png`` every run in the file, oldest first. Rows in ``results/archive/`` (no commit recorded) are
never drawn: a figure whose file has no rows is not drawn, and an old copy of it in the output folder is
removed rather than left stale.

Each PNG says which rows it plots: in a caption under the plot (the file, and per run its commit, date,
machine and rounds), and in its PNG text chunks, which ``tests/docs/test_figures.py`` reads: ``Source`` (the
results file, relative to the repository), ``Commit`` (the newest commit drawn), ``Commits``, ``Runs`` and
``Dates`` (every one drawn, comma-separated, oldest first).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import textwrap
from collections import defaultdict
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def newest(rows: list[dict]) -> list[dict]:
    """The rows of the newest commit: the commit of the row with the latest ``time`` (rows of every run at it)."""
    commit = max(rows, key=lambda row: row["time"])["commit"]
    return [row for row in rows if row["commit"] == commit]


def newest_run(rows: list[dict]) -> list[dict]:
    """The rows of the newest run at the newest commit."""
    return list(by_run(newest(rows)).values())[-1]


def every(rows: list[dict]) -> list[dict]:
    return rows


def by_run(rows: list[dict]) -> dict[str, list[dict]]:
    """Rows grouped by run id, runs oldest first (by their first row's time)."""
    runs: dict[str, list[dict]] = defaultdict(list)
    for row in sorted(rows, key=lambda row: row["time"]):
        runs[row["run_id"]].append(row)
    return dict(runs)


def stamp(rows: list[dict], source: str) -> tuple[str, dict[str, str]]:
    """The caption and the PNG text chunks that say which rows a figure plots."""
    runs = by_run(rows)
    firsts = [run[0] for run in runs.values()]
    lines = [f"rows: {source}"] + [
        f"commit {row['commit']}, {row['time'][:16].replace('T', ' ')} UTC, {row['machine']}, run {run_id}"
        + (f", {row['rounds']} rounds" if row.get("rounds") else "")
        for run_id, row in zip(runs, firsts)]
    commits = list(dict.fromkeys(row["commit"] for row in firsts))
    metadata = {"Source": source, "Commit": firsts[-1]["commit"], "Commits": ", ".join(commits),
                "Runs": ", ".join(runs), "Dates": ", ".join(dict.fromkeys(row["time"][:10] for row in firsts))}
    return "\n".join(lines), metadata


def draw_ratios(plt, rows: list[dict], goal: float | None, title: str):
    """Each row's ratio to its baseline (named on its label): the ratio of the medians (o) and the median of
    the rounds' ratios (x), bars from the smallest to the largest round's ratio."""
    compared = [row for row in rows if row.get("baseline") and row.get("ratio") is not None]
    several = len(by_run(rows)) > 1
    figure, axis = plt.subplots(figsize=(8, 0.55 * len(compared) + 2.2))
    labels = []
    for y, row in enumerate(compared):
        value = row["ratio"]
        low, high = row.get("ratio_min", value), row.get("ratio_max", value)
        axis.errorbar([value], [y], xerr=[[value - low], [high - value]], marker="o", color="C0", capsize=3,
                      label="ratio of medians (bars: rounds' min-max)" if y == 0 else None)
        if row.get("ratio_median") is not None:
            axis.plot([row["ratio_median"]], [y], marker="x", color="C1", linestyle="",
                      label="median of the rounds' ratios" if y == 0 else None)
        shape = f"{row.get('batch')}x{row.get('seq_len')}" if row.get("seq_len") else ""
        shape += f" +{row['new_tokens']} new" if row.get("new_tokens") else ""
        labels.append(f"{row['provider']} {row.get('measure', '')} {row.get('strategy', '')} {shape}"
                      f"\n/ {row['baseline']}" + (f"  (run {row['run_id']})" if several else ""))
    axis.axvline(1.0, color="grey", linewidth=0.8)
    if goal:
        axis.axvline(goal, color="red", linewidth=0.8, linestyle="--", label=f"goal {goal}")
    axis.set_yticks(range(len(compared)), labels, fontsize=7)
    axis.invert_yaxis()
    axis.set(xlabel="x baseline", title=title)
    axis.legend(loc="upper center", bbox_to_anchor=(0.5, -0.6 / figure.get_figheight()), ncol=3, fontsize=7)
    return figure


#: What each overhead measurement is compared with: (provider, measure).
REFERENCES = {"train": ("peft-lora", "train"), "forward": ("bare", "forward")}


def _reference(run: list[dict], measure: str) -> dict | None:
    provider, measure = REFERENCES[measure]
    return next((row for row in run if (row["provider"], row["measure"]) == (provider, measure)), None)


def draw_overhead(plt, rows: list[dict], goal: float | None, title: str):
    """One run's steps in ms (median, bars p20-p80), each ReFT bar annotated with its ratio."""
    (run,) = by_run(rows).values()
    figure, axis = plt.subplots(figsize=(8, 4.2))
    labels = ["\n".join(textwrap.wrap(row["provider"], 14, break_on_hyphens=True)) + f"\n{row['measure']}"
              + (f" ({row['locations']})" if row.get("locations") else "") for row in run]
    medians = [row["median_ms"] for row in run]
    bars = axis.bar(labels, medians, yerr=[[m - r["p20_ms"] for m, r in zip(medians, run)],
                                           [r["p80_ms"] - m for m, r in zip(medians, run)]], capsize=3)
    for bar, row in zip(bars, run):
        base = _reference(run, row["measure"])
        if base is not None and base is not row:
            axis.annotate(f"{row['median_ms'] / base['median_ms']:.3f}x\n{base['provider']}",
                          (bar.get_x() + bar.get_width() / 2, row["p80_ms"]), ha="center", va="bottom", fontsize=7)
    axis.set_ylim(top=1.15 * max(row["p80_ms"] for row in run))
    axis.set(ylabel="ms (median; bars p20-p80)",
             title=title)
    axis.tick_params(axis="x", labelsize=7)
    return figure


def draw_overhead_runs(plt, rows: list[dict], goal: float | None, title: str):
    """Every run's ReFT / LoRA (training) and ReFT / bare (forward), oldest first, bars the rounds' min-max."""
    runs = list(by_run(rows).values())
    figure, axis = plt.subplots(figsize=(8, 4.2))
    series = (("pyvene_dist", "train", 1.03, "o"), ("pyvene_dist", "forward", 1.05, "s"),
              ("pyvene_dist-eager-rotation", "train", None, "x"))  # the last: without the rotation's graphs
    for offset, (provider, measure, line_goal, marker) in zip((-0.08, 0.0, 0.08), series):
        points = [(x + offset, row) for x, run in enumerate(runs) for row in run
                  if (row["provider"], row["measure"]) == (provider, measure) and row.get("baseline")]
        if not points:
            continue
        xs, measured = zip(*points)
        ys = [row["ratio"] for row in measured]
        spread = [[y - r.get("ratio_min", y) for y, r in zip(ys, measured)],
                  [r.get("ratio_max", y) - y for y, r in zip(ys, measured)]]
        line = axis.errorbar(xs, ys, yerr=spread, marker=marker, linestyle="", capsize=3,
                             label=f"{provider} {measure} / {measured[0]['baseline']}")[0]
        if line_goal is not None:
            axis.axhline(line_goal, color=line.get_color(), linewidth=0.8, linestyle="--")
    axis.set_xticks(range(len(runs)), [f"{run[0]['commit']}\n{run[0]['time'][:10]}" for run in runs], fontsize=7)
    axis.set(xlabel="run (oldest first)", ylabel="x reference (ratio of medians; bars: rounds' min-max)",
             title=title)
    axis.legend(loc="upper right", fontsize=7)
    return figure


def draw_scaling(plt, rows: list[dict], goal: float | None, title: str):
    """Tokens/s over world sizes per strategy and per-GPU batch (bars: p20-p80 of step times), DDP's ideal."""
    figure, axis = plt.subplots(figsize=(8, 4.2))
    lines = defaultdict(list)
    for row in rows:
        if "tokens_per_s" in row and "measure" not in row:
            lines[(row["strategy"], row["batch"], row["seq_len"])].append(row)
    for (strategy, batch, seq_len), runs in sorted(lines.items()):
        runs.sort(key=lambda r: r["world_size"])
        sizes, rates = [r["world_size"] for r in runs], [r["tokens_per_s"] for r in runs]
        low = [r["tokens_per_s"] * (1 - r["p50_ms"] / r["p80_ms"]) for r in runs]
        high = [r["tokens_per_s"] * (r["p50_ms"] / r["p20_ms"] - 1) for r in runs]
        line = axis.errorbar(sizes, rates, yerr=[low, high], marker="o", capsize=3,
                             label=f"{strategy} {batch}x{seq_len}")[0]
        if strategy == "ddp" and sizes[0] == 1:  # what perfect scaling of the one-GPU run would give
            axis.plot(sizes, [rates[0] * size for size in sizes], linestyle=":", color=line.get_color())
    axis.set(xlabel="GPUs", ylabel="tokens/s", title=title)
    axis.set_xticks(sorted({r["world_size"] for runs in lines.values() for r in runs}))
    axis.legend(fontsize=7)
    return figure


@dataclasses.dataclass(frozen=True)
class Figure:
    name: str  # the PNG in the output folder
    results: str  # the rows it draws, a file in the results folder
    draw: Callable
    title: str
    goal: float | None = None
    select: Callable[[list[dict]], list[dict]] = newest  # which of the file's rows it draws


FIGURES = (
    Figure("overhead.png", "overhead-1xH200.jsonl", draw_overhead,
           "ReFT against the bare model (forward) and LoRA (training), one GPU", select=newest_run),
    Figure("overhead-runs.png", "overhead-1xH200.jsonl", draw_overhead_runs,
           "ReFT / LoRA (training) and ReFT / bare (forward) per run; dashed: the goals", select=every),
    Figure("ratios-compiled.png", "compiled-1xH200.jsonl", draw_ratios, "torch.compile: ReFT over LoRA", goal=1.03),
    Figure("ratios-sharded.png", "sharded-1xH200.jsonl", draw_ratios, "FSDP2 and ZeRO-3 at world size 1: ReFT "
           "over LoRA", goal=1.03),
    Figure("ratios-large-7b.png", "large-7b-1xH200.jsonl", draw_ratios, "7B-class, checkpointing: ReFT over LoRA "
           "and the bare model", goal=1.02),
    Figure("ratios-generation.png", "generation-1xH200.jsonl", draw_ratios, "every-token generation: time per "
           "token over the bare model's", goal=1.10),
    # `bash benchmarks/run_h200.sh ddp-scaling ddp-scaling-32` on 2 GPUs; none at a recorded commit yet
    Figure("ddp-scaling.png", "ddp-scaling-2xH200.jsonl", draw_scaling,
           "ReFT training throughput (dotted: DDP's ideal)"),
)


def main(argv=None) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "figures")
    options = parser.parse_args(argv)
    options.out.mkdir(parents=True, exist_ok=True)
    results = options.results.resolve()
    for spec in FIGURES:
        path, png = results / spec.results, options.out / spec.name
        rows = read(path) if path.is_file() else []
        if not rows:
            if png.exists():
                png.unlink()
                print(f"{png}: removed, no rows in {path}")
            continue
        drawn = spec.select(rows)
        source = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)
        caption, metadata = stamp(drawn, source)
        figure = spec.draw(plt, drawn, spec.goal, spec.title)
        height = figure.get_figheight()
        caption_in = 0.16 * (caption.count("\n") + 1) + 0.1
        figure.set_figheight(height + caption_in)
        figure.tight_layout(rect=(0, caption_in / (height + caption_in), 1, 1))
        figure.text(0.01, 0.01, caption, fontsize=6.5, family="monospace", va="bottom")
        figure.savefig(png, dpi=120, metadata=metadata)
        plt.close(figure)
        print(f"{png}: {metadata['Source']}, commit {metadata['Commit']}, runs {metadata['Runs']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
