"""Quantized bases (docs/quantized.md): three questions, one script.

``--loading`` (CPU or GPU; Linux): the peak host memory of loading a saved model with ``from_pretrained``, plain
and quantized by bitsandbytes, each load in a fresh process (the peak resident set, reset just before the load),
``--runs`` times each. Every rank of a launcher loads this way today: nothing is received from rank 0.

``--training`` (one GPU): a Llama-3-8B-shaped base (random weights made on the GPU, saved, loaded back 4-bit nf4,
its storage bf16) trained with LoReFT and with PEFT QLoRA (r=8 on q and v), side by side in interleaved rounds:
step time p20/p50/p80 and peak memory; the ReFT row carries its ratio to QLoRA's.

``--planner`` (one GPU): one Llama-2-70B-shaped decoder layer quantized on the GPU and the 70B's embedding and
head in bf16, their real memory (``torch.cuda.memory_allocated``), scaled to 80 layers, beside what
``pyvene-dist plan --quantize 4bit`` counts for them.

    python benchmarks/quantized.py --loading --out benchmarks/results/quantized-loading-cpu.jsonl
    python benchmarks/quantized.py --training --planner --out benchmarks/results/quantized-1xH200.jsonl
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

#: Llama-3-8B's shape (random weights).
LLAMA_3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0,
                  tie_word_embeddings=False)
#: Llama-2-70B's shape, for the planner's check.
LLAMA_2_70B = dict(vocab_size=32000, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                   num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=4096,
                   tie_word_embeddings=False)


# --- loading --------------------------------------------------------------------------------------------------

def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024  # kB
    raise RuntimeError(f"/proc/self/status has no {field}")


def _load_in_this_process(folder: str, quantize: str) -> dict:
    """Load ``folder`` (plain bf16, or quantized) and report the resident set before the load and its peak during
    it (bytes): the peak is reset first, so what the imports reached does not hide the load's."""
    from transformers import AutoModelForCausalLM

    from pyvene_dist.testing.quantized_cases import bits_and_bytes_config

    config = None if quantize == "none" else bits_and_bytes_config(quantize, torch.bfloat16)  # as QuantizedCase
    import bitsandbytes  # noqa: F401 -- imported before the first reading, as from_pretrained would import it
    Path("/proc/self/clear_refs").write_text("5")  # Linux: the peak resident set (VmHWM) starts again from here
    before = _status_bytes("VmRSS")
    model = AutoModelForCausalLM.from_pretrained(folder, quantization_config=config, dtype=torch.bfloat16)
    after = _status_bytes("VmHWM")
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"peak_rss_before_load": before, "peak_rss_after_load": after, "parameter_bytes": held}


def loading(options) -> list[dict]:
    from pyvene_dist.testing import models

    rows = []
    with tempfile.TemporaryDirectory(prefix="pyvene-dist-loading") as folder:
        models.save_checkpoint(folder, hidden=options.hidden, layers=options.layers, intermediate=4 * options.hidden,
                               dtype=torch.bfloat16)
        for quantize in ("none", "4bit", "8bit"):
            runs = []
            for _ in range(options.runs):
                out = subprocess.run([sys.executable, __file__, "--load-once", folder, quantize], capture_output=True,
                                     text=True, check=True)
                runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
            grown = [run["peak_rss_after_load"] - run["peak_rss_before_load"] for run in runs]
            rows.append({
                "measure": "loading_peak_host_memory", "provider": "from_pretrained", "quantize": quantize,
                "model": f"llama hidden {options.hidden}, {options.layers} layers (save_checkpoint, bf16 on disk)",
                "runs": options.runs, "peak_rss_grown_mib": [g / 2**20 for g in grown],
                "median_peak_rss_grown_mib": statistics.median(grown) / 2**20,
                "spread": f"{min(grown) / 2**20:.1f}-{max(grown) / 2**20:.1f} MiB over {options.runs} runs",
                "parameter_mib": runs[0]["parameter_bytes"] / 2**20,
                "note": "each load in a fresh process, after its imports: VmHWM (peak reset through "
                        "/proc/self/clear_refs just before the load) less VmRSS then",
                **common.metadata(torch.device("cpu"), torch.bfloat16),
            })
    return rows


# --- training: ReFT against QLoRA -----------------------------------------------------------------------------

def save_8b(folder: str, layers: int | None, device) -> None:
    """Llama-3-8B's shape with random bf16 weights made on ``device``, saved to ``folder`` as a checkpoint."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**LLAMA_3_8B, **({"num_hidden_layers": layers} if layers else {})})
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder)
    del model
    torch.cuda.empty_cache()


def load_4bit(folder: str, device):
    """The saved base loaded 4-bit (nf4, bf16 storage and compute), as a user's script loads it."""
    from transformers import AutoModelForCausalLM

    from pyvene_dist.testing.quantized_cases import bits_and_bytes_config

    config = bits_and_bytes_config("4bit", torch.bfloat16)
    return AutoModelForCausalLM.from_pretrained(folder, quantization_config=config, dtype=torch.bfloat16,
                                                device_map={"": device}, attn_implementation="sdpa")


def training(options) -> list[dict]:
    """Each provider on a fresh load of the same checkpoint, one after the other (each one's peak is its own).
    QLoRA without ``prepare_model_for_kbit_training``, which casts the norms and embeddings to float32: both
    train over the same bf16 and 4-bit weights."""
    import pyvene_dist

    device = torch.device("cuda", 0)
    rows = []
    with tempfile.TemporaryDirectory(prefix="pyvene-dist-8b") as folder:
        save_8b(folder, options.layers, device)
        for provider in ("peft-qlora", "pyvene_dist"):
            base = load_4bit(folder, device)
            layers = common.middle_layers(base, options.interventions)
            ids = torch.randint(0, base.config.vocab_size, (options.batch, options.seq_len), device=device,
                                generator=torch.Generator(device).manual_seed(0))
            torch.cuda.reset_peak_memory_stats(device)
            if provider == "peft-qlora":
                from peft import LoraConfig, get_peft_model

                model = get_peft_model(base, LoraConfig(r=8, target_modules=["q_proj", "v_proj"],
                                                        layers_to_transform=layers))
                optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
                step = common.lora_step(model, ids, optimizer)
            else:
                pyvene_dist.patch()
                model = common.reft_model(base, layers)
                locations = common.edge_locations(batch=options.batch, seq_len=options.seq_len,
                                                  positions=options.positions, interventions=len(layers),
                                                  device=device)
                batch = common.reft_batch(ids, locations)
                optimizer = torch.optim.AdamW(model.get_trainable_parameters(), lr=1e-4)
                step = common.reft_step(model, batch, optimizer)
            host: dict = {}
            times = common.interleaved({provider: step}, rounds=options.rounds, steps=options.steps,
                                       device=device, host=host, warmup=options.warmup)
            rows.append({"measure": "training_step", "provider": provider, "model": "llama-3-8b shape, 4-bit nf4 "
                         "(bf16 storage), random weights", "layers": options.layers or 32, "batch": options.batch,
                         "seq_len": options.seq_len, "intervened_or_lora_layers": layers,
                         **common.summary(times[provider], host[provider]),
                         "peak_memory_gib": common.peak_memory_gib(device),
                         **common.metadata(device, torch.bfloat16)})
            if provider == "pyvene_dist":
                pyvene_dist.unpatch()
            del model, base, optimizer, step
            torch.cuda.empty_cache()
    qlora, reft = rows
    reft["ratio_to_peft_qlora"] = reft["median_ms"] / qlora["median_ms"]
    reft["memory_ratio_to_peft_qlora"] = reft["peak_memory_gib"] / qlora["peak_memory_gib"]
    return rows


# --- the planner's figures against real memory ----------------------------------------------------------------

def planner(options) -> list[dict]:
    import bitsandbytes as bnb
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from pyvene_dist import memory_plan

    device = torch.device("cuda", 0)
    config = LlamaConfig(**LLAMA_2_70B)
    torch.cuda.empty_cache()
    start = torch.cuda.memory_allocated(device)
    with torch.device("meta"):
        layer = LlamaDecoderLayer(config, 0)
    for name, module in list(layer.named_modules()):  # each linear quantized on the GPU, as bitsandbytes loads it
        for child, linear in list(module.named_children()):
            if isinstance(linear, torch.nn.Linear):
                quantized = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=False,
                                              compute_dtype=torch.bfloat16, quant_type="nf4",
                                              quant_storage=torch.bfloat16, device="cpu")
                quantized.weight = bnb.nn.Params4bit(torch.randn(linear.out_features, linear.in_features,
                                                                 dtype=torch.bfloat16) * 0.02, requires_grad=False,
                                                     quant_type="nf4", quant_storage=torch.bfloat16)
                setattr(module, child, quantized.to(device))
    for norm in (layer.input_layernorm, layer.post_attention_layernorm):
        norm.to_empty(device=device)
    one_layer = torch.cuda.memory_allocated(device) - start
    embeddings = torch.empty(2, config.vocab_size, config.hidden_size, dtype=torch.bfloat16, device=device)
    outer = embeddings.numel() * 2
    measured = 80 * one_layer + outer + config.hidden_size * 2
    with torch.device("meta"):
        from transformers import LlamaForCausalLM

        shape = memory_plan.shape_of(LlamaForCausalLM(config), name="llama-2-70b")
    planned = memory_plan.weight_bytes(shape, memory_plan.Run(gpus=1, quantize="4bit"))
    return [{"measure": "planner_weights_4bit", "model": "llama-2-70b shape", "one_layer_bytes": one_layer,
             "embedding_and_head_bytes": outer, "measured_scaled_gib": measured / 2**30,
             "planned_gib": planned / 2**30, "planned_over_measured": planned / measured,
             **common.metadata(device, torch.bfloat16)}]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--loading", action="store_true")
    parser.add_argument("--training", action="store_true")
    parser.add_argument("--planner", action="store_true")
    parser.add_argument("--load-once", nargs=2, metavar=("FOLDER", "QUANTIZE"), help=argparse.SUPPRESS)
    parser.add_argument("--hidden", type=int, default=1024, help="--loading: the saved model's hidden size")
    parser.add_argument("--layers", type=int, help="--loading: decoder layers (default 8); --training: of the "
                        "8B's 32 (default all)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--positions", type=int, default=10)
    parser.add_argument("--interventions", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", help="append the rows to this JSONL file")
    options = parser.parse_args(argv)
    if options.load_once:
        print(json.dumps(_load_in_this_process(*options.load_once)))
        return 0
    rows = []
    if options.loading:
        rows += loading(argparse.Namespace(**{**vars(options), "layers": options.layers or 8}))
    if options.training:
        rows += training(options)
    if options.planner:
        rows += planner(options)
    for row in rows:
        print(json.dumps({k: v for k, v in row.items() if k not in ("versions",)}))
    if options.out:
        common.append_rows(options.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
