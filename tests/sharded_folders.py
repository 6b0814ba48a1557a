"""What the sharded-loading tests share (tests/fixes/test_sharded_loading.py, test_fsdp_base_unsaved.py,
test_zero3_base_unsaved.py): a user's model folder, the bound of a rank's share, what a rank read (from
pyvene_dist's log), the gathers of a base weight whole, and one HF Trainer run saved and resumed."""

import contextlib
import logging
import math
import os
from unittest import mock

import torch
import torch.distributed as dist

import helpers
from pyvene_dist import loading
from pyvene_dist.testing import models
from pyvene_dist.testing.check_runs import CheckCase

LAYERS = 2


def save_folder(root) -> str:
    """A user's model folder: a Llama of hidden 64 and its tokenizer, float32 safetensors (save_pretrained)."""
    return str(models.save_checkpoint(root / "llama", hidden=64, layers=LAYERS))


def whole(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder)


def share_bound(model, world_size: int) -> float:
    """Bytes a rank may read or hold of ``model``: its share, plus two rows of every tensor (a ZeRO-3 partition
    starts and ends inside rows, and FSDP2 gives a rank whole rows of an uneven split) and the non-persistent
    buffers every rank keeps whole."""
    rows = 0
    for tensor in list(model.parameters()) + list(model.buffers()):
        shape = tuple(getattr(tensor, "ds_shape", None) or tensor.shape)
        rows += 2 * (math.prod(shape[1:]) if len(shape) > 1 else 1) * tensor.element_size()
    return loading.whole_bytes(model) / world_size + rows


class _Reads(logging.Handler):
    """pyvene_dist's line per sharded load: what this rank read."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.read = []

    def emit(self, record):
        if hasattr(record, "bytes_read"):
            self.read.append(record.bytes_read)


@contextlib.contextmanager
def _counting_gathers_of_the_base():
    """Count every gather of a base weight whole outside FSDP2's and ZeRO-3's forward and backward: a ``DTensor``'s
    ``full_tensor`` or ``redistribute`` (the interventions stay plain tensors under FSDP2), and ZeRO-3's
    ``GatheredParameters`` over a frozen parameter (the interventions train)."""
    import deepspeed
    from torch.distributed.tensor import DTensor

    counted = []
    full_tensor, redistribute, gathered = DTensor.full_tensor, DTensor.redistribute, deepspeed.zero.GatheredParameters

    def counting(original):
        def gather(self, *args, **kwargs):
            counted.append(tuple(self.shape))
            return original(self, *args, **kwargs)
        return gather

    class Gathered(gathered):
        def __init__(self, params, *args, **kwargs):
            params = [params] if isinstance(params, torch.Tensor) else list(params or [])
            counted.extend(tuple(p.ds_shape) for p in params if hasattr(p, "ds_id") and not p.requires_grad)
            super().__init__(params, *args, **kwargs)

    DTensor.full_tensor, DTensor.redistribute = counting(full_tensor), counting(redistribute)
    deepspeed.zero.GatheredParameters = Gathered
    try:
        yield counted
    finally:
        DTensor.full_tensor, DTensor.redistribute = full_tensor, redistribute
        deepspeed.zero.GatheredParameters = gathered


def trained_saved_and_resumed(folder, out, strategy: str) -> None:
    """HF Trainer under ``strategy`` ("fsdp2": accelerate's plugin with cpu_ram_efficient_loading; "zero3") trains
    two steps saving a checkpoint after the first, then a second run resumes from it: each load reads a rank's
    share, the checkpoint is smaller than the base (it held the base again), nothing gathers a base weight whole,
    and the resumed run ends where the uninterrupted one did."""
    from transformers import Trainer

    from pyvene_dist.testing.hf import deepspeed_config, fsdp_on_cpu, train_with_trainer
    from pyvene_dist.testing.strategies import STRATEGIES

    helpers.patch()
    reads = _Reads()
    logging.getLogger("pyvene_dist").addHandler(reads)
    logging.getLogger("pyvene_dist").setLevel(logging.INFO)
    base = whole(folder)
    bound = share_bound(base, dist.get_world_size())
    make_accelerator = Trainer.create_accelerator_and_postprocess
    arguments = STRATEGIES["fsdp2"].trainer_arguments() if strategy == "fsdp2" else {"deepspeed": deepspeed_config("3")}
    case = CheckCase(model=folder, layers=(0, LAYERS - 1), steps=2, batch_size=4, accumulation=1)
    try:
        with _counting_gathers_of_the_base() as gathers, mock.patch.dict(os.environ):  # accelerate sets its own
            fsdp_on_cpu()  # HF Trainer takes accelerate's FSDP plugin on the CPU too, and sharded loading knows it
            uninterrupted = train_with_trainer(case, str(out / "first"), save_strategy="steps", save_steps=1,
                                               **arguments)
            resumed = train_with_trainer(case, str(out / "second"), **arguments,
                                         resume_from_checkpoint=str(out / "first" / "checkpoint-1"))
    finally:
        Trainer.create_accelerator_and_postprocess = make_accelerator
        logging.getLogger("pyvene_dist").removeHandler(reads)
    assert gathers == [], (strategy, gathers)
    assert len(reads.read) == 2 and all(read <= bound for read in reads.read), (strategy, reads.read, bound)
    files = [file for file in (out / "first" / "checkpoint-1").rglob("*") if file.is_file()]
    saved = sum(file.stat().st_size for file in files)
    assert saved < loading.whole_bytes(base), (strategy, sorted((file.name, file.stat().st_size) for file in files))
    for name, value in uninterrupted.weights.items():
        torch.testing.assert_close(resumed.weights[name], value, rtol=1e-6, atol=1e-7, msg=f"{strategy} {name}")
