"""Train ParityCase() with accelerate (prepare(model, optimizer, dataloader)); the main process saves the Record.

    accelerate launch --config_file docs/configs/accelerate-ddp.yaml tests/scripts/train_with_accelerate.py OUT.pt
    ACCELERATE_USE_CPU=1 torchrun --nproc_per_node 2 tests/scripts/train_with_accelerate.py OUT.pt     (CPU)
"""

import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1]))
import helpers  # noqa: E402 -- pyvene_dist.patch(), minus what PYVENE_DIST_TEST_WITHOUT names
from pyvene_dist.testing import ParityCase  # noqa: E402
from pyvene_dist.testing.hf import train_with_accelerate  # noqa: E402

helpers.patch()
record = train_with_accelerate(ParityCase())
from accelerate import PartialState  # noqa: E402

if PartialState().is_main_process:
    torch.save(dataclasses.asdict(record), sys.argv[1])
# Leave the process group before exit: gloo's threads otherwise die at interpreter exit, now and then
# taking the process down with "terminate called without an active exception".
if torch.distributed.is_initialized():
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
