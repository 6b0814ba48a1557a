"""The benchmark scripts run (CPU smoke mode) and write their rows; no timing is asserted."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).parents[1] / "benchmarks"
pytestmark = pytest.mark.slow


def test_scaling_smoke_writes_rows_and_profiles(tmp_path):
    out, profiles = tmp_path / "scaling.jsonl", tmp_path / "profiles"
    subprocess.run([sys.executable, str(BENCHMARKS / "scaling.py"), "--smoke", "--strategies", "ddp,fsdp2,zero3",
                    "--out", str(out), "--profile", str(profiles)], check=True, timeout=600)
    expected = {f"{s}-x{w}-rank{r}.txt" for s in ("ddp", "fsdp2", "zero3") for w in (1, 2) for r in range(w)}
    assert {path.name for path in profiles.iterdir()} == expected
    assert all("aten::mm" in (profiles / name).read_text() for name in expected)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert {(r["strategy"], r["world_size"]) for r in rows} == {(s, w) for s in ("ddp", "fsdp2", "zero3") for w in (1, 2)}
    assert all(r["p20_ms"] <= r["p50_ms"] <= r["p80_ms"] for r in rows)
    by = {(r["strategy"], r["world_size"]): r for r in rows}
    assert by["zero3", 2]["parameter_gib"] < by["ddp", 2]["parameter_gib"]  # ZeRO-3 really partitions


def test_scaling_smoke_takes_deepspeed_memory_settings(tmp_path):
    out = tmp_path / "scaling.jsonl"
    settings = {"stage3_max_live_parameters": 3e7, "stage3_max_reuse_distance": 0, "reduce_bucket_size": 5e6}
    subprocess.run([sys.executable, str(BENCHMARKS / "scaling.py"), "--smoke", "--strategies", "zero3",
                    "--world-sizes", "2", "--zero", json.dumps(settings), "--out", str(out)], check=True, timeout=600)
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert json.loads(row["zero"]) == settings
    ran_with = row["zero_optimization"]  # read back from the DeepSpeed engine
    assert ran_with["stage"] == 3 and {key: ran_with[key] for key in settings} == settings


def test_overhead_smoke_writes_every_provider(tmp_path):
    out = tmp_path / "overhead.jsonl"
    subprocess.run([sys.executable, str(BENCHMARKS / "overhead.py"), "--smoke", "--out", str(out)],
                   check=True, timeout=600)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert {(r["provider"], r["measure"]) for r in rows} >= {
        ("bare", "forward"), ("pyvene", "train"), ("pyvene", "forward"), ("pyvene_dist", "train"),
        ("pyvene_dist", "forward")}


def test_plot_draws_the_rows(tmp_path):
    pytest.importorskip("matplotlib")
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"strategy": "ddp", "world_size": 2, "checkpointing": "none", "tokens_per_s": 1.0,
                                "peak_memory_gib": 1.0}) + "\n")
    subprocess.run([sys.executable, str(BENCHMARKS / "plot.py"), str(rows), "--out", str(tmp_path / "figures")],
                   check=True, timeout=120)
    assert (tmp_path / "figures" / "scaling.png").stat().st_size > 0
