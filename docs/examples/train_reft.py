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
``--resume_from_checkpoint OUTPUT_DIR/checkpoint-N`` (or ``True``: the newest in ``--output_dir``) continues a run
that saved checkpoints (``--save_strategy steps --save_steps N``) where it stopped.
"""

import dataclasses
import json
import os
import tempfile
import warnings

import torch

import pyvene_dist

pyvene_dist.patch()  # before pyreft builds the model

import pyreft  # noqa: E402
import transformers  # noqa: E402
from pyvene_dist import flags  # noqa: E402
from pyvene_dist.gather import gathered  # noqa: E402
from serve_reft import SETTINGS, answer  # noqa: E402  (this folder)

logger = transformers.utils.logging.get_logger("train_reft")


@dataclasses.dataclass
class ReftArguments:
    model: str = dataclasses.field(metadata={"help": "a model folder or hub name, with its tokenizer"})
    data: str = dataclasses.field(metadata={"help": "JSON list or JSONL of {'instruction': ..., 'output': ...}"})
    layers: str = dataclasses.field(default="all", metadata={"help": "'all', or layer numbers as 2,10,18"})
    positions: str = dataclasses.field(default="l1", metadata={"help": "prompt positions: first n and last n, "
                                                                       "as pyreft writes them: 'f1+l1', 'l1'"})
    share_weights: bool = dataclasses.field(default=False, metadata={"help": "one intervention for f and l"})
    component: str = dataclasses.field(default="block_output", metadata={"help": "where in each layer"})
    rank: int = dataclasses.field(default=4, metadata={"help": "low_rank_dimension"})
    intervention: str = dataclasses.field(default="LoreftIntervention", metadata={"help": "a pyreft class"})
    dtype: str = dataclasses.field(default="float32", metadata={"help": "of the model and the interventions"})
    save_dir: str = dataclasses.field(default=None, metadata={"help": "default: OUTPUT_DIR/reft"})
    prompt: str = dataclasses.field(default=None, metadata={"help": "after training, answer it greedily and "
                                                                    "save the answer to OUTPUT_DIR/answer.pt"})
    max_new_tokens: int = dataclasses.field(default=16, metadata={"help": "for --prompt"})
    model_max_length: int = dataclasses.field(default=None, metadata={
        "help": "tokens kept of each example (pyreft's data helpers truncate to it); default: the model's "
                "max_position_embeddings"})


def parse_arguments(argv=None):
    parser = transformers.HfArgumentParser((ReftArguments, transformers.TrainingArguments))
    reft_args, training_args = parser.parse_args_into_dataclasses(argv)
    if not hasattr(pyreft, reft_args.intervention):
        parser.error(f"--intervention {reft_args.intervention!r} is not a pyreft class (LoreftIntervention, ...)")
    reft_args.dtype = flags.dtype_name(reft_args.dtype, program="train_reft.py")  # bf16, as before, still works
    if not isinstance(getattr(torch, reft_args.dtype, None), torch.dtype):
        parser.error(f"--dtype {reft_args.dtype!r} is not a torch dtype (float32, bfloat16, float16)")
    if ";" in reft_args.layers:  # the separator of pyreft's examples, and of this script before
        warnings.warn(f"--layers {reft_args.layers!r}: separate layers with commas, as "
                      f"{reft_args.layers.replace(';', ',')}; ';' will stop working", FutureWarning, stacklevel=2)
        reft_args.layers = reft_args.layers.replace(";", ",")
    training_args.resume_from_checkpoint = checkpoint_to_resume(parser, training_args)
    return reft_args, training_args


def checkpoint_to_resume(parser, training_args):
    """``--resume_from_checkpoint`` as HF Trainer reads ``train(resume_from_checkpoint=...)``: a checkpoint folder,
    or ``True`` (also ``last``) for the newest ``checkpoint-N`` in ``--output_dir``; None to start afresh. A
    folder that is not there, or no checkpoint to take the newest of, stops here, before any model is loaded."""
    from transformers.trainer_utils import get_last_checkpoint

    given = training_args.resume_from_checkpoint
    if given is None:
        return None
    if given.lower() in ("true", "last"):
        found = get_last_checkpoint(training_args.output_dir) if os.path.isdir(training_args.output_dir) else None
        if found is None:
            parser.error(f"--resume_from_checkpoint {given}: --output_dir {training_args.output_dir} holds no "
                         "checkpoint-N folder to resume from; name a checkpoint folder, or leave the flag out")
        return found
    if not os.path.isdir(given):
        parser.error(f"--resume_from_checkpoint {given}: no such folder; name a checkpoint folder that a run saved "
                     "(OUTPUT_DIR/checkpoint-N), or pass True for the newest one in --output_dir")
    return given


def load_model(reft_args):
    """The tokenizer and model from ``--model``. Called after ``TrainingArguments`` exist: with a ZeRO-3
    config they have set up DeepSpeed, and ``from_pretrained`` loads each parameter partitioned (zero.Init)."""
    length = reft_args.model_max_length or max_positions(transformers.AutoConfig.from_pretrained(reft_args.model))
    tokenizer = transformers.AutoTokenizer.from_pretrained(reft_args.model, model_max_length=length)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.unk_token or tokenizer.eos_token
    model = transformers.AutoModelForCausalLM.from_pretrained(reft_args.model, dtype=getattr(torch, reft_args.dtype))
    return tokenizer, model


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


def chosen_layers(reft_args, model) -> list[int]:
    count = model.config.num_hidden_layers
    layers = list(range(count)) if reft_args.layers == "all" else [int(n) for n in reft_args.layers.split(",")]
    if not all(0 <= layer < count for layer in layers):
        raise ValueError(f"--layers {reft_args.layers!r}: the model has layers 0 to {count - 1}")
    return layers


def build_reft_model(reft_args, model):
    layers = chosen_layers(reft_args, model)
    intervention = getattr(pyreft, reft_args.intervention)
    reft_config = pyreft.ReftConfig(representations=[
        {"layer": layer, "component": reft_args.component, "low_rank_dimension": reft_args.rank,
         "intervention": intervention(embed_dim=model.config.hidden_size, low_rank_dimension=reft_args.rank,
                                      dtype=getattr(torch, reft_args.dtype))}
        for layer in layers * interventions_per_layer(reft_args)
    ])
    return pyreft.get_reft_model(model, reft_config)


def read_examples(path):
    with open(path) as file:
        text = file.read()
    examples = json.loads(text) if text.lstrip().startswith("[") else [json.loads(line) for line in
                                                                        text.splitlines() if line.strip()]
    for number, example in enumerate(examples):
        if not {"instruction", "output"} <= set(example):
            raise ValueError(f"--data {path}: example {number} has keys {sorted(example)}, expected "
                             "'instruction' and 'output'")
    return examples


def train_settings(reft_args, model) -> dict:
    """What serve_reft.py needs to answer as this model does, saved beside the interventions."""
    path = reft_args.model
    return {"model": os.path.abspath(path) if os.path.isdir(path) else path, "layers": chosen_layers(reft_args, model),
            "positions": reft_args.positions, "share_weights": reft_args.share_weights, "dtype": reft_args.dtype,
            "component": reft_args.component, "intervention": reft_args.intervention, "rank": reft_args.rank}


def main(argv=None):
    reft_args, training_args = parse_arguments(argv)
    transformers.set_seed(training_args.seed)  # every process builds the same interventions
    tokenizer, model = load_model(reft_args)
    reft_model = build_reft_model(reft_args, model)
    reft_model.print_trainable_parameters()

    examples = read_examples(reft_args.data)
    data_module = pyreft.make_multiple_position_supervised_data_module(
        tokenizer, model, [example["instruction"] for example in examples],
        [example["output"] for example in examples], positions=reft_args.positions,
        num_interventions=len(reft_model.interventions), share_weights=reft_args.share_weights)
    trainer = pyreft.ReftTrainerForCausalLM(model=reft_model, processing_class=tokenizer, args=training_args,
                                            **data_module)
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_state()  # OUTPUT_DIR/trainer_state.json: the log, every logged loss included

    # Save once, in pyreft's format (the files save_to_hf_hub uploads). Every rank takes part: under
    # ZeRO-3 `gathered` collects the partitioned interventions (a collective). Rank 0 writes to
    # save_dir, the others to a scratch folder they drop.
    save_dir = reft_args.save_dir or os.path.join(training_args.output_dir, "reft")
    with gathered(reft_model), tempfile.TemporaryDirectory() as scratch:
        reft_model.save(save_dir if trainer.is_world_process_zero() else scratch, save_to_hf_hub=False)
    if trainer.is_world_process_zero():
        with open(os.path.join(save_dir, SETTINGS), "w") as file:
            json.dump(train_settings(reft_args, model), file, indent=1)
        logger.warning(f"interventions saved to {save_dir}")

    if reft_args.prompt is not None:  # every rank: under ZeRO-3 and FSDP, each forward gathers the weights
        reft_model.eval()
        result = answer(reft_model, tokenizer, reft_args.prompt, reft_args.positions, reft_args.share_weights,
                        reft_args.max_new_tokens)
        if trainer.is_world_process_zero():
            torch.save(result, os.path.join(training_args.output_dir, "answer.pt"))
            logger.warning(f"{reft_args.prompt!r} -> {result['text']!r}")

    # Leave the process group HF Trainer joined before the interpreter exits: gloo's threads otherwise
    # outlive it ("terminate called without an active exception"). The barrier first, so that no rank
    # tears its connections down while another still uses them.
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
