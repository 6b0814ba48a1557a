"""The benchmarks' timing harness (benchmarks/common.py) times the step it is given, never a function that only
builds one: benchmarks/quantized.py --training timed ``lambda: lora_step(...)`` and reported 0.017 ms for an 8B
QLoRA step on an H100 (issue 46)."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
import common  # noqa: E402


def _linear_step():
    layer = torch.nn.Linear(4, 4)
    ids = torch.ones(2, 4)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    return common._training_step(lambda: layer(ids).sum(), optimizer, None, None), layer


def test_a_step_runs_once_per_timed_call():
    step, layer = _linear_step()
    before = layer.weight.detach().clone()
    times = common.timed(step, warmup=1, steps=2, device=torch.device("cpu"))
    assert len(times) == 2
    assert not torch.equal(layer.weight, before)  # three real SGD steps moved the weight


def test_a_function_that_builds_the_step_is_refused():
    step, layer = _linear_step()
    before = layer.weight.detach().clone()
    with pytest.raises(TypeError, match="step returned .*a function; pass the step itself"):
        common.timed(lambda: step, warmup=0, steps=1, device=torch.device("cpu"))
    assert torch.equal(layer.weight, before)
