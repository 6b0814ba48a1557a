"""Every figure in docs/figures says which rows it plots, and they are the newest rows of its benchmark.

``benchmarks/plot.py`` stamps each PNG with text chunks: ``Source`` (the results file), ``Commit`` (the newest
commit drawn) and ``Commits`` (every commit drawn). The newest commit of a results file is the commit of its row
with the latest ``time``; a figure drawn before newer rows were added names an older one and fails here, until
``python benchmarks/plot.py`` draws it again. These checks read the PNGs' text chunks only, drawing nothing;
the last test draws into a temporary folder to check plot.py itself.
"""

from __future__ import annotations

import json
import re
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FIGURES = ROOT / "docs" / "figures"


def png_text(path: Path) -> dict[str, str]:
    """The text chunks (tEXt, zTXt, iTXt) of a PNG file."""
    data, text, at = path.read_bytes(), {}, 8
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise AssertionError(f"{path} is not a PNG file")
    while at + 8 <= len(data):
        length, kind = struct.unpack(">I4s", data[at:at + 8])
        body, at = data[at + 8:at + 8 + length], at + 12 + length
        if kind == b"tEXt":
            key, _, value = body.partition(b"\0")
            text[key.decode("latin-1")] = value.decode("latin-1")
        elif kind == b"zTXt":
            key, _, value = body.partition(b"\0")
            text[key.decode("latin-1")] = zlib.decompress(value[1:]).decode("latin-1")
        elif kind == b"iTXt":
            key, _, rest = body.partition(b"\0")
            compressed, rest = rest[0], rest[2:]
            value = rest.split(b"\0", 2)[2]
            text[key.decode("latin-1")] = (zlib.decompress(value) if compressed else value).decode("utf-8")
    return text


def stale(png: Path, root: Path = ROOT) -> list[str]:
    """What is wrong with a figure's stamp: none, a source that is not a results file, a commit none of its rows
    has, or a commit older than the newest of its rows."""
    text = png_text(png)
    if "Source" not in text or "Commit" not in text:
        return [f"{png.name} carries no Source and Commit (found {sorted(text)}): draw it with benchmarks/plot.py"]
    source = root / text["Source"]
    if not source.is_file():
        return [f"{png.name} names {text['Source']} as its rows, but there is no such file"]
    rows = [json.loads(line) for line in source.read_text().splitlines() if line.strip()]
    commits = {row.get("commit") for row in rows}
    drawn = [text["Commit"], *text.get("Commits", "").split(", ")]
    problems = [f"{png.name} plots commit {commit}, which no row of {text['Source']} has"
                for commit in dict.fromkeys(drawn) if commit and commit not in commits]
    newest = max(rows, key=lambda row: row["time"])["commit"]
    if text["Commit"] != newest:
        problems.append(f"{png.name} plots commit {text['Commit']}, but the newest rows of {text['Source']} are "
                        f"{newest}'s: draw it again with benchmarks/plot.py")
    return problems


@pytest.mark.parametrize("png", sorted(FIGURES.glob("*.png")), ids=lambda path: path.name)
def test_every_figure_plots_the_newest_rows_of_its_benchmark(png):
    problems = stale(png)
    assert not problems, "\n".join(problems)


def test_every_figure_is_shown_and_every_figure_shown_exists():
    """A figure dropped for want of current rows leaves no reference behind, and no figure lies unused."""
    pages = [*sorted((ROOT / "docs").rglob("*.md")), ROOT / "README.md"]
    shown = {(page.parent / link).resolve(): page for page in pages
             for link in re.findall(r"\]\(([^)\s]*figures/[^)\s]+\.png)\)", page.read_text())}
    missing = [f"{page.relative_to(ROOT)} shows {path.relative_to(ROOT)}" for path, page in shown.items()
               if not path.is_file()]
    unused = [png.name for png in sorted(FIGURES.glob("*.png")) if png.resolve() not in shown]
    assert not missing and not unused, f"missing figures: {missing}; figures no page shows: {unused}"


def test_plot_stamps_the_newest_rows_and_a_newer_row_makes_the_figure_stale(tmp_path):
    """plot.py draws the newest commit's rows (both runs at it, not the older commit's), stamps them, draws a
    scaling file too, and removes a figure whose rows are gone; a row added after drawing makes ``stale`` report
    the figure."""
    pytest.importorskip("matplotlib")
    results, out = tmp_path / "results", tmp_path / "figures"
    results.mkdir()
    out.mkdir()
    (out / "ratios-generation.png").write_bytes(b"left from an old run")

    def row(commit, run, time, strategy, ratio=None):
        return {"commit": commit, "run_id": run, "time": f"2026-12-0{time}:00+00:00", "machine": "1 x H200",
                "rounds": 9, "strategy": strategy, "measure": "train", "batch": 8, "seq_len": 512,
                **({"provider": "peft-lora"} if ratio is None else
                   {"provider": "pyvene_dist", "baseline": "peft-lora", "ratio": ratio, "ratio_median": ratio,
                    "ratio_min": ratio - 0.1, "ratio_max": ratio + 0.1})}

    rows = [row("aaaaaaa", "old", "1T01:00", "zero3"), row("aaaaaaa", "old", "1T01:00", "zero3", 1.2),
            row("bbbbbbb", "new-1", "3T01:00", "zero3"), row("bbbbbbb", "new-1", "3T01:00", "zero3", 1.0),
            row("bbbbbbb", "new-2", "3T02:00", "fsdp2"), row("bbbbbbb", "new-2", "3T02:00", "fsdp2", 0.99)]
    sharded = results / "sharded-1xH200.jsonl"
    sharded.write_text("".join(json.dumps(r) + "\n" for r in rows))
    scaling = [{"commit": "ddddddd", "run_id": "2gpu", "time": "2026-12-02T01:00:00+00:00", "machine": "2 x H200",
                "strategy": "ddp", "batch": 8, "seq_len": 512, "world_size": size, "tokens_per_s": 1000.0 * size,
                "p20_ms": 9.0, "p50_ms": 10.0, "p80_ms": 12.0} for size in (1, 2)]
    (results / "ddp-scaling-2xH200.jsonl").write_text("".join(json.dumps(r) + "\n" for r in scaling))
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "plot.py"), "--results", str(results),
                    "--out", str(out)], check=True, timeout=300)

    assert sorted(path.name for path in out.iterdir()) == ["ddp-scaling.png", "ratios-sharded.png"]
    assert png_text(out / "ddp-scaling.png")["Commit"] == "ddddddd"
    text = png_text(out / "ratios-sharded.png")
    assert {key: text.get(key) for key in ("Source", "Commit", "Commits", "Runs", "Dates")} == {
        "Source": str(sharded), "Commit": "bbbbbbb", "Commits": "bbbbbbb", "Runs": "new-1, new-2",
        "Dates": "2026-12-03"}
    assert stale(out / "ratios-sharded.png", root=Path("/")) == []

    sharded.write_text(sharded.read_text() + json.dumps(row("ccccccc", "newer", "4T01:00", "zero3")) + "\n")
    assert stale(out / "ratios-sharded.png", root=Path("/")) == [
        f"ratios-sharded.png plots commit bbbbbbb, but the newest rows of {sharded} are ccccccc's: "
        "draw it again with benchmarks/plot.py"]
