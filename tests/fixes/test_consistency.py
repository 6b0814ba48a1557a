"""Ranks that build different interventions, or the same ones in another order, are told so at setup
(fixes.consistency) instead of hanging or diverging."""

import pytest
import torch.distributed as dist

import helpers
from pyvene_dist.testing import ParityCase


@pytest.mark.world_size(2)
@pytest.mark.parametrize("wrap", ["ddp", "fsdp2"])
def test_ranks_with_different_interventions_fail_at_setup(wrap):
    import torch

    from pyvene_dist.fully_shard import fully_shard_model

    helpers.patch()
    model = ParityCase(layers=(dist.get_rank(),)).build()  # same shapes, different layers: DDP would run
    with pytest.raises(ValueError) as error:
        if wrap == "ddp":
            torch.nn.parallel.DistributedDataParallel(model)
        else:
            fully_shard_model(model)
    message = str(error.value)
    assert "the ranks built different interventions" in message
    assert "rank 0 has layer_0_comp_block_output_unit_pos_nunit_1#0 (LoreftIntervention at layer 0" in message
    assert "rank 1 has layer_1_comp_block_output_unit_pos_nunit_1#0" in message


@pytest.mark.world_size(2)
def test_ranks_building_interventions_in_another_order_are_told_so():
    import torch

    helpers.patch()
    model = ParityCase(layers=(0, 1) if dist.get_rank() == 0 else (1, 0)).build()
    with pytest.raises(ValueError) as error:
        torch.nn.parallel.DistributedDataParallel(model)
    message = str(error.value)
    first, second = "layer_0_comp_block_output_unit_pos_nunit_1#0", "layer_1_comp_block_output_unit_pos_nunit_1#0"
    assert (f"the same interventions in another order: position 0 is {first} on rank 0 and {second} on rank 1 "
            f"(rank 0: {first}, {second}; rank 1: {second}, {first})") in message
    assert "pyvene models" not in message
