"""Train ReFT interventions on your own model with pyreft, on one device or under any launcher.

    python docs/examples/train_reft.py --model PATH --data train.json --output_dir out
    torchrun --nproc_per_node 2 docs/examples/train_reft.py --model PATH --data train.json --output_dir out
    accelerate launch --config_file docs/configs/accelerate-ddp.yaml docs/examples/train_reft.py --model PATH ...
    accelerate launch --config_file docs/configs/accelerate-zero3.yaml docs/examples/train_reft.py --model PATH ...
    deepspeed --num_gpus 2 docs/examples/train_reft.py --deepspeed docs/configs/deepspeed-zero3.json --model PATH ...

``--model`` is a folder (or hub name) holding the model and its tokenizer; ``--data`` a JSON list (or
JSONL) of {"instruction": ..., "output": ...}. Every HF ``TrainingArguments`` flag works as with HF
Trainer (``--bf16``, ``--gradient_checkpointing``, ``--deepspeed``, ``--per_device_train_batch_size``).
The interventions are saved once, in pyreft's format (``ReftModel.save``), to ``--save_dir``
(default ``OUTPUT_DIR/reft``), with ``train_settings.json`` beside them (the model, layers, positions,
shared weights, dtype): ``docs/examples/serve_reft.py --interventions OUTPUT_DIR/reft`` answers with them.
Examples are cut to ``--model_max_length`` tokens (default: the model's ``max_position_embeddings``).
``--quantize 4bit`` loads the base as QLoRA does (NF4, bitsandbytes), packed in ``--dtype`` so that FSDP2 shards it.
``--resume_from_checkpoint OUTPUT_DIR/checkpoint-N`` (or ``True``: the newest in ``--output_dir``) continues a run
that saved checkpoints (``--save_strategy steps --save_steps N``) where it stopped; each checkpoint holds its own
``train_settings.json``, and a resume with other ``--model``, ``--layers``, ``--positions``, ``--share_weights``,
``--component``, ``--intervention`` or ``--rank`` stops, naming the flag, the checkpoint's value and the one given.

A run that would train nothing stops before the first step, naming the flag or the example: ``--positions`` that
pyreft reads as no position (``x3``, ``f0+l0``), ``--rank 0``, no examples, an example without a string
``output``, every answer cut off by ``--model_max_length``, positions beyond every prompt (pyreft caps each
of first and last at half the prompt and repeats the first answer token's position for the rest), first
positions only (``fN``) on the last layer alone (its output there reaches no answer), ``--max_steps 0`` or no
epochs, or a resume from a checkpoint that trained them already. Examples that lose their answer or have their
positions capped while others do not are named in a warning, as is an intervention for the first positions on the
last layer among others (once, from the first rank). A mistake in the flags is one line, ``train_reft.py: error:
...``, and a hint. The checks of HF's flags, the launcher and the folders are in ``trainer_flags.py`` beside this
script; launched as several processes on a machine with no GPU, the ranks train as one world with or without
``--use_cpu`` (``pyvene_dist.fixes.hf_trainer``), and ``--deepspeed`` without a launcher runs as one process.
"""

import argparse
import dataclasses
import importlib.util
import json
import os
import re
import tempfile
import warnings

import torch

import pyvene_dist

pyvene_dist.patch()  # before pyreft builds the model

import pyreft  # noqa: E402
import transformers  # noqa: E402
from pyvene_dist import flags  # noqa: E402
from pyvene_dist.gather import gathered  # noqa: E402
from serve_reft import SETTINGS, answer, check_positions_fit, positions_counts  # noqa: E402  (this folder)
from trainer_flags import (ArgumentParser, RecordSettings, check_steps, check_steps_left,  # noqa: E402
                           check_trained_after_resume, check_writable, checkpoint_to_resume, closest_flag,
                           leaving_the_process_group_on_error, prepare_deepspeed, trained_steps)

logger = transformers.utils.logging.get_logger("train_reft")
#: ``--quantize``'s values: bitsandbytes' 4-bit and 8-bit bases (docs/quantized.md).
QUANTIZATIONS = ("4bit", "8bit")


@dataclasses.dataclass
class ReftArguments:
    model: str = dataclasses.field(metadata={"help": "a model folder or hub name, with its tokenizer"})
    data: str = dataclasses.field(metadata={"help": "JSON list or JSONL of {'instruction': ..., 'output': ...}"})
    layers: str = dataclasses.field(default="all", metadata={"help": "'all', or layer numbers as 2,10,18"})
    positions: str = dataclasses.field(default="l1", metadata={"help": "prompt positions: first n and last n, "
                                                                       "as pyreft writes them: 'f1+l1', 'l1', 'f2' "
                                                                       "(at most half of the shortest prompt each)"})
    share_weights: bool = dataclasses.field(default=False, metadata={"help": "one intervention for f and l"})
    component: str = dataclasses.field(default="block_output", metadata={"help": "where in each layer"})
    rank: int = dataclasses.field(default=4, metadata={"help": "low_rank_dimension, at least 1"})
    intervention: str = dataclasses.field(default="LoreftIntervention", metadata={"help": "a pyreft class"})
    dtype: str = dataclasses.field(default="float32", metadata={"help": "of the model and the interventions"})
    quantize: str = dataclasses.field(default=None, metadata={
        "help": "load the base in 4bit (NF4, computed and packed in --dtype, as QLoRA and FSDP-QLoRA load it) or 8bit "
                "(bitsandbytes); the interventions train in --dtype"})
    save_dir: str = dataclasses.field(default=None, metadata={"help": "default: OUTPUT_DIR/reft"})
    prompt: str = dataclasses.field(default=None, metadata={"help": "after training, answer it greedily and "
                                                                    "save the answer to OUTPUT_DIR/answer.pt"})
    max_new_tokens: int = dataclasses.field(default=16, metadata={"help": "for --prompt"})
    model_max_length: int = dataclasses.field(default=None, metadata={
        "help": "tokens kept of each example, prompt and answer (pyreft's data helpers truncate to it); default: "
                "the model's max_position_embeddings"})


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """``--help``: this docstring as written, and each flag's default (HF's parser shows them)."""


def parse_arguments(argv=None):
    parser = ArgumentParser((ReftArguments, transformers.TrainingArguments), prog="train_reft.py",
                            description=__doc__, formatter_class=HelpFormatter)
    given, _ = parser.parse_known_args(argv)
    prepare_deepspeed(parser, given.deepspeed)  # before the TrainingArguments, which join DeepSpeed's group
    reft_args, training_args, unknown = parser.parse_args_into_dataclasses(argv, return_remaining_strings=True)
    if unknown:  # HF raised a ValueError with a traceback
        parser.error(f"unrecognized arguments: {' '.join(unknown)}{closest_flag(parser, unknown)}")
    if not hasattr(pyreft, reft_args.intervention):
        parser.error(f"--intervention {reft_args.intervention!r} is not a pyreft class (LoreftIntervention, ...)")
    reft_args.dtype = flags.dtype_name(reft_args.dtype, program="train_reft.py")  # bf16, as before, still works
    if reft_args.dtype not in flags.DTYPES:  # float64 failed in the first step: "double != float"
        parser.error(f"--dtype {reft_args.dtype!r}: expected one of {', '.join(flags.DTYPES)}")
    if reft_args.quantize not in (None, *QUANTIZATIONS):
        parser.error(f"--quantize {reft_args.quantize!r}: expected one of {', '.join(QUANTIZATIONS)}")
    if reft_args.quantize and importlib.util.find_spec("bitsandbytes") is None:
        parser.error(f"--quantize {reft_args.quantize}: needs bitsandbytes, which is not installed "
                     "(pip install -e '.[quantize]')")
    if ";" in reft_args.layers:  # the separator of pyreft's examples, and of this script before
        warnings.warn(f"--layers {reft_args.layers!r}: separate layers with commas, as "
                      f"{reft_args.layers.replace(';', ',')}; ';' will stop working", FutureWarning, stacklevel=2)
        reft_args.layers = reft_args.layers.replace(";", ",")
    if reft_args.layers != "all" and not re.fullmatch(r"\d+(,\d+)*", reft_args.layers.replace(" ", "")):
        parser.error(f"--layers {reft_args.layers!r}: expected 'all' or layer numbers separated by commas, as 2,10,18")
    if reft_args.rank < 1:
        parser.error(f"--rank {reft_args.rank}: an intervention of rank {reft_args.rank} has nothing to train; "
                     "give a low_rank_dimension of at least 1 (default 4)")
    if positions_counts(reft_args.positions) is None:
        parser.error(f"--positions {reft_args.positions!r}: pyreft reads it as no position, and nothing would train; "
                     "expected first n and/or last n prompt positions as fN, lN or fN+lN with a count of at least 1 "
                     "(f1+l1, l1, f2)")
    if reft_args.model_max_length is not None and reft_args.model_max_length < 2:
        parser.error(f"--model_max_length {reft_args.model_max_length}: an example needs at least one prompt and "
                     "one answer token; give at least 2, or leave it out for the model's length")
    if problem := flags.model_folder_problem(reft_args.model):
        parser.error(f"--model {problem}")
    check_steps(parser, training_args)
    training_args.resume_from_checkpoint = checkpoint_to_resume(parser, training_args)
    if training_args.resume_from_checkpoint:
        check_steps_left(parser, training_args)
        check_resume(parser, reft_args, training_args.resume_from_checkpoint)
    return reft_args, training_args


#: The flags that decide which interventions a checkpoint holds, by their names in its train_settings.json.
RESUMED = ("model", "layers", "positions", "share_weights", "component", "intervention", "rank")


def check_resume(parser, reft_args, checkpoint) -> None:
    """Stop a resume whose flags build other interventions than the checkpoint's, naming each flag, the checkpoint's
    value and the one given: LoReFT's weights loaded into DiReFT without a word, another rank or layers failed with
    bare ``size mismatch`` or ``Missing key(s)`` errors. ``--dtype`` may change (the weights are cast). A checkpoint
    without train_settings.json (an earlier script's) is checked as it loads (``main``)."""
    path = os.path.join(checkpoint, SETTINGS)
    if not os.path.isfile(path):
        return
    with open(path) as file:
        saved = json.load(file)
    try:
        given = train_settings(reft_args, transformers.AutoConfig.from_pretrained(reft_args.model))
    except OSError as error:  # a hub name that is neither cached nor reachable
        parser.error(f"--model {reft_args.model}: {error}")
    except ValueError as error:  # layers outside the model
        parser.error(str(error))
    model = str(saved.get("model"))
    moved = os.path.isabs(model) and not os.path.exists(model)  # its interventions' shapes are checked as they load
    if moved or os.path.exists(model) and os.path.realpath(model) == os.path.realpath(given["model"]):
        given["model"] = model
    first, last = positions_counts(given["positions"])
    differ = [name for name in RESUMED if name in saved and saved[name] != given[name]
              and not (name == "positions" and positions_counts(saved[name]) == (first, last))
              and not (name == "share_weights" and not (first and last))]
    if differ:
        parser.error(f"--resume_from_checkpoint {checkpoint} was trained with {_flags(saved, differ)} (its "
                     f"{SETTINGS}), not {_flags(given, differ)}; resume with the flags it was trained with, or start "
                     "afresh without --resume_from_checkpoint")


def _flags(settings: dict, names: list[str]) -> str:
    return " ".join(f"--{name} {','.join(map(str, value)) if isinstance(value, list) else value}"
                    for name in names for value in [settings[name]])


def load_model(reft_args):
    """The tokenizer and model from ``--model``. Called after ``TrainingArguments`` exist: with a ZeRO-3
    config they have set up DeepSpeed, and ``from_pretrained`` loads each parameter partitioned (zero.Init)."""
    try:  # a hub name that is neither cached nor reachable: HF's message names no flag
        config = transformers.AutoConfig.from_pretrained(reft_args.model)
    except OSError as error:
        raise SystemExit(f"train_reft.py: --model {reft_args.model}: {error}") from None
    length = reft_args.model_max_length or max_positions(config)
    tokenizer = transformers.AutoTokenizer.from_pretrained(reft_args.model, model_max_length=length)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.unk_token or tokenizer.eos_token
    quantized = {"quantization_config": quantization(reft_args)} if reft_args.quantize else {}
    model = transformers.AutoModelForCausalLM.from_pretrained(reft_args.model, dtype=getattr(torch, reft_args.dtype),
                                                              **quantized)
    return tokenizer, model


def quantization(reft_args) -> transformers.BitsAndBytesConfig:
    """``--quantize``: 4-bit NF4 computing in ``--dtype`` and packed in it, so that FSDP2 shards the packed weights
    and each rank reads and quantizes only its share (docs/loading.md); or 8-bit (one process, DDP, ZeRO)."""
    if reft_args.quantize == "8bit":
        return transformers.BitsAndBytesConfig(load_in_8bit=True)
    dtype = getattr(torch, reft_args.dtype)
    return transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype,
                                           bnb_4bit_quant_storage=dtype)


def max_positions(config) -> int:
    """How many positions the model takes. pyreft's data helpers truncate to the tokenizer's
    ``model_max_length``, which a tokenizer saved without one holds as 1e30: ``OverflowError: int too big to
    convert``. pyreft's own examples pass ``model_max_length``; this script passes the model's length."""
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        if isinstance(getattr(config, name, None), int):
            return getattr(config, name)
    raise ValueError(f"--model: its {type(config).__name__} names no maximum length "
                     "(max_position_embeddings, n_positions); pass --model_max_length")


def interventions_per_layer(reft_args) -> int:
    """pyreft gives the first and the last positions their own interventions unless told to share."""
    first, last = pyreft.parse_positions(reft_args.positions)
    return 2 if first and last and not reft_args.share_weights else 1


def chosen_layers(reft_args, config) -> list[int]:
    count = config.num_hidden_layers
    layers = list(range(count)) if reft_args.layers == "all" else [int(n) for n in reft_args.layers.split(",")]
    if not all(0 <= layer < count for layer in layers):
        raise ValueError(f"--layers {reft_args.layers!r}: the model has layers 0 to {count - 1}")
    return layers


def build_reft_model(reft_args, model):
    """``add_bias``: NoReFT reads it with no default (``KeyError: 'add_bias'``); the other classes take and ignore it."""
    layers = chosen_layers(reft_args, model.config)
    intervention = getattr(pyreft, reft_args.intervention)
    reft_config = pyreft.ReftConfig(representations=[
        {"layer": layer, "component": reft_args.component, "low_rank_dimension": reft_args.rank,
         "intervention": intervention(embed_dim=model.config.hidden_size, low_rank_dimension=reft_args.rank,
                                      dtype=getattr(torch, reft_args.dtype), add_bias=False)}
        for layer in layers * interventions_per_layer(reft_args)
    ])
    return pyreft.get_reft_model(model, reft_config)


def read_examples(path):
    """The examples of ``--data``: a JSON list, or JSONL, of objects with a string ``instruction`` and ``output``."""
    with open(path) as file:
        text = file.read()
    try:
        examples = json.loads(text) if text.lstrip().startswith("[") else [json.loads(line) for line in
                                                                            text.splitlines() if line.strip()]
    except json.JSONDecodeError as error:
        raise SystemExit(f"train_reft.py: --data {path} is neither a JSON list nor JSONL ({error})") from None
    if not examples:
        raise SystemExit(f"train_reft.py: --data {path} holds no examples; expected a JSON list (or JSONL) of "
                         "{'instruction': ..., 'output': ...}")
    for number, example in enumerate(examples):
        if not isinstance(example, dict) or not {"instruction", "output"} <= set(example):
            found = f"keys {sorted(example)}" if isinstance(example, dict) else f"the {type(example).__name__} {example!r:.40}"
            raise SystemExit(f"train_reft.py: --data {path}: example {number} has {found}, expected 'instruction' "
                             "and 'output'")
        for key in ("instruction", "output"):
            if not isinstance(example[key], str):
                raise SystemExit(f"train_reft.py: --data {path}: example {number}'s {key!r} is "
                                 f"{json.dumps(example[key])}, expected a string (the {key} text)")
    return examples


def check_training_data(reft_args, data_module, tokenizer, model) -> None:
    """Stop before the first step when nothing would train, and warn about examples that train less than asked.

    pyreft's data helpers cut each example to the tokenizer's ``model_max_length``: an example whose prompt
    fills it keeps no answer token (every label -100, loss 0 and no gradient). They cap the first and the last
    positions at half the prompt's length each and fill the rest with the first answer token's position
    (``get_intervention_locations``), so ``--positions l200`` on short prompts intervenes there over and over."""
    labels = data_module["train_dataset"]["labels"]
    prompt_lengths = [sum(1 for label in row if label == -100) for row in labels]
    cut = [number for number, row in enumerate(labels) if all(label == -100 for label in row)]
    length = tokenizer.model_max_length
    if len(cut) == len(labels):
        raise SystemExit(
            f"train_reft.py: every example's answer is cut off: examples are cut to --model_max_length {length} "
            f"tokens and every prompt fills them, so nothing would train; raise --model_max_length (the model takes "
            f"{max_positions(model.config)}) or shorten the instructions")
    if cut:
        warn(f"{len(cut)} of {len(labels)} examples have no answer token left after cutting to --model_max_length "
             f"{length} (examples {_some(cut)}): they train nothing; raise --model_max_length or shorten them")
    first, last = positions_counts(reft_args.positions)
    capped = [number for number, prompt in enumerate(prompt_lengths) if max(first, last) > prompt // 2]
    if capped:
        fits = min(prompt_lengths) // 2
        what = (f"--positions {reft_args.positions}: pyreft takes at most half of a prompt's tokens for each of the "
                "first and last positions and repeats the first answer token's position for the rest, and ")
        advice = f"use at most {fits} for each (the shortest prompt has {min(prompt_lengths)} tokens)" if fits else \
            "lengthen the prompts (some have a single token)"
        if len(capped) == len(labels):
            raise SystemExit(f"train_reft.py: {what}every prompt is too short for it (the longest has "
                             f"{max(prompt_lengths)} tokens); {advice}")
        warn(f"{what}{len(capped)} of {len(labels)} prompts are too short for it (examples {_some(capped)}); "
             f"{advice}, or leave them capped")


def check_last_layer(reft_args, model) -> None:
    """Stop (or warn) where the interventions on the model's last layer would train nothing: a position's output
    there reaches only its own prediction, and every prompt position but the last predicts a prompt token, which
    carries no loss. So an intervention there at the first positions only (``fN``, not shared with ``lN``) keeps
    the values it was built with (grad_norm 0 for it)."""
    first, last = positions_counts(reft_args.positions)
    top = model.config.num_hidden_layers - 1
    layers = chosen_layers(reft_args, model.config)
    if not first or top not in layers or (last and reft_args.share_weights):
        return
    what = (f"--positions {reft_args.positions} on the model's last layer ({top}): its output at the first prompt "
            "positions reaches only their own predictions, prompt tokens without a loss, so ")
    if layers == [top] and not last:
        raise SystemExit(f"train_reft.py: {what}nothing would train; add last positions (lN), or choose --layers "
                         f"below {top}")
    warn(f"{what}its intervention for the first positions trains nothing; leave layer {top} out of --layers, add "
         "last positions (lN) with --share_weights, or leave it untrained")


def warn(message: str) -> None:
    """Once, from the first rank (every rank finds the same): the README's two-rank run said it four times. Shown with
    the line of ``main`` that found it."""
    if os.environ.get("RANK", "0") == "0":
        warnings.warn(message, UserWarning, stacklevel=3)


def _some(numbers: list[int]) -> str:
    return ", ".join(map(str, numbers[:5])) + (f" and {len(numbers) - 5} more" if len(numbers) > 5 else "")


def train_settings(reft_args, config) -> dict:
    """What serve_reft.py needs to answer as this model does, saved beside the interventions and in each checkpoint."""
    path = reft_args.model
    return {"model": os.path.abspath(path) if os.path.isdir(path) else path, "layers": chosen_layers(reft_args, config),
            "positions": reft_args.positions, "share_weights": reft_args.share_weights, "dtype": reft_args.dtype,
            "component": reft_args.component, "intervention": reft_args.intervention, "rank": reft_args.rank}


def main(argv=None):
    reft_args, training_args = parse_arguments(argv)
    examples = read_examples(reft_args.data)
    save_dir = reft_args.save_dir or os.path.join(training_args.output_dir, "reft")
    check_writable(training_args, [("--output_dir", training_args.output_dir),
                                   ("--save_dir" if reft_args.save_dir else "--output_dir", save_dir)])
    transformers.set_seed(training_args.seed)  # every process builds the same interventions
    tokenizer, model = load_model(reft_args)
    if reft_args.prompt is not None:  # answered after training: checked before it
        check_positions_fit(reft_args.positions, tokenizer, reft_args.prompt, program="train_reft.py")
    reft_model = build_reft_model(reft_args, model)
    reft_model.print_trainable_parameters()
    check_last_layer(reft_args, model)

    data_module = pyreft.make_multiple_position_supervised_data_module(
        tokenizer, model, [example["instruction"] for example in examples],
        [example["output"] for example in examples], positions=reft_args.positions,
        num_interventions=len(reft_model.interventions), share_weights=reft_args.share_weights)
    check_training_data(reft_args, data_module, tokenizer, model)
    trainer = pyreft.ReftTrainerForCausalLM(model=reft_model, processing_class=tokenizer, args=training_args,
                                            **data_module)
    trainer.add_callback(RecordSettings(train_settings(reft_args, model.config)))
    resumed = training_args.resume_from_checkpoint
    try:
        trainer.train(resume_from_checkpoint=resumed)
    except RuntimeError as error:  # a checkpoint without train_settings.json (check_resume), of other interventions
        if not training_args.resume_from_checkpoint or "Error(s) in loading state_dict" not in str(error):
            raise
        raise SystemExit(f"train_reft.py: --resume_from_checkpoint {training_args.resume_from_checkpoint} holds other "
                         f"interventions than these flags build ({str(error).splitlines()[-1].strip()[:300]}); resume "
                         "with the --model, --layers, --positions, --share_weights, --intervention and --rank it was "
                         "trained with") from None
    if resumed:
        check_trained_after_resume(trainer, resumed, trained_steps(resumed))
    trainer.save_state()  # OUTPUT_DIR/trainer_state.json: the log, every logged loss included

    # Save once, in pyreft's format (the files save_to_hf_hub uploads). Every rank takes part: under
    # ZeRO-3 `gathered` collects the partitioned interventions (a collective). Rank 0 writes to
    # save_dir, the others to a scratch folder they drop.
    with gathered(reft_model), tempfile.TemporaryDirectory() as scratch:
        reft_model.save(save_dir if trainer.is_world_process_zero() else scratch, save_to_hf_hub=False)
    if trainer.is_world_process_zero():
        with open(os.path.join(save_dir, SETTINGS), "w") as file:
            json.dump(train_settings(reft_args, model.config), file, indent=1)
        logger.warning(f"interventions saved to {save_dir}")

    if reft_args.prompt is not None:  # every rank: under ZeRO-3 and FSDP, each forward gathers the weights
        reft_model.eval()
        result = answer(reft_model, tokenizer, reft_args.prompt, reft_args.positions, reft_args.share_weights,
                        reft_args.max_new_tokens)
        if trainer.is_world_process_zero():
            torch.save(result, os.path.join(training_args.output_dir, "answer.pt"))
            logger.warning(f"{reft_args.prompt!r} -> {result['text']!r}")

    # Leave the process group HF Trainer joined before the interpreter exits, while the trainer and its engine
    # still live: gloo's threads otherwise outlive it ("terminate called without an active exception"). The
    # barrier first, so that no rank tears its connections down while another still uses them.
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    with leaving_the_process_group_on_error():
        main()
