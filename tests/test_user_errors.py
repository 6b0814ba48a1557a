"""Mistakes users make get an error naming what is wrong, what was expected and what was found."""

import pytest
import torch

import helpers


def test_an_architecture_pyvene_does_not_map_is_named_with_the_way_to_map_it(patched):
    import pyreft
    from transformers import Phi3Config, Phi3ForCausalLM

    config = Phi3Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, eos_token_id=1,
                        bos_token_id=1)
    model = Phi3ForCausalLM(config)
    intervention = pyreft.LoreftIntervention(embed_dim=32, low_rank_dimension=2, dtype=torch.float32)
    reft_config = pyreft.ReftConfig(representations=[
        {"layer": 0, "component": "block_output", "low_rank_dimension": 2, "intervention": intervention}])
    with pytest.raises(ValueError) as error:
        pyreft.get_reft_model(model, reft_config)
    message = str(error.value)
    assert "pyvene has no mapping for the architecture Phi3ForCausalLM" in message
    assert "pyvene.type_to_module_mapping[transformers.models.phi3.modeling_phi3.Phi3ForCausalLM]" in message
    assert "pyvene.type_to_dimension_mapping[" in message
    assert "names no module" not in message  # not blamed on layer 0
