"""Sharded loading on one GPU (issue 47): the GPU and host memory of loading a saved model in a process group of one,
each way in a fresh process, against the model's bytes.

    python benchmarks/loading_gpu.py --out benchmarks/results/loading-1xH200.jsonl

A Llama-3-8B-shaped folder with ``--layers`` decoder layers (random bf16 weights made on the GPU, ``save_pretrained``)
is loaded, in a fresh process each: ``fsdp2`` (``pyvene_dist.loading.sharded()``, a ReFT built on it,
``fully_shard_model``), ``fsdp2-4bit`` (the same in 4 bits: nf4, bf16 storage), ``zero3`` (transformers' ``zero.Init``
under an HF DeepSpeed config, then ``deepspeed.initialize``), ``device_map`` (``from_pretrained(device_map={"": 0})``,
transformers' own load) and ``whole-then-shard`` (``from_pretrained`` on the CPU, then moved and sharded: what a load
was before, for reference). Rows: the GPU's peak (``torch.cuda.max_memory_allocated``) and the host's (``VmHWM`` less
the resident set before the load), each over the model's bytes; goal <= 1.10 x for the GPU in a process group of one.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import common  # noqa: E402

LLAMA_3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                  num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0, tie_word_embeddings=False)
WAYS = ("fsdp2", "fsdp2-4bit", "zero3", "device_map", "whole-then-shard")


def status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def load_once(folder: str, way: str) -> dict:
    """In this (fresh) process: one load ``way``, in a process group of one on GPU 0."""
    import torch.distributed as dist

    import pyvene_dist
    from pyvene_dist import loading
    from pyvene_dist.fully_shard import fully_shard_model
    from pyvene_dist.testing import models
    from transformers import AutoModelForCausalLM

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29555"), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl")
    pyvene_dist.patch()
    import deepspeed  # noqa: F401 -- imported before the first reading, as a ZeRO-3 script imports it
    from pyvene_dist.testing.quantized_cases import bits_and_bytes_config

    Path("/proc/self/clear_refs").write_text("5")
    host_before = status("VmRSS")
    torch.cuda.reset_peak_memory_stats()
    if way in ("fsdp2", "fsdp2-4bit"):
        quantization = bits_and_bytes_config("4bit", torch.bfloat16) if way == "fsdp2-4bit" else None
        with loading.sharded():
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16,
                                                         quantization_config=quantization)
        fully_shard_model(models.reft_model(model, layers=(0,), dtype=torch.bfloat16, seed=1))
    elif way == "zero3":
        from transformers.integrations.deepspeed import HfDeepSpeedConfig

        config = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
                  "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
        held = HfDeepSpeedConfig(config)  # noqa: F841 -- alive through from_pretrained
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    elif way == "device_map":
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, device_map={"": 0})
    else:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
        fully_shard_model(models.reft_model(model.cuda(), layers=(0,), dtype=torch.bfloat16, seed=1))
    torch.cuda.synchronize()
    read = loading.report(model)
    result = {"way": way, "gpu_peak": torch.cuda.max_memory_allocated(), "gpu_held": torch.cuda.memory_allocated(),
              "host_grown": status("VmHWM") - host_before, "bytes_read": read.bytes_read if read else None}
    dist.destroy_process_group()
    return result


def save_folder(folder: str, layers: int) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(LlamaConfig(**LLAMA_3_8B, num_hidden_layers=layers)).to(torch.bfloat16)
    model.save_pretrained(folder)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--ways", default=",".join(WAYS))
    parser.add_argument("--once", nargs=2, metavar=("FOLDER", "WAY"), help=argparse.SUPPRESS)
    parser.add_argument("--out")
    options = parser.parse_args(argv)
    if options.once:
        print(json.dumps(load_once(*options.once)))
        return 0
    rows = []
    with tempfile.TemporaryDirectory(prefix="pyvene-dist-loading-gpu") as folder:
        save_folder(folder, options.layers)
        size = sum(file.stat().st_size for file in Path(folder).glob("*.safetensors"))
        for way in options.ways.split(","):
            done = subprocess.run([sys.executable, __file__, "--once", folder, way], capture_output=True, text=True)
            if done.returncode:
                rows.append({"measure": "load_memory", "way": way, "error": done.stderr[-3000:]})
                print(way, "failed:", done.stderr[-1500:], flush=True)
                continue
            found = json.loads(done.stdout.strip().splitlines()[-1])
            rows.append({"measure": "load_memory", **found, "model_bytes": size,
                         "gpu_peak_over_model": found["gpu_peak"] / size,
                         "host_grown_over_model": found["host_grown"] / size,
                         "model": f"llama-3-8b shape, {options.layers} layers, bf16 safetensors", "runs": 1,
                         **common.metadata(torch.device("cuda", 0), torch.bfloat16)})
            print(json.dumps({k: rows[-1][k] for k in ("way", "gpu_peak_over_model", "host_grown_over_model")}),
                  flush=True)
    if options.out:
        common.append_rows(options.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
