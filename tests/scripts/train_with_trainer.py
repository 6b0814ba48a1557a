"""Train ParityCase() with HF Trainer and a stock pyreft trainer; rank 0 saves the Record.

    torchrun --nproc_per_node 2 train_with_trainer.py OUT.pt [--trainer ReftTrainer] [--model llama]
        [--eval-examples N] [--unpatched] [--then OUT.pt [options]]...

Each ``--then`` starts another run, made after the one before in the same processes, with its own options (but
``--unpatched``, which must be the same for all) and its own Record: a launch imports torch, transformers and pyvene
once for all its runs. HF's DeepSpeed config, set by a ``--deepspeed`` run, is unset after it, and ``--fsdp 2``'s
``fsdp_on_cpu`` is undone after its run.

``--fsdp 2`` on a machine without GPUs runs HF Trainer's FSDP2 over gloo: accelerate applies FSDP on GPUs only
(on CPU it trains DDP), so the accelerator HF Trainer makes is told it runs on GPUs while it is made, and takes
the FSDP plugin (``fsdp_on_cpu``). HF Trainer then shards, saves and resumes as it does on GPUs: DCP checkpoints,
``_load_from_checkpoint(checkpoint, model_wrapped)`` after ``prepare``.
"""

import argparse
import dataclasses
import gc
import os
import sys
import tempfile
from pathlib import Path

import torch
from transformers.integrations.deepspeed import unset_hf_deepspeed_config

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


def split_runs(argv: list[str]) -> list[list[str]]:
    runs = [[]]
    for argument in argv:
        if argument == "--then":
            runs.append([])
        else:
            runs[-1].append(argument)
    return runs


def run(options) -> None:
    overrides = {}
    if options.save_steps:
        overrides.update(save_strategy="steps", save_steps=options.save_steps)
    if options.resume_from:
        overrides.update(resume_from_checkpoint=options.resume_from)
    undo = None
    if options.fsdp:
        overrides.update(fsdp=True, fsdp_config={"version": options.fsdp})
        if options.fsdp == 2 and not torch.cuda.is_available():
            undo = fsdp_on_cpu()
    if options.deepspeed:
        overrides.update(deepspeed=options.deepspeed if options.deepspeed.endswith(".json") else
                         deepspeed_config(options.deepspeed))
    try:
        with tempfile.TemporaryDirectory() as scratch:
            case = ParityCase(model=options.model, steps=options.steps, trainable_head=not options.frozen_head)
            record = train_with_trainer(case, options.output_dir or scratch,
                                        trainer_class=options.trainer, eval_examples=options.eval_examples,
                                        **overrides)
    finally:
        if undo:
            undo()
        if options.deepspeed:
            unset_hf_deepspeed_config()  # the next run's model is built whole (no zero.Init) unless it asks
        gc.collect()
    if int(os.environ.get("RANK", 0)) == 0:
        torch.save(dataclasses.asdict(record), options.out)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()  # the next run starts on every rank together


runs = [parser.parse_args(argv) for argv in split_runs(sys.argv[1:])]
if len({options.unpatched for options in runs}) > 1:
    parser.error("--unpatched must be given to every run or to none")
if not runs[0].unpatched:
    helpers.patch()
for options in runs:
    run(options)
# Leave the process group before exit: gloo's threads otherwise die at interpreter exit, now and then
# taking the process down with "terminate called without an active exception".
if torch.distributed.is_initialized():
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
