"""HF Trainer's checkpoint of an FSDP2 run of a pyvene model (fixes.checkpoints.fsdp_base_unsaved): before, each
checkpoint gathered every base weight whole on every rank (accelerate's ``save_fsdp_model``, FULL_STATE_DICT) and
rank 0 wrote the whole model again; now the checkpoint holds what the run trains, and resuming from it reads each
rank's share of the base from the model folder again (fixes.sharded_loading)."""

import pytest

from sharded_folders import save_folder, trained_saved_and_resumed


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_folder(tmp_path_factory.mktemp("model"))


@pytest.mark.world_size(2, timeout=900)
def test_a_checkpoint_holds_no_base_and_resumes_reading_each_ranks_share(folder, tmp_path):
    trained_saved_and_resumed(folder, tmp_path, "fsdp2")
