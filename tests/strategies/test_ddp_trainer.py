"""HF Trainer under an initialised process group: DDP settings chosen for ReFT models."""

import pytest
import torch.distributed as dist

import helpers
from pyvene_dist.testing import ParityCase, assert_parity, train


@pytest.mark.world_size(2)
def test_ddp_does_not_search_for_unused_parameters(tmp_path):
    import pyreft
    from transformers import TrainingArguments

    helpers.patch()
    model = ParityCase().build()
    args = TrainingArguments(output_dir=str(tmp_path / f"rank{dist.get_rank()}"), report_to=[], use_cpu=True)
    trainer = pyreft.ReftTrainer(model=model, args=args)
    assert trainer.accelerator.ddp_handler.find_unused_parameters is False
    assert args.ddp_find_unused_parameters is None  # the user's arguments are left as they were


@pytest.mark.world_size(2)
def test_an_explicit_setting_wins(tmp_path):
    import pyreft
    from transformers import TrainingArguments

    helpers.patch()
    args = TrainingArguments(output_dir=str(tmp_path / f"rank{dist.get_rank()}"), report_to=[], use_cpu=True,
                             ddp_find_unused_parameters=True)
    trainer = pyreft.ReftTrainer(model=ParityCase().build(), args=args)
    assert trainer.accelerator.ddp_handler.find_unused_parameters is True


LINKED_AND_MIXED = [
    pytest.param(ParityCase(layers=(0, 1, 1), component="mlp_output"), id="three-at-mlp-output"),
    pytest.param(ParityCase(layers=(1,), component="attention_output", positions=4), id="attention-output"),
]


@pytest.mark.world_size(2)
@pytest.mark.parametrize("case", LINKED_AND_MIXED)
def test_ddp_parity_at_other_components(case):
    helpers.patch()
    candidate = train(case, "ddp")
    if dist.get_rank() == 0:
        assert_parity(train(case, "single"), candidate, case.tolerance)


@pytest.mark.world_size(2)
@pytest.mark.parametrize("wrap", ["ddp", "fsdp2"])
def test_ranks_with_different_interventions_fail_at_setup(wrap):
    import torch

    from pyvene_dist.fsdp import fully_shard_model

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
