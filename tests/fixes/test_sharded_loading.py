"""Sharded loading (fixes.sharded_loading, pyvene_dist.loading): under FSDP2 and ZeRO-3 each rank reads and keeps
its own share of a model folder's weights, from ``from_pretrained`` to the first step, saves without gathering the
base and resumes reading its share again.

Before: ``from_pretrained`` read every file whole on every rank (under ZeRO-3, rank 0 read them and every rank
gathered each weight whole to copy it in), so a rank held the model whole before sharding it: 1.75 x the model's
bytes under FSDP2, 3.19 x under ZeRO-3 on a 206M folder (benchmarks/loading.py). What a rank read and holds is
counted here from the tensors (``loading.report``, ``loading.local_bytes``), not from its memory."""

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

import helpers
from pyvene_dist import loading
from pyvene_dist.testing import assert_parity, differences, models, tolerance, train
from pyvene_dist.testing.check_runs import CheckCase
from sharded_folders import LAYERS, save_folder, share_bound, whole


def _four_bit():
    """FSDP-QLoRA's layout: nf4, packed in float32 (FSDP2 shards a float storage by rows)."""
    from pyvene_dist.testing.quantized_cases import bits_and_bytes_config

    return bits_and_bytes_config("4bit", torch.float32)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_folder(tmp_path_factory.mktemp("model"))


# --- reading parts of a file ---------------------------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 37), columns=st.integers(1, 9), world=st.integers(1, 5),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.int64]))
def test_every_ranks_part_read_together_is_the_tensor(tmp_path_factory, rows, columns, world, dtype):
    """FSDP2's rows (torch.chunk's split of dimension 0) and ZeRO-3's flat partitions (each ceil(numel / world)
    elements), read by every rank of any world size, put together give back the saved tensor; and a rank reads
    its part and at most two rows more."""
    tensor = (torch.arange(rows * columns) * 7 % 101).reshape(rows, columns).to(dtype)
    path = tmp_path_factory.mktemp("file") / "model.safetensors"
    save_file({"w": tensor}, str(path))
    files = loading.CheckpointFiles([path])
    row_bytes = columns * tensor.element_size()
    blocks, start = [], 0
    for chunk in tensor.chunk(world):
        before = files.bytes_read
        blocks.append(files.block("w", (start, 0), tuple(chunk.shape)))
        assert files.bytes_read - before == chunk.numel() * tensor.element_size()
        start += chunk.shape[0]
    assert torch.equal(torch.cat(blocks), tensor)
    size = -(-tensor.numel() // world)
    parts = []
    for rank in range(world):
        first, last = min(rank * size, tensor.numel()), min((rank + 1) * size, tensor.numel())
        before = files.bytes_read
        parts.append(files.elements("w", first, last))
        assert files.bytes_read - before <= (last - first) * tensor.element_size() + 2 * row_bytes
    assert torch.equal(torch.cat(parts).reshape(tensor.shape), tensor)
    files.close()


def test_a_part_outside_the_tensor_is_refused_naming_it(tmp_path):
    save_file({"w": torch.zeros(4, 3)}, str(tmp_path / "model.safetensors"))
    files = loading.CheckpointFiles.in_folder(tmp_path)
    with pytest.raises(ValueError, match=r"'w' of shape \(4, 3\): no block at offsets \(3, 0\) of sizes \(2, 3\)"):
        files.block("w", (3, 0), (2, 3))
    with pytest.raises(ValueError, match="'w' has 12 elements: no range 10..13"):
        files.elements("w", 10, 13)
    with pytest.raises(KeyError, match="'v' is not in"):
        files.shape("v")


# --- one process: what is refused, what falls back, what the interventions keep --------------------------------


def test_fsdp2_without_cpu_ram_efficient_loading_is_refused_naming_the_flag(patched, folder, monkeypatch):
    """accelerate's FSDP2 without the flag would load the whole model on every rank: refused before any read."""
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    monkeypatch.delenv("FSDP_CPU_RAM_EFFICIENT_LOADING", raising=False)
    monkeypatch.setenv("PYVENE_DIST_FSDP_ON_CPU", "1")  # accelerate applies FSDP on these CPUs (as on a GPU)
    with pytest.raises(loading.ShardedLoadingError, match="fsdp_cpu_ram_efficient_loading: true"):
        AutoModelForCausalLM.from_pretrained(folder)
    monkeypatch.setenv("FSDP_CPU_RAM_EFFICIENT_LOADING", "false")  # HF Trainer's --fsdp_config without it
    with pytest.raises(loading.ShardedLoadingError, match="cpu_ram_efficient_loading"):
        AutoModelForCausalLM.from_pretrained(folder)
    monkeypatch.setenv("PYVENE_DIST_SHARDED_LOADING", "0")  # the way out the message names
    import pyvene_dist

    pyvene_dist.unpatch()
    helpers.patch()
    loaded = AutoModelForCausalLM.from_pretrained(folder)
    assert next(loaded.parameters()).device.type == "cpu"


@pytest.mark.skipif(torch.accelerator.is_available(), reason="accelerate applies FSDP where an accelerator is")
def test_fsdp_flags_on_a_machine_without_accelerator_load_whole_as_accelerate_trains_ddp_there(patched, folder,
                                                                                                 monkeypatch):
    """HF Trainer's FSDP arguments set accelerate's FSDP flags, and on CPUs accelerate trains DDP all the same: a
    base left on the meta device there failed in the first step (``Cannot copy out of meta tensor``). Where
    accelerate is made to apply FSDP on CPUs (``fsdp_on_cpu``), the load is sharded."""
    from transformers import AutoModelForCausalLM

    from pyvene_dist.fixes.sharded_loading import launch_shards

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    monkeypatch.setenv("FSDP_CPU_RAM_EFFICIENT_LOADING", "true")
    monkeypatch.delenv("PYVENE_DIST_FSDP_ON_CPU", raising=False)
    loaded = AutoModelForCausalLM.from_pretrained(folder)
    assert {parameter.device.type for parameter in loaded.parameters()} == {"cpu"}
    monkeypatch.setenv("PYVENE_DIST_FSDP_ON_CPU", "1")
    assert launch_shards() == "fsdp2"


def test_accelerate_zero3_without_zero3_init_is_refused_naming_the_flag(patched, folder, monkeypatch):
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO3_INIT", "false")
    with pytest.raises(loading.ShardedLoadingError, match="zero3_init_flag: true"):
        AutoModelForCausalLM.from_pretrained(folder)


def test_a_folder_it_cannot_read_in_parts_loads_whole_saying_why(patched, folder, tmp_path):
    from transformers import AutoModelForCausalLM

    loaded = whole(folder)  # a folder of older checkpoints: pytorch_model.bin (transformers 5 saves safetensors)
    loaded.config.to_json_file(tmp_path / "config.json")
    torch.save(loaded.state_dict(), tmp_path / "pytorch_model.bin")
    with loading.sharded(), pytest.warns(RuntimeWarning, match="loaded whole on every rank .* not safetensors"):
        model = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert loading.report(model) is None


def test_the_interventions_keep_their_weights_over_a_base_still_on_the_meta_device(patched, folder):
    """pyreft's get_reft_model calls set_device(model.device): the meta device, where the interventions lost the
    weights they were built with."""
    from transformers import AutoModelForCausalLM

    with loading.sharded():
        meta = AutoModelForCausalLM.from_pretrained(folder)
    assert {p.device.type for p in meta.parameters()} == {"meta"} and loading.report(meta).pending
    on_meta = models.reft_model(meta, layers=(0, 1), seed=3)
    on_cpu = models.reft_model(whole(folder), layers=(0, 1), seed=3)
    for (name, built), (_, expected) in zip(on_meta.interventions.named_parameters(),
                                            on_cpu.interventions.named_parameters()):
        assert built.device.type == "cpu" and torch.equal(built, expected), name


# --- worlds: each rank's share, under FSDP2 and ZeRO-3 -----------------------------------------------------------


@pytest.mark.world_size(2, timeout=600)
def test_each_rank_reads_and_keeps_only_its_share(folder):
    """FSDP2 by hand (``loading.sharded()``, then ``fully_shard``) and ZeRO-3 (transformers' ``zero.Init`` under an
    HF DeepSpeed config): nothing is read before sharding, each rank reads and holds about half, and the shards
    put together are the folder's weights."""
    import deepspeed
    from transformers import AutoModelForCausalLM
    from transformers.integrations.deepspeed import HfDeepSpeedConfig, unset_hf_deepspeed_config

    from pyvene_dist.fully_shard import fully_shard_model

    helpers.patch()
    reference = whole(folder)
    world = dist.get_world_size()
    with loading.sharded():
        fsdp = AutoModelForCausalLM.from_pretrained(folder)
    assert loading.local_bytes(fsdp) < 0.01 * loading.whole_bytes(fsdp)  # meta: nothing read, nothing held
    reft = models.reft_model(fsdp, layers=(0, 1), seed=3)
    fully_shard_model(reft)
    read = loading.report(reft)
    assert read.how == "fsdp2" and not read.pending
    bound = share_bound(reference, world)
    assert read.bytes_read <= bound and loading.local_bytes(fsdp) <= bound, (read.bytes_read, bound)
    for (name, sharded), (_, expected) in zip(fsdp.named_parameters(), reference.named_parameters()):
        assert torch.equal(sharded.full_tensor(), expected), name

    with loading.sharded():  # 4-bit: each rank quantizes its rows of each weight
        quantized = AutoModelForCausalLM.from_pretrained(folder, quantization_config=_four_bit())
    fully_shard_model(models.reft_model(quantized, layers=(0, 1), seed=3))
    whole_4bit = AutoModelForCausalLM.from_pretrained(folder, quantization_config=_four_bit())
    read = loading.report(quantized)
    assert read.bytes_read <= bound, (read.bytes_read, bound)  # its share of the float weights, read once
    assert loading.local_bytes(quantized) <= share_bound(whole_4bit, world)
    _assert_same_4bit_weights(quantized, whole_4bit)

    held = HfDeepSpeedConfig({"train_micro_batch_size_per_gpu": 1,
                              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})
    try:
        zero = AutoModelForCausalLM.from_pretrained(folder)
    finally:
        del held
        unset_hf_deepspeed_config()
    read = loading.report(zero)
    assert read.how == "zero3" and read.bytes_read <= bound and loading.local_bytes(zero) <= bound
    with deepspeed.zero.GatheredParameters(list(zero.parameters())):
        for (name, partitioned), (_, expected) in zip(zero.named_parameters(), reference.named_parameters()):
            assert torch.equal(partitioned.data, expected), name


def _assert_same_4bit_weights(sharded, expected):
    """Every 4-bit layer dequantizes to the whole load's weight, bit for bit (the packed rows and the scales)."""
    from bitsandbytes.functional import dequantize_4bit

    layers = [(name, layer) for name, layer in expected.named_modules() if type(layer).__name__ == "Linear4bit"]
    assert layers
    for name, layer in layers:
        mine = sharded.get_submodule(name)
        packed = mine.weight.full_tensor()  # compared as bytes: packed nibbles read as floats may be NaNs
        assert torch.equal(packed.view(torch.uint8), layer.weight.data.view(torch.uint8)), name
        assert torch.equal(dequantize_4bit(packed, mine.quant_state),
                           dequantize_4bit(layer.weight.data, layer.weight.quant_state)), name


@pytest.mark.world_size(2, timeout=900)
def test_pyvene_dist_check_trains_a_sharded_load_as_one_process(folder):
    """What ``pyvene-dist check --model FOLDER`` runs: the harness's FSDP2 and ZeRO-3 runners load the folder
    sharded, and train as one process does."""
    helpers.patch()
    case = CheckCase(model=folder, layers=(0, LAYERS - 1), steps=2, batch_size=4)
    candidates = {strategy: train(case, strategy) for strategy in ("fsdp2", "zero3")}
    if dist.get_rank() == 0:
        reference = train(case, "single")
        for strategy, candidate in candidates.items():
            print(f"{strategy}: {differences(reference, candidate)}")
            assert_parity(reference, candidate, tolerance(case, strategy))
