"""A 4-bit base (nf4, its storage bf16 as FSDP-QLoRA sets it) on GPUs: one device, then FSDP2 and ZeRO-3 in a process
group of one and of two, against one device of the same quantized model (the CPU runs are test_quantized.py's).
Skipped without CUDA; the 2-GPU runs wait for a machine with two."""

import dataclasses

import pytest
import torch
import torch.distributed as dist

import helpers
from pyvene_dist.testing import assert_parity, differences, tolerance, train

pytest.importorskip("bitsandbytes", reason="the quantize extra is not installed")

from pyvene_dist.testing.quantized_cases import QuantizedCase  # noqa: E402

CASES = [
    pytest.param(QuantizedCase(quantize="4bit"), id="4bit-fp32"),
    pytest.param(QuantizedCase(quantize="4bit", dtype="bfloat16", lr=1e-3), id="4bit-bf16"),
]


def _compare(case, strategy):
    helpers.patch()
    candidate = train(case, strategy)
    if dist.get_rank() == 0:
        reference = train(case, "single")
        print(f"{case.quantize} {case.dtype} {strategy}: {differences(reference, candidate)}")
        assert_parity(reference, candidate, tolerance(case, strategy))


@pytest.mark.gpus(1)
@pytest.mark.world_size(1)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("strategy", ["fsdp2", "zero3"])
def test_one_gpu_process_group_matches_one_device(case, strategy):
    _compare(case, strategy)


@pytest.mark.gpus(1)
def test_8bit_trains_on_one_gpu():
    helpers.patch()
    record = train(QuantizedCase(quantize="8bit"), "single")
    assert all(torch.isfinite(torch.tensor(record.losses)))


@pytest.mark.gpus(2)
@pytest.mark.world_size(2)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2", "zero3", "zero3-offload"])
def test_two_gpus_match_one_device(case, strategy):
    _compare(case, strategy)


@pytest.mark.gpus(2)
@pytest.mark.world_size(2)
def test_two_gpus_fsdp2_with_checkpointing():
    _compare(dataclasses.replace(QuantizedCase(quantize="4bit"), checkpointing="non-reentrant"), "fsdp2")
