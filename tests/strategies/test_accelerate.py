"""accelerate: prepare(model, optimizer, dataloader) in a process group; the same script under torchrun;
and `accelerate launch` with the config files in docs/configs (on GPUs: on CPU, accelerate launch starts
several processes only through mpirun)."""

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import helpers
from pyvene_dist.testing import ParityCase, assert_parity, train

DOCS = Path(__file__).parents[2] / "docs" / "configs"


@pytest.mark.world_size(1, 2)
def test_accelerate_prepare_matches_one_process():
    from accelerate import Accelerator

    from pyvene_dist.testing.hf import train_with_accelerate

    helpers.patch()
    case = ParityCase()
    accelerator = Accelerator(gradient_accumulation_steps=case.accumulation, cpu=not torch.cuda.is_available())
    candidate = train_with_accelerate(case, accelerator)
    if dist.get_rank() == 0:
        assert_parity(train(case, "single"), candidate, case.tolerance)


@pytest.mark.world_size(2)
def test_accelerate_fsdp2_plugin_shards_the_layers():
    from accelerate import Accelerator, FullyShardedDataParallelPlugin

    from pyvene_dist.testing.hf import train_with_accelerate

    if not torch.cuda.is_available():
        pytest.skip("accelerate applies FSDP on GPUs only (on CPU it silently falls back to DDP)")
    helpers.patch()
    case = ParityCase()
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap")
    accelerator = Accelerator(gradient_accumulation_steps=case.accumulation, fsdp_plugin=plugin)
    candidate = train_with_accelerate(case, accelerator)
    if dist.get_rank() == 0:
        assert_parity(train(case, "single"), candidate, case.tolerance)


SCRIPT = str(Path(__file__).parents[1] / "scripts" / "train_with_accelerate.py")


@pytest.mark.slow
def test_accelerate_script_under_torchrun(tmp_path, patched):
    """The reference is one patched process (``patched``), as the script's are: stock pyvene's ``zero_grad``
    keeps the trainable head's gradients summing from step to step (the third loss is then 1.5e-3 off)."""
    from launchers import run_launcher
    from pyvene_dist.testing.launch import free_port

    # On CPU, Accelerator() joins torchrun's group only when told to use the CPU (accelerate launch sets this).
    record = run_launcher(tmp_path, ["-m", "torch.distributed.run", "--nproc_per_node", "2",
                                     "--master_port", str(free_port()), SCRIPT], env={"ACCELERATE_USE_CPU": "1"})
    case = ParityCase()
    assert record.world_size == 2
    assert_parity(train(case, "single"), record, case.tolerance)


@pytest.mark.slow
@pytest.mark.gpus(2)
@pytest.mark.parametrize("config", ["accelerate-ddp.yaml", "accelerate-fsdp2.yaml"])
def test_accelerate_launch_with_the_documented_config(tmp_path, config, patched):
    from launchers import run_launcher

    record = run_launcher(tmp_path, ["-m", "accelerate.commands.launch", "--config_file", str(DOCS / config), SCRIPT])
    case = ParityCase()
    print(f"{config}: {record.losses}")
    assert record.world_size == 2
    assert_parity(train(case, "single"), record, case.tolerance)
