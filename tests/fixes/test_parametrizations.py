"""An intervention's parametrized weight is computed once per application, not once per read
(fixes.parametrizations)."""

import pytest
import torch

from pyvene_dist.testing import models

B, S = 3, 9


@pytest.fixture(params=["general", "plan"])
def path(request, monkeypatch):
    """pyvene's general path, where this fix alone builds each rotation once (without it, 6 for 2
    interventions), and fixes.fast_path's plan, which does the same by itself."""
    monkeypatch.setenv("PYVENE_DIST_FAST_PATH", "0" if request.param == "general" else "1")


def test_rotation_is_computed_once_per_intervention_per_forward(path, patched):
    reft = models.reft_model(models.tiny_llama(seed=0), layers=(0, 1), seed=1)
    calls = []
    for intervention in reft.interventions.values():
        orthogonal = intervention.rotate_layer.parametrizations.weight[0]
        orthogonal.register_forward_hook(lambda *_: calls.append(1))
    ids = torch.randint(models.VOCAB_SIZE, (B, S))
    reft({"input_ids": ids}, unit_locations={"base": 2}, labels=ids)
    assert len(calls) == 2, f"{len(calls)} rotations built for 2 interventions (LoReFT reads its weight 3 times)"
    reft({"input_ids": ids}, unit_locations={"base": 2}, labels=ids)
    assert len(calls) == 4, "a second call must build the rotations afresh (the weights may have changed)"
