"""Load interventions saved by train_reft.py (pyreft's format) onto the base model, in one process, and answer.

    python docs/examples/serve_reft.py --interventions out/reft --prompt "..." [--out answer.pt]

train_reft.py saves, beside the interventions, what answering needs (``train_settings.json``): the base
model's folder, the positions, whether the first and last positions share weights, and the dtype. Flags
override them (``--model`` when the model moved); for interventions saved by another script, pass
``--model``, ``--positions``, ``--share_weights`` and ``--dtype`` as they were in training.
"""

import argparse
import functools
import json
import os

import torch

import pyvene_dist

pyvene_dist.patch()

import pyreft  # noqa: E402
import transformers  # noqa: E402
from pyvene_dist import flags  # noqa: E402

#: Written by train_reft.py beside the interventions.
SETTINGS = "train_settings.json"
DEFAULTS = {"positions": "l1", "share_weights": False, "dtype": "float32"}


def settings(interventions, **given):
    """What answering needs: the flags given, else what training saved, else ``DEFAULTS``."""
    path = os.path.join(interventions, SETTINGS)
    saved = json.load(open(path)) if os.path.isfile(path) else {}
    found = {**DEFAULTS, **saved, **{name: value for name, value in given.items() if value is not None}}
    if "model" not in found:
        raise SystemExit(f"serve_reft.py: {interventions} has no {SETTINGS}; pass --model (and the --positions, "
                         "--share_weights and --dtype of training)")
    return found


def load(model_path, interventions, dtype="float32"):
    """The tokenizer, and the base model with the saved interventions, on this machine's first device."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).to(device)
    reft_model = pyreft.ReftModel.load(interventions, model)  # each weight in the dtype it was saved in
    reft_model.set_device(device)
    reft_model.eval()
    return tokenizer, reft_model


def unit_locations(reft_model, positions, share_weights, prompt_length):
    """Where each intervention acts on a prompt of ``prompt_length`` tokens, as the training data put it."""
    first, last = pyreft.parse_positions(positions)
    locations = pyreft.get_intervention_locations(
        last_position=prompt_length, first_n=first, last_n=last, pad_mode="last",
        num_interventions=len(reft_model.interventions), share_weights=share_weights)
    return {"sources->base": (None, [[where] for where in locations])}


@torch.no_grad()
def answer(reft_model, tokenizer, prompt, positions, share_weights, max_new_tokens=16):
    """The logits of ``prompt`` and its greedy continuation, with the interventions on the prompt."""
    device = next(reft_model.model.parameters()).device
    inputs = tokenizer(prompt, return_tensors="pt").to(device)
    locations = unit_locations(reft_model, positions, share_weights, inputs["input_ids"].shape[-1])
    _, output = reft_model(inputs, unit_locations=locations)
    _, generated = reft_model.generate(inputs, unit_locations=locations, intervene_on_prompt=True,
                                       max_new_tokens=max_new_tokens, do_sample=False,
                                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return {"logits": output.logits.float().cpu(), "ids": generated[0].cpu(),
            "text": tokenizer.decode(generated[0], skip_special_tokens=True)}


def parse_arguments(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--interventions", required=True, help="the folder train_reft.py (ReftModel.save) wrote")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--model", help=f"the base model's folder, with its tokenizer (default: from {SETTINGS})")
    parser.add_argument("--positions", help=f"as in training, e.g. f1+l1 (default: from {SETTINGS}, else l1)")
    parser.add_argument("--share_weights", "--share-weights", action="store_true", default=None,
                        help=f"the first and last positions share one intervention (default: from {SETTINGS})")
    parser.add_argument("--dtype", type=functools.partial(flags.dtype_name, program="serve_reft.py"),
                        choices=flags.DTYPES, help=f"the model's dtype in training, a torch name (default: from "
                                                   f"{SETTINGS}, else float32)")
    parser.add_argument("--max_new_tokens", "--max-new-tokens", type=int, default=16)
    parser.add_argument("--out", help="save the logits, token ids and text here (torch.save)")
    return parser.parse_args(argv)


def main():
    options = parse_arguments()
    found = settings(options.interventions, model=options.model, positions=options.positions,
                     share_weights=options.share_weights, dtype=options.dtype)
    tokenizer, reft_model = load(found["model"], options.interventions, found["dtype"])
    result = answer(reft_model, tokenizer, options.prompt, found["positions"], found["share_weights"],
                    options.max_new_tokens)
    print(f"{options.prompt!r} -> {result['text']!r}")
    if options.out:
        torch.save(result, options.out)


if __name__ == "__main__":
    main()
