"""The examples' ``v[0].eval()`` over ``model.interventions`` (pyvene < 0.1.8's pairs) runs (fixes.pair_indexing)."""

import collections.abc

import pytest

from pyvene_dist.testing import models


def test_the_examples_loop_switches_every_intervention_to_evaluation(patched):
    reft_model = models.reft_model(models.tiny_llama(), layers=(0, 1), rank=2, dropout=0.1)
    reft_model.train()
    assert all(v.training for v in reft_model.interventions.values())

    # pyreft's examples/loreft/train.py and examples/reward/train.py, after training:
    reft_model.model.eval()
    for k, v in reft_model.interventions.items():
        _ = v[0].eval()

    assert not any(module.training for v in reft_model.interventions.values() for module in v.modules())


def test_only_index_zero_is_the_intervention_and_iteration_yields_it_once(patched):
    reft_model = models.reft_model(models.tiny_llama(), layers=(0,), rank=2)
    (intervention,) = reft_model.interventions.values()
    assert intervention[0] is intervention
    with pytest.raises(IndexError, match=r"LoreftIntervention\[1\]: .*model.intervention_hooks\[key\]"):
        intervention[1]
    assert list(intervention) == [intervention]  # the sequence protocol, through __getitem__
    assert not isinstance(intervention, collections.abc.Iterable)
