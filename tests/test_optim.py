"""Hand-written loops get the same decay split as HF Trainer: never a parametrization's original."""

import torch

from pyvene_dist.optim import param_groups, parametrization_original_names
from pyvene_dist.testing.models import reft_model, tiny_llama


def _step(model, optimizer):
    ids = torch.randint(97, (4, 8), generator=torch.Generator().manual_seed(0))
    locations = {"sources->base": (None, [[[7]] * 4] * 2)}
    model({"input_ids": ids}, unit_locations=locations, labels=ids)[1].loss.backward()
    optimizer.step()


def _rotations(model):
    return [intervention.rotate_layer.weight.detach() for intervention in model.interventions.values()]


def test_groups_split_decay_by_name(patched):
    model = reft_model(tiny_llama())
    decay, no_decay = param_groups(model, weight_decay=0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    assert {names[id(p)].split(".")[-2] for p in decay["params"]} == {"learned_source"}
    assert all(not names[id(p)].endswith("original") for p in decay["params"])
    assert {names[id(p)] for p in no_decay["params"]} >= parametrization_original_names(model)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0


def test_adamw_with_groups_keeps_the_rotation_orthonormal(patched):
    model = reft_model(tiny_llama())
    _step(model, torch.optim.AdamW(param_groups(model, weight_decay=0.01), lr=1e-2))
    for rotation in _rotations(model):
        torch.testing.assert_close(rotation.T @ rotation, torch.eye(rotation.shape[1]), atol=1e-5, rtol=0)


def test_plain_adamw_zeroes_the_rotation_which_is_why_groups_exist(patched):
    model = reft_model(tiny_llama())
    _step(model, torch.optim.AdamW(model.get_trainable_parameters(), lr=1e-2, weight_decay=0.01))
    assert all(rotation.abs().max() == 0 for rotation in _rotations(model))
