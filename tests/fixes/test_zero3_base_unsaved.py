"""HF Trainer's checkpoint of a ZeRO-3 run of a pyvene model (fixes.checkpoints.zero3_base_unsaved): before, every
rank wrote its partition of the frozen base into each checkpoint (2 x 292 KB for this 345 KB model); now the
engine leaves frozen parameters out, and loads its checkpoint without them."""

import pytest

from sharded_folders import save_folder, trained_saved_and_resumed


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_folder(tmp_path_factory.mktemp("model"))


@pytest.mark.world_size(2, timeout=900)
def test_a_checkpoint_holds_no_base_and_resumes_reading_each_ranks_share(folder, tmp_path):
    trained_saved_and_resumed(folder, tmp_path, "zero3")
