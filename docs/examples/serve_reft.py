"""Load interventions saved by train_reft.py (pyreft's format) onto the base model, in one process, and answer.

    python docs/examples/serve_reft.py --model PATH --interventions out/reft --prompt "..." [--out answer.pt]

``--positions`` and ``--share_weights`` must be the ones the interventions were trained with, and
``--dtype`` the model's dtype in training: the interventions come back in the dtype they were saved in.
"""

import argparse

import torch

import pyvene_dist

pyvene_dist.patch()

import pyreft  # noqa: E402
import transformers  # noqa: E402
from train_reft import answer  # noqa: E402  (this folder)


def load(model_path, interventions, dtype="float32"):
    """The tokenizer, and the base model with the saved interventions, on this machine's first device."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).to(device)
    reft_model = pyreft.ReftModel.load(interventions, model)  # each weight in the dtype it was saved in
    reft_model.set_device(device)
    reft_model.eval()
    return tokenizer, reft_model


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True, help="the base model's folder or hub name, with its tokenizer")
    parser.add_argument("--interventions", required=True, help="the folder ReftModel.save wrote")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--positions", default="l1")
    parser.add_argument("--share_weights", action="store_true")
    parser.add_argument("--max_new_tokens", type=int, default=16)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--out", help="save the logits, token ids and text here (torch.save)")
    options = parser.parse_args()
    tokenizer, reft_model = load(options.model, options.interventions, options.dtype)
    result = answer(reft_model, tokenizer, options, options.prompt)
    print(f"{options.prompt!r} -> {result['text']!r}")
    if options.out:
        torch.save(result, options.out)


if __name__ == "__main__":
    main()
