"""LoReFT's weights in its parent's state dict; its own keeps pyreft's file format (fixes.checkpoints.loreft_state_dict).

pyreft 0.1.0's ``LoreftIntervention.state_dict`` returned its compact form to a parent collecting its part too,
which the parent ignores: ``reft_model.state_dict()`` lacked every LoReFT weight.
"""

import torch

from pyvene_dist.testing import ParityCase, models


def test_model_state_dict_holds_the_loreft_weights(patched):
    state = ParityCase().build().state_dict()
    key = "interventions.layer_0_comp_block_output_unit_pos_nunit_1#0"
    assert f"{key}.rotate_layer.parametrizations.weight.original" in state
    assert f"{key}.learned_source.weight" in state


def test_direct_state_dict_keeps_pyrefts_file_format(patched):
    intervention = next(iter(ParityCase().build().interventions.values()))
    assert set(intervention.state_dict()) == {"weight", "bias", "rotate_layer"}


def test_a_save_on_one_rank_reads_the_rotation_without_calling_its_module(patched):
    """ZeRO-3's module hooks run on a call of the rotation's parametrization; a save on rank 0 alone must make
    none, or the ranks fall out of step. The compact form is read without a module call, and holds the weight."""
    intervention = next(iter(ParityCase().build().interventions.values()))
    calls = []
    handle = intervention.rotate_layer.parametrizations.weight.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        state = intervention.state_dict()
    finally:
        handle.remove()
    assert calls == []
    torch.testing.assert_close(state["rotate_layer"], intervention.rotate_layer.weight, rtol=0, atol=0)


def test_the_nested_form_loads_back(patched):
    """What a parent saved (an HF Trainer or accelerate checkpoint) loads into another model's LoReFTs."""
    source = models.reft_model(models.tiny_llama(), rank=2)
    target = models.reft_model(models.tiny_llama(), rank=2, seed=3)
    target.interventions.load_state_dict(source.interventions.state_dict())
    for key, intervention in target.interventions.items():
        torch.testing.assert_close(intervention.rotate_layer.weight, source.interventions[key].rotate_layer.weight,
                                   rtol=0, atol=0)
