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


BATCH, LENGTH = 4, 8
LOCATIONS_THAT_DO_NOT_FIT = {
    # two rows for a batch of 4: pyvene gives no error and wrong outputs for examples 2 and 3 (one row for
    # them all applies to every example: test_locations.py)
    "two-rows": ({"sources->base": (None, [[[3]] * 2, [[3]] * 2])}, None,
                 "unit_locations['sources->base'][1][0] has 2 rows but the batch has 4 examples: give one row per "
                 "example, or one row for them all"),
    "five-rows": ({"sources->base": (None, [[[3]] * 5] * 2)}, None,
                  "unit_locations['sources->base'][1][0] has 5 rows but the batch has 4 examples"),
    "one-of-two-interventions": ({"sources->base": (None, [[[3]] * BATCH])}, None,
                                 "unit_locations['sources->base'][1] has 1 entry but the model has 2 interventions"),
    "position-past-the-end": ({"sources->base": (None, [[[3]] * BATCH, [[1]] * 3 + [[LENGTH]]])}, None,
                              "unit_locations['sources->base'][1][1] holds position 8 but the sequence has 8 "
                              "positions (0 to 7)"),
    "tensor-two-rows": ({"sources->base": (None, torch.zeros(2, 2, 1, dtype=torch.long))}, None,
                        "unit_locations['sources->base'][1][0] has 2 rows but the batch has 4 examples"),
    "subspaces-one-row": ({"base": 3}, [[[0]] * BATCH, [[0]]],
                          "subspaces[1] has 1 row but the batch has 4 examples"),
}


@pytest.mark.parametrize("locations, subspaces, message", LOCATIONS_THAT_DO_NOT_FIT.values(),
                         ids=LOCATIONS_THAT_DO_NOT_FIT.keys())
def test_unit_locations_that_do_not_fit_the_batch_are_refused(patched, locations, subspaces, message):
    from pyvene_dist.testing import models

    model = models.reft_model(models.tiny_llama(), layers=(0, 1), rank=2)
    ids = torch.randint(models.VOCAB_SIZE, (BATCH, LENGTH), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError) as error:
        model({"input_ids": ids}, unit_locations=locations, subspaces=subspaces)
    assert str(error.value).startswith(message), str(error.value)


@pytest.mark.world_size(2)
def test_two_rows_of_locations_for_four_examples_under_ddp_are_refused():
    from torch.nn.parallel import DistributedDataParallel

    from pyvene_dist.testing import models

    helpers.patch()
    model = DistributedDataParallel(models.reft_model(models.tiny_llama(), layers=(0, 1), rank=2))
    ids = torch.randint(models.VOCAB_SIZE, (BATCH, LENGTH))
    with pytest.raises(ValueError, match=r"unit_locations\['sources->base'\]\[1\]\[0\] has 2 rows but the batch "
                                         r"has 4 examples"):
        model({"input_ids": ids}, unit_locations={"sources->base": (None, [[[3]] * 2, [[3]] * 2])}, labels=ids)
