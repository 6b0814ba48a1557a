"""Location indices are built on the device of the tensor they index, not on the model's first device."""

import torch


def test_gather_ignores_a_foreign_device(patched):
    from pyvene.models import intervenable_base, modeling_utils

    tensor = torch.arange(2 * 5 * 3, dtype=torch.float32).reshape(2, 5, 3)
    for module in (modeling_utils, intervenable_base):
        # "meta" stands for "another GPU": pyvene would build the index there and torch.gather would fail.
        out = module.gather_neurons(tensor, "pos", [[1, 4], [0, 2]], device="meta")
        torch.testing.assert_close(out, torch.stack([tensor[0, [1, 4]], tensor[1, [0, 2]]]))


def test_scatter_ignores_a_foreign_device(patched):
    from pyvene.models import intervenable_base, modeling_utils
    from transformers import GPT2Config, GPT2Model

    config = GPT2Config(n_embd=3, n_layer=1, n_head=1)
    for module in (modeling_utils, intervenable_base):
        tensor = torch.zeros(2, 5, 3)
        module.scatter_neurons(
            tensor, torch.ones(2, 1, 3), "block_output", "pos", [[4], [0]], GPT2Model, config, False, device="meta"
        )
        assert tensor[0, 4].eq(1).all() and tensor[1, 0].eq(1).all() and tensor.sum() == 6


def test_a_pyvene_with_other_signatures_is_refused_at_patch_time(monkeypatch):
    """The wrappers bind pyvene's arguments by its 0.1.8 signatures; another order would be a silent mix-up.
    (The concern is applied alone, into a registry of its own: under the upstream diffs patch() skips it.)"""
    import pytest
    from pyvene.models import modeling_utils

    from pyvene_dist._registry import ImportHooks, UndoLog
    from pyvene_dist.fixes import devices

    def gather_neurons(tensor_input, unit_locations_as_list, unit, device=None):
        raise AssertionError("not called")

    monkeypatch.setattr(modeling_utils, "gather_neurons", gather_neurons)
    undo_log = UndoLog()
    with pytest.raises(TypeError, match=r"gather_neurons\(tensor_input, unit_locations_as_list, unit, device=None\) "
                                        r"is not the signature pyvene_dist was written for"):
        devices.FIX.patch(undo_log, ImportHooks(undo=undo_log.restore))
    assert modeling_utils.gather_neurons is gather_neurons and not undo_log.sites  # nothing wrapped
