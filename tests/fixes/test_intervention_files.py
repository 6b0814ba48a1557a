"""``save_intervention`` saves once with whole weights; ``load_intervention`` loads onto each intervention's own device,
into the same parameters, exactly (fixes.checkpoints.intervention_files)."""

import os

import pytest
import torch
import torch.distributed as dist

import helpers
from pyvene_dist.testing import ParityCase, assert_parity, models

CASE = ParityCase(steps=4)


def trained_model():
    model = CASE.build()
    optimizer = torch.optim.Adam(model.get_trainable_parameters(), lr=0.05)
    for batch in CASE.batches():
        _, out = model({"input_ids": batch["input_ids"]},
                       unit_locations={"sources->base": (None, batch["locations"].tolist())}, labels=batch["labels"])
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model


def intervention_state(model):
    return {k: v.clone() for k, v in model.interventions.state_dict().items()}


def test_save_then_load_is_exact_and_keeps_the_parameters(patched, tmp_path):
    source = trained_model()
    source.save_intervention(str(tmp_path))
    target = CASE.build()
    parameters = list(target.parameters())
    optimizer = torch.optim.SGD(target.get_trainable_parameters(), lr=0.1)
    target.load_intervention(str(tmp_path))
    assert list(target.parameters()) == parameters
    for name, value in intervention_state(source).items():
        assert torch.equal(target.interventions.state_dict()[name], value), name
    # The optimizer made before loading still trains what the model uses.
    before = intervention_state(target)
    batch = CASE.batches()[0]
    target({"input_ids": batch["input_ids"]}, unit_locations={"sources->base": (None, batch["locations"].tolist())},
           labels=batch["labels"])[1].loss.backward()
    optimizer.step()
    assert any(not torch.equal(before[k], v) for k, v in target.interventions.state_dict().items())


def test_pyrefts_own_files_load_in_place_on_cpu(patched, tmp_path):
    source = trained_model()
    source.save_intervention(str(tmp_path))
    os.remove(tmp_path / "intervention_states.bin")  # as written by stock pyreft: the compact form only
    target = CASE.build()
    parameters = list(target.parameters())
    target.load_intervention(str(tmp_path))  # pyvene loads with map_location='cuda:0'
    assert list(target.parameters()) == parameters
    for (key, want), got in zip(source.interventions.items(), target.interventions.values()):
        torch.testing.assert_close(got.rotate_layer.weight, want.rotate_layer.weight, rtol=0, atol=1e-6)
        torch.testing.assert_close(got.learned_source.weight, want.learned_source.weight, rtol=0, atol=0)


@pytest.mark.world_size(2)
def test_ddp_saves_once_with_whole_weights(tmp_path):
    helpers.patch()
    model = CASE.build()
    writes = []
    real_save = torch.save
    torch.save = lambda obj, path, *a, **k: (writes.append(str(path)), real_save(obj, path, *a, **k))
    try:
        model.save_intervention(str(tmp_path / "saved"))
    finally:
        torch.save = real_save
    dist.barrier()
    if dist.get_rank() == 0:
        assert len(writes) == 4  # two interventions, their states, the (empty) model file
    else:
        assert writes == []


@pytest.mark.world_size(2)
def test_fsdp2_model_saves_what_one_device_loads(tmp_path):
    """The trained head (``lm_head``, trainable beside the interventions) is a ``DTensor`` shard under FSDP2:
    ``save_intervention`` and ``save(include_model=True)`` (pyreft's ``ReftModel.save``) used to write this
    rank's shard, which one device failed to load (``aten.copy_.default got mixed torch.Tensor and
    DTensor``). They write it whole; it loads on one device, and back into a sharded model."""
    from pyvene_dist.fully_shard import fully_shard_model

    helpers.patch()
    pyreft = models.import_pyreft()
    trained = trained_model()  # the same on every rank
    head = trained.model.lm_head.weight.detach().clone()
    model = fully_shard_model(trained)
    model.save_intervention(str(tmp_path / "saved"))
    model.save(str(tmp_path / "pyreft"), include_model=True)
    dist.barrier()
    if dist.get_rank() == 0:
        single = ParityCase(seed=7).build()
        single.load_intervention(str(tmp_path / "saved"))
        for name, value in model.interventions.state_dict().items():
            assert torch.equal(single.interventions.state_dict()[name], value), name
        assert torch.equal(single.model.lm_head.weight, head)
        loaded = pyreft.ReftModel.load(str(tmp_path / "pyreft"), models.tiny_llama(seed=7), include_model=True)
        assert torch.equal(loaded.model.lm_head.weight, head)
    # ... and back into a sharded model, each rank its shard
    other = fully_shard_model(ParityCase(seed=7).build())
    other.load_intervention(str(tmp_path / "saved"))
    assert torch.equal(other.model.lm_head.weight.full_tensor(), head)
