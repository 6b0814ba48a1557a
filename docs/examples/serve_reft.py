"""Load interventions saved by train_reft.py (pyreft's format) onto the base model, in one process, and answer.

    python docs/examples/serve_reft.py --interventions out/reft --prompt "..." [--out answer.pt]

train_reft.py saves, beside the interventions, what answering needs (``train_settings.json``): the base
model's folder, the positions, whether the first and last positions share weights, and the dtype. Flags
override them (``--model`` when the model moved); for interventions saved by another script, pass
``--model``, ``--positions``, ``--share_weights`` and ``--dtype`` as they were in training.

What does not fit stops before answering, naming the flag or file: a folder ``ReftModel.save`` did not write (no
``config.json``; a training run's output folder or checkpoint is named as such), a base model folder that is not
there, a file, or a folder without the tokenizer, a base model of another hidden size than the one the
interventions were trained on, an empty or corrupt ``intkey_*.bin`` (read with ``weights_only=True`` only), and
``--positions`` pyreft reads as no position or that the prompt is too short for. A ``--dtype`` other than the interventions' own serves: each
intervention computes in the dtype it was saved in (``pyvene_dist.fixes.checkpoints``).
"""

import argparse
import functools
import glob
import json
import os

import torch

import pyvene_dist

pyvene_dist.patch()

import pyreft  # noqa: E402
import transformers  # noqa: E402
from pyvene_dist import flags  # noqa: E402
from pyvene_dist.positions import parse_positions  # noqa: E402

#: Written by train_reft.py beside the interventions.
SETTINGS = "train_settings.json"
DEFAULTS = {"positions": "l1", "share_weights": False, "dtype": "float32"}


def settings(interventions, **given):
    """What answering needs: the flags given, else what training saved, else ``DEFAULTS``."""
    if not os.path.isfile(os.path.join(interventions, "config.json")):
        what = "has no config.json" if os.path.isdir(interventions) else "is not a folder"
        inside = os.path.join(interventions, "reft")
        if os.path.isfile(os.path.join(inside, "config.json")):
            what += f": it is a training run's --output_dir, whose interventions are in {inside}"
        elif os.path.isfile(os.path.join(interventions, "trainer_state.json")):
            what += ": it is a checkpoint of a run, to resume training from (train_reft.py --resume_from_checkpoint)"
        raise SystemExit(f"serve_reft.py: --interventions {interventions} {what}; expected the folder ReftModel.save "
                         "wrote (train_reft.py saves to OUTPUT_DIR/reft, or --save_dir)")
    path = os.path.join(interventions, SETTINGS)
    saved = {}
    if os.path.isfile(path):
        with open(path) as file:
            saved = json.load(file)
    found = {**DEFAULTS, **saved, **{name: value for name, value in given.items() if value is not None}}
    if "model" not in found:
        raise SystemExit(f"serve_reft.py: {interventions} has no {SETTINGS}; pass --model (and the --positions, "
                         "--share_weights and --dtype of training)")
    model = found["model"]
    source = "--model" if given.get("model") else f"{path} names the base model"
    if not os.path.exists(model) and (os.path.isabs(model) or model.startswith(".") or model.count("/") > 1):
        raise SystemExit(f"serve_reft.py: {source} {model}, which is not there (moved or deleted?); pass --model with "
                         "the base model's folder as it is now")
    if problem := flags.model_folder_problem(model):  # a file: a TypeError; no tokenizer: advice on sentencepiece
        raise SystemExit(f"serve_reft.py: {source} {problem}")
    if positions_counts(found["positions"]) is None:
        raise SystemExit(f"serve_reft.py: --positions {found['positions']!r}: pyreft reads it as no position; "
                         "expected fN, lN or fN+lN as in training (f1+l1, l1)")
    return found


def positions_counts(positions: str) -> tuple[int, int] | None:
    """(first n, last n) for the forms pyreft's ``parse_positions`` reads as written (``fN``, ``lN``, ``fN+lN``);
    None for the rest, which it reads as no position at all (``x3``, ``3``, ``f0+l0``) or misreads. The one parser
    of the project decides (``pyvene_dist.positions.parse_positions``)."""
    try:
        return parse_positions(positions)
    except ValueError:
        return None


def load(model_path, interventions, dtype="float32"):
    """The tokenizer, and the base model with the saved interventions, on this machine's first device."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    check_readable(interventions)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).to(device)
    try:
        reft_model = pyreft.ReftModel.load(interventions, model)  # each weight in the dtype it was saved in
    except KeyError as error:  # pyvene rebuilds each intervention from config.json, which lacks NoReFT's add_bias
        raise SystemExit(f"serve_reft.py: --interventions {interventions}: pyvene's load cannot rebuild its "
                         f"interventions from config.json, which does not record {error} (NoreftIntervention's "
                         "add_bias); build the ReftModel as in training and call load_intervention on it") from None
    except RuntimeError as error:
        if "size mismatch" not in str(error):
            raise
        mismatch = next(line.strip() for line in str(error).splitlines() if "size mismatch" in line)
        raise SystemExit(f"serve_reft.py: the interventions in {interventions} were trained on a model of another "
                         f"size than {model_path} (hidden_size {model.config.hidden_size}): {mismatch}; pass --model "
                         "with the base model they were trained on") from None
    reft_model.set_device(device)
    reft_model.eval()
    return tokenizer, reft_model


def check_readable(interventions) -> None:
    """Read each saved intervention file as ``torch.load`` reads it safely (``weights_only=True``): an empty or
    corrupt file stops here, named, instead of failing inside pyvene with a bare ``EOFError``, or with torch's
    advice to load it with ``weights_only=False``, which would run whatever code the file holds."""
    for path in sorted(glob.glob(os.path.join(interventions, "intkey_*.bin"))):
        try:
            torch.load(path, map_location="cpu", weights_only=True)
        except Exception as error:  # EOFError, UnpicklingError, RuntimeError: torch's wording varies
            reason = "it is empty" if os.path.getsize(path) == 0 else \
                "it is cut short" if isinstance(error, EOFError) else "it is not a state dict torch.save wrote"
            raise SystemExit(f"serve_reft.py: {path} cannot be read: {reason} ({type(error).__name__}); save the "
                             "interventions again (train_reft.py, or ReftModel.save)") from None


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
    options = parser.parse_args(argv)
    if options.max_new_tokens < 1:
        parser.error(f"--max_new_tokens {options.max_new_tokens}: generate at least 1 token (default 16)")
    return options


def check_positions_fit(positions, tokenizer, prompt, program="serve_reft.py") -> None:
    """Stop where ``--positions`` asks for more of the prompt than pyreft takes: at most half of its tokens for
    each of the first and last positions (beyond that, its locations indexed past the prompt: ``RuntimeError:
    index 3 is out of bounds for dimension 1 with size 3``)."""
    length = len(tokenizer(prompt)["input_ids"])
    if length == 0:
        raise SystemExit(f"{program}: --prompt {prompt!r} has no tokens; give a prompt to answer")
    first, last = pyreft.parse_positions(positions)
    if max(first, last) > length // 2:
        raise SystemExit(f"{program}: --positions {positions}: --prompt {prompt!r} has {length} tokens, and "
                         f"pyreft takes at most half of them ({length // 2}) for each of the first and last positions; "
                         "give a longer --prompt, or the fewer positions it fits")


def main(argv=None):
    options = parse_arguments(argv)
    found = settings(options.interventions, model=options.model, positions=options.positions,
                     share_weights=options.share_weights, dtype=options.dtype)
    tokenizer, reft_model = load(found["model"], options.interventions, found["dtype"])
    check_positions_fit(found["positions"], tokenizer, options.prompt)
    result = answer(reft_model, tokenizer, options.prompt, found["positions"], found["share_weights"],
                    options.max_new_tokens)
    print(f"{options.prompt!r} -> {result['text']!r}")
    if options.out:
        torch.save(result, options.out)


if __name__ == "__main__":
    main()
