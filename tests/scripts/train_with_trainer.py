"""Train ParityCase() with HF Trainer and a stock pyreft trainer; rank 0 saves the Record.

    torchrun --nproc_per_node 2 train_with_trainer.py OUT.pt [--trainer ReftTrainer] [--unpatched]
"""

import argparse
import dataclasses
import os
import tempfile

import torch

import pyvene_dist
from pyvene_dist.testing import ParityCase
from pyvene_dist.testing.hf import train_with_trainer

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--trainer", default="ReftTrainer")
parser.add_argument("--unpatched", action="store_true")
options = parser.parse_args()
if not options.unpatched:
    pyvene_dist.patch()
with tempfile.TemporaryDirectory() as output_dir:
    record = train_with_trainer(ParityCase(), output_dir, trainer_class=options.trainer)
if int(os.environ.get("RANK", 0)) == 0:
    torch.save(dataclasses.asdict(record), options.out)
