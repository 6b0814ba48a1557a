"""`pyvene-dist plan --quantize 4bit|8bit`: the quantized base's bytes per GPU under each strategy, against
arithmetic done by hand in this file (never plan's own), and what it says fits (docs/quantized.md)."""

from __future__ import annotations

import json

import pytest

from pyvene_dist import memory_plan
from pyvene_dist.__main__ import main

#: A made-up shape with round numbers: 10,000 parameters, of which 7,680 are the 4 decoder layers' linear weights
#: (1,920 a layer, 256 output rows a layer), the largest linear 512 elements, the largest outer module 1,000.
SHAPE = memory_plan.Shape(name="made-up", parameters=10_000, layer_parameters=2_000, largest_outer_module=1_000,
                          layers=4, hidden=16, intermediate=32, heads=2, kv_heads=2, vocab=100, llama_like=True,
                          quantizable=7_680, layer_quantizable=1_920, largest_linear=512, linear_rows=1_024)
#: ZeRO-3's reduce bucket at 100 elements so that the hand sums stay small.
RUN = memory_plan.Run(gpus=2, dtype="bf16", layers=(0,), zero={"reduce_bucket_size": 100})


def test_4bit_weights_and_gathered_bytes_by_hand():
    run = memory_plan.Run(**{**RUN.__dict__, "quantize": "4bit"})
    found = {e.strategy: e for e in memory_plan.plan(SHAPE, run)}
    assert list(found) == ["ddp", "fsdp2", "fsdp2-offload", "zero2", "zero3", "zero3-offload", "device_map"]
    # 4-bit: 0.5 byte an element + a float32 absmax per 64 = 0.5625. Whole base: 2,320 bf16 elements x 2 = 4,640,
    # plus 7,680 x 0.5625 = 4,320: 8,960 bytes. Dequantized for compute: the largest linear, 512 x 2 = 1,024.
    assert found["ddp"].parameters == 8_960 and found["ddp"].gathered == 1_024
    assert found["zero2"].parameters == 8_960
    # FSDP2: half each; gathered: three layers (80 x 2 + 1,920 x 0.5625 = 1,240 each), the outer module (1,000 x 2)
    # and the dequantized linear: 3,720 + 2,000 + 1,024 = 6,744. Offload keeps the half on the host.
    assert found["fsdp2"].parameters == 4_480 and found["fsdp2"].gathered == 6_744
    assert found["fsdp2-offload"].parameters == 0 and found["fsdp2-offload"].gathered == 6_744
    # ZeRO-3: DeepSpeed's 1e9 live elements hold all 10,000, at 8,960 / 10,000 = 0.896 bytes each: 8,960, plus
    # the reduce bucket (100 x 2) and the dequantized linear: 8,960 + 200 + 1,024 = 10,184.
    assert found["zero3"].parameters == 4_480 and found["zero3"].gathered == pytest.approx(10_184)
    assert found["zero3-offload"].parameters == 0
    assert found["device_map"].parameters == 4_480 and found["device_map"].gathered == 1_024


def test_8bit_is_one_byte_an_element_plus_row_scales_and_fsdp_is_not_planned():
    run = memory_plan.Run(**{**RUN.__dict__, "quantize": "8bit"})
    found = {e.strategy: e for e in memory_plan.plan(SHAPE, run)}
    assert list(found) == ["ddp", "zero2", "zero3", "zero3-offload", "device_map"]
    # 4,640 (bf16 rest) + 7,680 x 1 + 1,024 rows x 4 bytes = 16,416
    assert found["ddp"].parameters == 16_416
    with pytest.raises(ValueError, match="'fsdp2' cannot shard 8bit bases"):
        memory_plan.estimate(SHAPE, run, "fsdp2")


def test_without_quantize_nothing_changes():
    assert [e.strategy for e in memory_plan.plan(SHAPE, RUN)] == list(memory_plan.PLANNED)
    assert memory_plan.estimate(SHAPE, RUN, "fsdp2").gathered == (3 * 2_000 + 1_000) * 2  # docs/plan.md's terms


def test_the_quantizable_weights_of_the_tiny_llama_are_its_linear_layers():
    # hidden 32, 4 heads of 8, 2 key-value heads, intermediate 64, 2 layers: q, o 32 x 32; k, v 16 x 32;
    # gate, up 64 x 32; down 32 x 64: 1,024 + 1,024 + 512 + 512 + 3 x 2,048 = 9,216 a layer;
    # output rows 32 + 32 + 16 + 16 + 64 + 64 + 32 = 256 a layer
    shape = memory_plan.shape_of(memory_plan.meta_model("llama"))
    assert (shape.quantizable, shape.layer_quantizable, shape.largest_linear, shape.linear_rows) == (
        18_432, 9_216, 2_048, 512)


LLAMA_70B = dict(model_type="llama", vocab_size=32000, hidden_size=8192, intermediate_size=28672,
                 num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8, rms_norm_eps=1e-5,
                 max_position_embeddings=4096, tie_word_embeddings=False)


def test_a_4bit_70b_fits_two_24_gb_gpus_with_fsdp2_and_offload(tmp_path, capsys):
    """Llama-2-70B's shape: 80 layers of 855,638,016 linear elements (q, o 8192^2; k, v 8192 x 1024; gate, up,
    down 8192 x 28672) = 68,451,041,280 quantized, at 0.5625 bytes: 38,503,710,720; the other 525,606,912
    (embedding and head 32000 x 8192 each, norms) in bf16: 1,051,213,824. 39,554,924,544 bytes, half a GPU."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA_70B))
    assert main(["plan", "--model", str(config), "--gpus", "2", "--quantize", "4bit", "--gpu-memory", "24",
                 "--batch", "1", "--seq-len", "512", "--json"]) == 0
    rows = {row["strategy"]: row for row in json.loads(capsys.readouterr().out)}
    assert rows["fsdp2"]["parameters"] == 39_554_924_544 / 2
    assert rows["ddp"]["parameters"] == 39_554_924_544 and not rows["ddp"]["fits_checkpointed"]
    assert rows["fsdp2-offload"]["parameters"] == 0 and rows["fsdp2-offload"]["fits"]
    assert rows["fsdp2"]["fits_checkpointed"] and not rows["fsdp2"]["fits"]


def test_the_table_says_what_is_quantized_and_what_is_not_planned(capsys):
    assert main(["plan", "--model", "llama", "--gpus", "2", "--quantize", "8bit"]) == 0
    out = capsys.readouterr().out
    assert "base in 8bit (bitsandbytes), computing in bfloat16" in out
    assert "Not planned: fsdp2, fsdp2-offload (FSDP cannot shard 8bit bases" in out
    with pytest.raises(SystemExit) as exited:
        main(["plan", "--model", "llama", "--gpus", "2", "--quantize", "2bit"])
    assert exited.value.code == 2 and "invalid choice: '2bit'" in capsys.readouterr().err
