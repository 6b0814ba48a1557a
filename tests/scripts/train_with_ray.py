"""Train ParityCase() with a stock pyreft trainer under Ray Train's TorchTrainer, on a local Ray cluster on CPU
(each worker patches, as a user's training function would); rank 0 saves the Record.

    python train_with_ray.py OUT.pt [--workers 2] [--trainer ReftTrainer]
"""

import argparse
import dataclasses
import os
import sys
import tempfile
from pathlib import Path

import ray
from ray.train import ScalingConfig
from ray.train.torch import TorchTrainer

TESTS = Path(__file__).parents[1]


def train(config: dict) -> None:
    """The training function every Ray worker runs: Ray has set up the gloo process group and RANK and
    WORLD_SIZE, which HF Trainer reads."""
    import torch

    sys.path.insert(0, str(TESTS))
    import helpers  # pyvene_dist.patch(), minus what PYVENE_DIST_TEST_WITHOUT names
    from pyvene_dist.testing import ParityCase
    from pyvene_dist.testing.hf import train_with_trainer

    helpers.patch()
    with tempfile.TemporaryDirectory() as scratch:
        record = train_with_trainer(ParityCase(), scratch, trainer_class=config["trainer"])
    if int(os.environ.get("RANK", 0)) == 0:
        torch.save(dataclasses.asdict(record), config["out"])


parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--workers", type=int, default=2)
parser.add_argument("--trainer", default="ReftTrainer")
options = parser.parse_args()
ray.init(num_cpus=options.workers, include_dashboard=False, log_to_driver=True)
TorchTrainer(train, train_loop_config={"out": str(Path(options.out).resolve()), "trainer": options.trainer},
             scaling_config=ScalingConfig(num_workers=options.workers, use_gpu=False)).fit()
ray.shutdown()
