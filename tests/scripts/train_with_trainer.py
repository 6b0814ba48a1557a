"""Train ParityCase() with HF Trainer and a stock pyreft trainer; rank 0 saves the Record.

    torchrun --nproc_per_node 2 train_with_trainer.py OUT.pt [--trainer ReftTrainer] [--model llama]
        [--eval-examples N] [--unpatched]

``--fsdp 2`` on a machine without GPUs runs HF Trainer's FSDP2 over gloo: accelerate applies FSDP on GPUs only
(on CPU it trains DDP), so the accelerator HF Trainer makes is told it runs on GPUs while it is made, and takes
the FSDP plugin (``fsdp_on_cpu``). HF Trainer then shards, saves and resumes as it does on GPUs: DCP checkpoints,
``_load_from_checkpoint(checkpoint, model_wrapped)`` after ``prepare``.
"""

import argparse
import dataclasses
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1]))
import helpers  # noqa: E402 -- pyvene_dist.patch(), minus what PYVENE_DIST_TEST_WITHOUT names
from pyvene_dist.testing import ParityCase  # noqa: E402
from pyvene_dist.testing.hf import deepspeed_config  # noqa: E402
from pyvene_dist.testing.hf import fsdp_on_cpu, train_with_trainer

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--trainer", default="ReftTrainer")
parser.add_argument("--model", default="llama")
parser.add_argument("--eval-examples", type=int, default=0)
parser.add_argument("--steps", type=int, default=3)
parser.add_argument("--output-dir", help="keep checkpoints here (default: a temporary folder)")
parser.add_argument("--save-steps", type=int, help="write a checkpoint every N steps")
parser.add_argument("--resume-from", help="a checkpoint folder to resume from")
parser.add_argument("--fsdp", type=int, choices=(1, 2), help="HF Trainer's FSDP, this version (2 runs on CPU too)")
parser.add_argument("--frozen-head", action="store_true", help="train the interventions alone (no lm_head)")
parser.add_argument("--deepspeed", help="HF Trainer's DeepSpeed: a ZeRO stage (1, 2, 3, 3-offload) or a JSON file")
parser.add_argument("--unpatched", action="store_true")
options = parser.parse_args()


if not options.unpatched:
    helpers.patch()
overrides = {}
if options.save_steps:
    overrides.update(save_strategy="steps", save_steps=options.save_steps)
if options.resume_from:
    overrides.update(resume_from_checkpoint=options.resume_from)
if options.fsdp:
    overrides.update(fsdp=True, fsdp_config={"version": options.fsdp})
    if options.fsdp == 2 and not torch.cuda.is_available():
        fsdp_on_cpu()
if options.deepspeed:
    overrides.update(deepspeed=options.deepspeed if options.deepspeed.endswith(".json") else
                     deepspeed_config(options.deepspeed))
with tempfile.TemporaryDirectory() as scratch:
    case = ParityCase(model=options.model, steps=options.steps, trainable_head=not options.frozen_head)
    record = train_with_trainer(case, options.output_dir or scratch,
                                trainer_class=options.trainer, eval_examples=options.eval_examples, **overrides)
if int(os.environ.get("RANK", 0)) == 0:
    torch.save(dataclasses.asdict(record), options.out)
# Leave the process group before exit: gloo's threads otherwise die at interpreter exit, now and then
# taking the process down with "terminate called without an active exception".
if torch.distributed.is_initialized():
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
