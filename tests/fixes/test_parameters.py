"""BaseModel.named_parameters behaves like nn.Module's: full signature, every parameter, standard names."""

import pytest
import torch
from torch import nn

from pyvene_dist.testing.models import reft_model, tiny_gpt2, tiny_llama


@pytest.fixture
def model(patched):
    return reft_model(tiny_llama())


def test_signature_is_nn_modules(model):
    names = [name for name, _ in model.named_parameters(prefix="wrapper", recurse=True, remove_duplicate=False)]
    assert names and all(name.startswith("wrapper.") for name in names)


def test_yields_the_frozen_base_with_standard_names(model):
    named = dict(model.named_parameters())
    base = {f"model.{name}" for name, _ in model.model.named_parameters()}
    interventions = {f"interventions.{name}" for name, _ in model.interventions.named_parameters()}
    assert set(named) == base | interventions
    assert len(list(model.parameters())) == len(named)
    assert not any(named[name].requires_grad for name in base)


def test_recurse_false_yields_nothing_of_the_children(model):
    assert list(model.named_parameters(recurse=False)) == []


def test_trainable_view_and_counts_unchanged(model):
    trainable = model.get_trainable_parameters()
    assert {id(p) for p in trainable} == {id(p) for p in model.parameters() if p.requires_grad}
    # LoReFT rank 4 at 2 layers of width 32: R is 32x4, W is 4x32 plus a bias of 4.
    assert model.count_parameters() == 2 * (32 * 4 + 4 * 32 + 4)


def test_hf_trainer_optimizer_gets_only_trainable_parameters(model, tmp_path):
    import pyreft
    from transformers import TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, weight_decay=0.01)
    trainer = pyreft.ReftTrainer(model=model, args=args)
    optimizer = trainer.create_optimizer()
    optimized = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert optimized == {id(p) for p in model.get_trainable_parameters()}


def test_linked_interventions_are_yielded_once(patched):
    import pyreft

    base = tiny_gpt2()
    shared = pyreft.LoreftIntervention(embed_dim=32, low_rank_dimension=4, dtype=torch.float32)
    config = pyreft.ReftConfig(representations=[
        {"layer": layer, "component": "block_output", "intervention": shared} for layer in (0, 1)
    ])
    model = pyreft.get_reft_model(base, config)
    ids = [id(p) for p in model.parameters()]
    assert len(ids) == len(set(ids))
    assert len([n for n, _ in model.named_parameters(remove_duplicate=False)]) > len(ids)


def test_parameters_match_nn_module_exactly(model):
    assert list(model.named_parameters()) == list(nn.Module.named_parameters(model))


def test_the_shared_replacement_refuses_a_name_nn_module_does_not_define():
    """``fixes.parameters`` and ``fixes.zero_grad`` share one mechanism, ``nn.Module``'s method by name: a name
    that is no method of it is refused when the wrapper is made, naming the argument and what it found."""
    from pyvene_dist.mechanisms.module_methods import nn_module_method

    assert nn_module_method("zero_grad").__name__ == "_wrap_zero_grad"
    with pytest.raises(ValueError, match=r"nn_module_method\(name='named_parameter'\): expected the name of a "
                                         r"method nn.Module defines, such as 'zero_grad'; found none"):
        nn_module_method("named_parameter")
    with pytest.raises(ValueError, match=r"name=\('zero_grad',\).*found none"):
        nn_module_method(("zero_grad",))
