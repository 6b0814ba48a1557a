"""What docs/examples/train_reft.py's model looks like the moment ``from_pretrained`` returns; rank 0 saves it.

    torchrun --nproc_per_node 2 zero3_load_probe.py OUT.pt --deepspeed docs/configs/deepspeed-zero3.json \
        --model PATH --data FILE --use_cpu

The script's own order: its arguments (HF ``TrainingArguments``, which set up DeepSpeed) and then the model.
"""

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[2] / "docs" / "examples"))
import train_reft  # noqa: E402

reft_args, training_args = train_reft.parse_arguments(sys.argv[2:])
_, model = train_reft.load_model(reft_args)
state = {name: {"ds_id": hasattr(parameter, "ds_id"), "ds_status": str(getattr(parameter, "ds_status", None)),
                "numel": parameter.numel(), "ds_numel": getattr(parameter, "ds_numel", None)}
         for name, parameter in model.named_parameters()}
if int(os.environ.get("RANK", 0)) == 0:
    torch.save(state, sys.argv[1])
torch.distributed.barrier()
torch.distributed.destroy_process_group()
