"""pyvene removes its own hooks, and only those: user, profiler, ZeRO-3 and FSDP2 hooks survive."""

import pytest
import torch

from pyvene_dist.testing.models import reft_model, tiny_llama

LOCATIONS = {"sources->base": (None, [[[3]] * 2] * 2)}


def _inputs():
    return {"input_ids": torch.randint(97, (2, 8), generator=torch.Generator().manual_seed(0))}


def _hook_counts(model):
    return [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in model.model.modules()]


def test_foreign_hooks_survive_a_forward(patched):
    model = reft_model(tiny_llama())
    calls = []
    layer = model.model.model.layers[0]
    layer.register_forward_hook(lambda module, args, output: calls.append("post"))
    layer.register_forward_pre_hook(lambda module, args: calls.append("pre"))
    before = _hook_counts(model)
    model(_inputs(), unit_locations=LOCATIONS)
    model(_inputs(), unit_locations=LOCATIONS)
    assert _hook_counts(model) == before
    assert calls == ["pre", "post", "pre", "post"]


def test_pyvene_hooks_are_gone_after_forward(patched):
    model = reft_model(tiny_llama())
    before = _hook_counts(model)
    model(_inputs(), unit_locations=LOCATIONS)
    assert _hook_counts(model) == before


def test_pyvene_hooks_are_gone_after_a_failing_forward(patched):
    model = reft_model(tiny_llama())
    before = _hook_counts(model)
    with pytest.raises(Exception):
        model(_inputs(), unit_locations={"sources->base": (None, [[[99]] * 2] * 2)})  # position 99 of 8
    # pyvene leaves its setter hooks behind on failure and clears them at the next call.
    model(_inputs(), unit_locations=LOCATIONS)
    assert _hook_counts(model) == before


def test_intervention_still_applies(patched):
    model = reft_model(tiny_llama())
    base, counterfactual = model(_inputs(), unit_locations=LOCATIONS, output_original_output=True)
    assert not torch.allclose(base.logits, counterfactual.logits)
