"""The benchmark scripts run (CPU smoke mode) and write their rows; no timing is asserted."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).parents[2] / "benchmarks"
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
    rows = _smoke_rows(tmp_path, "overhead.py", "--checkpointing")
    assert {(r["provider"], r["measure"]) for r in rows} >= {
        ("bare", "forward"), ("pyvene", "train"), ("pyvene", "forward"), ("pyvene_dist", "train"),
        ("pyvene_dist", "forward")}
    _assert_metadata(rows)
    assert {r["checkpointing"] for r in rows} == {"non-reentrant"}
    reft_forward = next(r for r in rows if (r["provider"], r["measure"], r["locations"]) == ("pyvene_dist", "forward",
                                                                                             "list"))
    assert reft_forward["baseline"] == "bare" and len(reft_forward["ratio_rounds"]) == reft_forward["rounds"]


def _smoke_rows(tmp_path, script, *arguments):
    """The rows ``benchmarks/<script> --smoke`` writes."""
    out = tmp_path / "rows.jsonl"
    subprocess.run([sys.executable, str(BENCHMARKS / script), "--smoke", *arguments, "--out", str(out)], check=True,
                   timeout=900)
    return [json.loads(line) for line in out.read_text().splitlines()]


def _smoke_rows_side_by_side(tmp_path, script, *, runs):
    """The rows of each of ``runs`` invocations of ``benchmarks/<script> --smoke``, run at the same time (each in a
    process of its own, as one after the other: the second core does the second)."""
    outs = [tmp_path / f"rows{run}.jsonl" for run in range(runs)]
    processes = [subprocess.Popen([sys.executable, str(BENCHMARKS / script), "--smoke", "--out", str(out)])
                 for out in outs]
    try:
        for process in processes:
            if process.wait(timeout=900):
                raise subprocess.CalledProcessError(process.returncode, process.args)
    finally:
        for process in processes:
            process.kill()
            process.wait()
    return [[json.loads(line) for line in out.read_text().splitlines()] for out in outs]


def _assert_metadata(rows):
    """What every row carries (benchmarks/common.py): the commit, versions, GPU, machine, date, one run id for the
    invocation, dtype, shapes, median and spread."""
    _assert_provenance(rows)
    for row in rows:
        assert row["versions"]["torch"]
        assert row["dtype"] == "float32" and row["batch"] and row["time"]
        assert row["p20_ms"] <= row["median_ms"] <= row["p80_ms"] and row["spread"] >= 0


def test_compiled_smoke_trains_as_eager_and_counts_graph_breaks(tmp_path):
    """torch.compile (aot_eager on CPU) of the intervenable model: losses and intervention gradients equal
    eager pyvene's within fp32's 1e-5 over two steps; every compiled provider says what dynamo broke."""
    parity = tmp_path / "parity.pt"
    rows = _smoke_rows(tmp_path, "compiled.py", "--parity", str(parity))
    record = torch.load(parity)
    assert record["compiled"]["backend"] == "aot_eager"
    _assert_fp32_close(record["compiled"]["losses"], record["eager"]["losses"], "losses")
    assert len(record["eager"]["grads"]) == 2 and record["eager"]["grads"][0]
    for step, (eager, compiled) in enumerate(zip(record["eager"]["grads"], record["compiled"]["grads"])):
        assert compiled.keys() == eager.keys()
        for name in eager:
            _assert_fp32_close(compiled[name], eager[name], f"step {step} gradient of {name}")
    _assert_metadata(rows)
    by = {r["provider"]: r for r in rows}
    assert {"pyvene_dist-compiled", "pyvene_dist-base-compiled", "pyvene_dist"} <= by.keys()
    for name in ("pyvene_dist-compiled", "pyvene_dist-base-compiled"):
        assert by[name]["backend"] == "aot_eager" and by[name]["graphs_compiled"] >= 1
        assert by[name]["graph_breaks"] == sum(int(reason.split(" x ")[0]) for reason in by[name]["break_reasons"])
    if "peft-lora-compiled" in by:
        assert by["pyvene_dist-compiled"]["baseline"] == "peft-lora-compiled"


def _assert_fp32_close(actual, expected, what):
    rtol = 1e-5  # docs/index.md's fp32 parity bound
    scale = expected.abs().max().item()
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=rtol * scale, msg=lambda detail: f"{what}: {detail}")


def test_sharded_smoke_times_reft_and_lora_under_fsdp2_and_zero3(tmp_path):
    rows = _smoke_rows(tmp_path, "sharded.py")
    _assert_metadata(rows)
    reft = {r["strategy"]: r for r in rows if r["provider"] == "pyvene_dist"}
    assert reft.keys() == {"fsdp2", "zero3"} and {r["world_size"] for r in rows} == {1}
    if any(r["provider"] == "peft-lora" for r in rows):
        assert all(r["baseline"] == "peft-lora" and "host_minus_baseline_ms" in r for r in reft.values())


def test_generation_smoke_intervenes_on_every_token_as_stock_pyvene(tmp_path):
    """One process, every column in every round: the bare model unpatched, eager and with the compiled static
    cache, stock pyvene, pyvene_dist eager and in its own compiled step; ratios by the median of the rounds."""
    rows = _smoke_rows(tmp_path, "generation.py")
    _assert_metadata(rows)
    by = {r["provider"]: r for r in rows}
    assert [r["provider"] for r in rows] == ["bare", "bare-static", "pyvene", "pyvene_dist", "pyvene_dist-static"]
    assert [r["patched"] for r in rows] == [False, False, False, True, True]
    assert all(by[name]["differs_from_bare"] for name in ("pyvene", "pyvene_dist", "pyvene_dist-static"))
    assert by["pyvene_dist"]["same_as_stock"] and by["pyvene_dist-static"]["same_as_eager"]  # float32 on CPU
    assert by["bare-static"]["same_as_eager"]
    assert by["pyvene_dist"]["baseline"] == "bare" and by["pyvene_dist-static"]["baseline"] == "bare-static"
    assert all(len(r["ratio_rounds"]) == 2 and "ratio_median" in r for r in rows[1:])
    assert len(by["pyvene_dist-static"]["speedup_over_stock_rounds"]) == 2 and by["pyvene_dist"]["new_tokens"] == 8


def test_calls_smoke_counts_the_same_calls_in_two_runs(tmp_path):
    """Call counts are deterministic: two runs write the same positive integers for every provider and measure."""
    runs = _smoke_rows_side_by_side(tmp_path, "calls.py", runs=2)
    _assert_metadata_of_counts(runs[0])
    counts = [{(r["provider"], r["measure"]): (r["calls"], r.get("calls_per_token")) for r in rows} for rows in runs]
    assert set(counts[0]) == {(p, m) for p in ("bare", "pyvene", "pyvene_dist") for m in ("forward", "train", "generate")}
    assert counts[0] == counts[1]
    for calls, per_token in counts[0].values():
        assert isinstance(calls, int) and calls > 0
        assert per_token is None or (per_token > 0 and per_token == int(per_token))
    assert all(r["repeats"] for rows in runs for r in rows)


def _assert_metadata_of_counts(rows):
    _assert_provenance(rows)
    assert all(row["batch"] for row in rows)


def _assert_provenance(rows):
    """Where a row came from: commit, versions, GPU and machine, date and time, and the invocation's one run id."""
    for row in rows:
        assert row["commit"] and row["versions"]["pyvene"] and row["gpu"] and row["machine"] and row["time"]
        assert row["date"] == row["time"][:10]
    assert len({row["run_id"] for row in rows}) == 1, "the rows of one invocation carry one run id"


def test_start_up_times_spawned_and_forked_worlds(tmp_path):
    out = tmp_path / "start.jsonl"
    subprocess.run([sys.executable, str(BENCHMARKS / "start_up.py"), "--world-size", "1", "--rounds", "1",
                    "--out", str(out)], check=True, timeout=300)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["measure"], r["provider"]) for r in rows] == [("world_start", "spawned"), ("world_start", "forked")]
    assert all(len(r["seconds"]) == 1 and r["commit"] and r["run_id"] and r["versions"] for r in rows)
    assert "server_start_s" in rows[1] and "ratio_to_spawned" in rows[1]


def test_patch_guard_times_the_guard_inside_patch(tmp_path, monkeypatch):
    """One run: the guard's time is measured inside patch()'s (the wrap of ``versions.check`` ran, not zero). The
    script's ``main`` is called here; the run it times is a fresh process of its own, as always. ``sys.path`` and the
    run id it sets are put back after: the harness's fork servers are keyed by both."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    monkeypatch.setenv("PYVENE_DIST_RUN_ID", "")  # empty: the script makes one
    import patch_guard

    out = tmp_path / "guard.jsonl"
    patch_guard.main(["--runs", "1", "--out", str(out)])
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["runs"] == 1 and row["commit"] and row["versions"]["pyvene"]
    assert 0 < row["guard_ms"][0] < row["patch_ms"][0]
