"""train()/eval() switch the interventions as well as the base model, and return the model."""

import torch

from pyvene_dist.testing.models import reft_model, tiny_llama


def _model_with_dropout():
    return reft_model(tiny_llama(), dropout=0.5)


def test_eval_switches_interventions_and_returns_model(patched):
    model = _model_with_dropout()
    assert model.train() is model
    assert model.training and all(m.training for m in model.interventions.modules())
    assert model.eval() is model
    assert not model.training
    assert not any(m.training for m in model.modules())


def test_train_false_is_eval(patched):
    model = _model_with_dropout()
    model.train(False)
    assert not any(m.training for m in model.modules())


def test_intervention_dropout_is_off_in_eval(patched):
    model = _model_with_dropout().eval()
    ids = torch.randint(97, (2, 8), generator=torch.Generator().manual_seed(0))
    locations = {"sources->base": (None, [[[7]] * 2] * 2)}
    with torch.no_grad():
        first = model({"input_ids": ids}, unit_locations=locations)[1].logits
        second = model({"input_ids": ids}, unit_locations=locations)[1].logits
    torch.testing.assert_close(first, second, rtol=0, atol=0)
