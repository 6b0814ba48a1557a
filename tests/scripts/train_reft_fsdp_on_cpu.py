"""docs/examples/train_reft.py with accelerate's FSDP plugin applied on the CPU too (``pyvene_dist.testing.hf``'s
``fsdp_on_cpu``): under ``accelerate launch --config_file docs/configs/accelerate-fsdp2.yaml`` HF Trainer then trains
FSDP2 as on GPUs, ``--bf16`` included (accelerate's float32 master weights and bf16 ``MixedPrecisionPolicy``).

    accelerate launch --config_file docs/configs/accelerate-fsdp2.yaml train_reft_fsdp_on_cpu.py ARGS  (train_reft.py's)
"""

import runpy
import sys
from pathlib import Path

from pyvene_dist.testing.hf import fsdp_on_cpu

EXAMPLES = Path(__file__).parents[2] / "docs" / "examples"
sys.path.insert(0, str(EXAMPLES))  # train_reft.py imports serve_reft.py beside it
fsdp_on_cpu()
runpy.run_path(str(EXAMPLES / "train_reft.py"), run_name="__main__")
