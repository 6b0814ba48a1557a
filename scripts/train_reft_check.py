"""docs/examples/train_reft.py end to end on one GPU: a 1B-class Llama in bf16 with gradient checkpointing,
trained, saved in pyreft's format, reloaded in a fresh process (docs/examples/serve_reft.py) and answering.

    source scripts/gpu_env.sh && python3 scripts/train_reft_check.py     # on one GPU: 1.0B parameters
    python scripts/train_reft_check.py --tiny          # anywhere, in a minute: hidden 32, 2 layers

The model is built from a LlamaConfig and saved with a BPE tokenizer into $OUT/checkpoint (nothing is
downloaded). Prints the loss curve, peak memory, time, and whether the reloaded model's logits and greedy
tokens match the trained model's; writes $OUT/train_reft_check.json.
"""

import argparse
from importlib import metadata
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT / "docs" / "examples"))
sys.path.insert(0, str(ROOT))

PROMPT = "red cat runs"
BF16_RTOL = 1.6e-2  # docs/index.md#parity: bf16's tolerance


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tiny", action="store_true", help="hidden 32, 2 layers: a smoke run on CPU")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/train_reft_check"))
    options = parser.parse_args()
    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    dtype = "bfloat16"

    from pyvene_dist.testing.models import instruction_examples, save_checkpoint

    shape = dict(hidden=32, layers=2) if options.tiny else dict(hidden=2048, layers=22, heads=32, kv_heads=4,
                                                                intermediate=5632)
    checkpoint = out / "checkpoint"
    save_checkpoint(checkpoint, dtype=torch.bfloat16, **shape)
    (checkpoint / "train.json").write_text(json.dumps(instruction_examples(options.steps * options.batch)))
    from safetensors import safe_open

    parameters = 0
    for shard in checkpoint.glob("*.safetensors"):
        with safe_open(shard, "pt") as weights:
            parameters += sum(torch.Size(weights.get_slice(name).get_shape()).numel() for name in weights.keys())

    import train_reft

    run = out / "run"
    gpu = torch.cuda.is_available()
    if gpu:
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    train_reft.main(["--model", str(checkpoint), "--data", str(checkpoint / "train.json"), "--dtype", dtype,
                     "--layers", "all" if options.tiny else "4,8,12,16", "--positions", "f1+l1",
                     "--bf16", "--gradient_checkpointing", "--max_steps", str(options.steps),
                     "--per_device_train_batch_size", str(options.batch), "--learning_rate", "4e-3",
                     "--logging_steps", "1", "--save_strategy", "no", "--report_to", "none",
                     "--disable_tqdm", "true", "--prompt", PROMPT, "--output_dir", str(run)]
                    + ([] if gpu else ["--use_cpu"]))
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() / 2**30 if gpu else None

    served = out / "served.pt"
    subprocess.run([sys.executable, str(ROOT / "docs" / "examples" / "serve_reft.py"), "--interventions", str(run / "reft"),
                    "--prompt", PROMPT, "--out", str(served)], check=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))})
    trained, reloaded = torch.load(run / "answer.pt"), torch.load(served)
    scale = trained["logits"].abs().max().item()
    logits_difference = (trained["logits"] - reloaded["logits"]).abs().max().item() / scale
    losses = [entry["loss"] for entry in json.loads((run / "trainer_state.json").read_text())["log_history"]
              if "loss" in entry]
    result = {
        "device": torch.cuda.get_device_name() if gpu else "cpu", "parameters": parameters, "dtype": dtype,
        "gradient_checkpointing": True, "steps": options.steps, "batch": options.batch, "losses": losses,
        "peak_memory_gib": peak, "train_and_save_seconds": round(seconds, 1),
        "reloaded_logits_max_rel_difference": logits_difference,
        "reloaded_logits_match": logits_difference <= BF16_RTOL,
        "reloaded_tokens_match": trained["ids"].tolist() == reloaded["ids"].tolist(),
        "trained_answer": trained["text"], "reloaded_answer": reloaded["text"],
        "versions": {name: metadata.version(name) for name in ("torch", "transformers", "pyvene", "pyreft", "deepspeed")},
    }
    (out / "train_reft_check.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    if not (result["reloaded_logits_match"] and result["reloaded_tokens_match"]):
        sys.exit(1)


if __name__ == "__main__":
    main()
