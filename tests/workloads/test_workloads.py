"""pyreft's own flows under every strategy, checkpointing off and on, against one process without it.

Each strategy is one spawned world (2 gloo ranks on CPU) that runs every workload (``suite.py``); the
tests compare its records case by case, so a failure names workload x strategy x checkpointing.
"""

import pytest
import torch

import suite
from pyvene_dist.testing import assert_parity

pytestmark = pytest.mark.slow


def _cases(strategies):
    for workload in suite.WORKLOADS:
        for strategy in strategies:
            for checkpointing in suite.CHECKPOINTING:
                if not suite.in_scope(workload, strategy, checkpointing):
                    continue
                reason = suite.needs_fix(workload, strategy, checkpointing)
                marks = [pytest.mark.skip(reason=reason)] if reason else []
                if strategy == "fsdp2" and not torch.cuda.is_available():
                    marks = [pytest.mark.skip(reason="HF Trainer runs FSDP on GPUs only")]
                yield pytest.param(workload, strategy, checkpointing, marks=marks,
                                   id=f"{workload}-{strategy}-{'checkpointing' if checkpointing else 'plain'}")


def _run(worlds, strategy, workload, checkpointing) -> suite.Run:
    found = worlds(strategy).get((workload, checkpointing))
    if not isinstance(found, suite.Run):
        pytest.fail(f"{workload} under {strategy}, checkpointing {'on' if checkpointing else 'off'}, "
                    f"raised:\n{found}", pytrace=False)
    return found


@pytest.mark.parametrize("workload, strategy, checkpointing", _cases(("single", *suite.STRATEGIES)))
def test_workload_matches_one_process_without_checkpointing(worlds, workload, strategy, checkpointing):
    if strategy == "single" and not checkpointing:
        pytest.skip("the reference itself")
    reference = _run(worlds, "single", workload, False)
    candidate = _run(worlds, strategy, workload, checkpointing)
    # HF Trainer under DeepSpeed steps inside backward: no gradient is left to record there.
    assert_parity(reference.record, candidate.record, suite.tolerance(workload, strategy),
                  grads=not strategy.startswith("zero"))
    # A trainable head starts every step with its gradient cleared (HF Trainer's model.zero_grad()), in the
    # reference too: a head that keeps summing does so alike in one process and under the patch's DDP.
    for run, where in ((reference, "single"), (candidate, strategy)):
        left_over = run.record.metrics.get("head_gradient_left_over", 0.0)
        assert left_over == 0.0, f"{where}: a step began with the head's gradient from earlier steps ({left_over})"
    expected, found = reference.extras, candidate.extras
    if "generated" in expected:  # greedy generation with the trained intervention
        assert found["generated"] == expected["generated"]
    if "eval_accuracy" in expected:  # evaluation during training saw the same predictions
        assert found["eval_accuracy"] == expected["eval_accuracy"]
    if "eval_idiom_error" in found:  # the scripts' ``for k, v in model.interventions.items(): v[0].eval()``
        assert found["eval_idiom_error"] is None, found["eval_idiom_error"]
    for key in ("predictions", "exact_match", "saved"):  # loreft's final evaluations; alpaca's save_model
        if key in expected:
            assert found[key] == expected[key], key
    if "loaded_equal" in expected:  # saved on rank 0, loaded back by every rank
        assert found["loaded_equal"], f"reloaded not bit for bit; dtypes (saved, loaded) that differ: {found['reloaded_as']}"
        assert found["checkpoints"] == ["checkpoint-2", "checkpoint-3"]
    if "resumed_weights" in found:  # save_total_limit kept 2; resuming from the older ends where the run did
        assert found["checkpoints"] == [f"checkpoint-{suite.STEPS - 1}", f"checkpoint-{suite.STEPS}"]
        assert found["resumed_losses"][-1] == pytest.approx(candidate.record.losses[-1], rel=1e-6)
        for name, weight in candidate.record.weights.items():
            torch.testing.assert_close(found["resumed_weights"][name], weight, rtol=1e-6, atol=1e-7, msg=name)


def test_table_of_largest_deviations(worlds):
    """The table ``python tests/workloads/suite.py`` prints, from this session's worlds; written to the
    file named by PYVENE_DIST_WORKLOAD_TABLE, if set. Every case has a figure or the reason it has none."""
    import os

    strategies = [s for s in suite.STRATEGIES if s != "fsdp2" or torch.cuda.is_available()]
    text = suite.table(worlds("single"), {"single": worlds("single"), **{s: worlds(s) for s in strategies}})
    print(text)
    if os.environ.get("PYVENE_DIST_WORKLOAD_TABLE"):
        with open(os.environ["PYVENE_DIST_WORKLOAD_TABLE"], "w") as table:
            table.write(text + "\n")
    rows = text.splitlines()[2:]
    assert len(rows) == sum(len(suite.SCOPE.get(w, (None, suite.CHECKPOINTING))[1]) for w in suite.WORKLOADS)
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split("|")][2:]
        assert all(cell == "-" or cell.startswith("skip") or float(cell) >= 0 for cell in cells), row
