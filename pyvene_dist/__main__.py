"""Command line: ``pyvene-dist check``, ``plan``, ``fixes``, ``tiny-model``, ``serve`` and ``eval`` (also ``python -m
pyvene_dist ...``; ``serve``'s flags: ``pyvene_dist.serving.command``).

``check`` exits 0 when every strategy that ran agrees with one device, 1 when one differs or failed.
``plan`` prints the estimated memory per GPU of each strategy and exits 0. ``fixes`` lists the fixes and
whether ``patch()`` applies them here. ``tiny-model`` saves a tiny Llama and its tokenizer to a folder, to
try the examples on. ``eval`` is lm-eval-harness's ``lm_eval`` command with ``--model reft`` known
(``pyvene_dist.evaluation``): everything after ``eval`` is lm_eval's, and so is its exit status. The others exit 2
on a usage mistake (unknown strategy, missing model, more ranks than devices, layers outside the model), reported
as one line.

The flags are those of docs/examples/train_reft.py and serve_reft.py: dtypes by their torch names
(``float32``, ``bfloat16``, ``float16``; ``check`` takes those it has a parity bound for, ``check.DTYPES``),
layers as ``2,8``, and multi-word flags with ``-`` or ``_``
(``--seq-len`` or ``--seq_len``, as HF's argument parser takes both). The older spellings
(``--dtype bf16``, ``--layers '2;8'``) still work, with a one-line note on stderr (``pyvene_dist.flags``).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import dataclasses
import difflib
import gc
import json
import math
import os
import sys
from typing import Final

from . import check, fix_list, memory_plan, patch
from ._optional import DEEPSPEED_INSTALL, EVAL_INSTALL, OnFirstUse
from .check import CHECKED, UsageError, batch_size
from .check import DTYPES as CHECK_DTYPES
from .flags import DTYPES, deprecated, dtype_name
from .testing.check_runs import CheckCase, model_config, representation_layers
from .testing.models import BASE_MODELS, VOCAB_SIZE, save_checkpoint
from .testing.quantized_cases import QuantizedCase

lm_eval_command = OnFirstUse("lm_eval.__main__", EVAL_INSTALL)
zero_config = OnFirstUse("deepspeed.runtime.zero.config", DEEPSPEED_INSTALL)


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"world sizes are comma-separated integers, got {text!r}") from None
    if any(size < 1 for size in sizes):
        raise argparse.ArgumentTypeError(f"world sizes must be at least 1, got {text!r}")
    return sizes


def _steps(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"steps must be a positive integer, got {text!r}")
    return int(text)


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def _layers(text: str) -> tuple[int, ...]:
    if ";" in text:  # train_reft.py's old separator, pyreft's examples' one
        deprecated(f"--layers {text!r}", f"--layers {text.replace(';', ',')}")
        text = text.replace(";", ",")
    try:
        layers = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"layers are comma-separated integers such as 2,8, got {text!r}") from None
    return layers


def _gib(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not math.isfinite(value) or value <= 0:  # nan compared as neither: "within 90% of nan GiB"
        raise argparse.ArgumentTypeError(f"GPU memory is a positive number of GiB, got {text!r}")
    return value


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(prog="pyvene-dist", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = root.add_subparsers(dest="command", required=True)
    checking = commands.add_parser(
        "check", help="train under each strategy and compare with one device",
        description="Train ReFT on one device and under each strategy this machine can run; compare; print a "
                    "table. Exit 0 when every strategy that ran agrees, 1 when one differs or fails, 2 on a "
                    "usage mistake.")
    checking.add_argument("--model", default="llama",
                       help=f"built-in: {', '.join(sorted(BASE_MODELS))} (default: llama); or a local path: a "
                            "directory with config.json (weights loaded when present, else built from the config) "
                            "or a config .json file")
    checking.add_argument("--strategies", type=lambda t: t.split(","), default=list(CHECKED),
                       help=f"comma-separated, of: {', '.join(CHECKED)} (default: all)")
    checking.add_argument("--world-sizes", "--world_sizes", type=_sizes,
                       help="comma-separated ranks per run (default: 2, or 1 on a one-GPU machine); at most one "
                            "rank per GPU, or per CPU core without GPUs")
    checking.add_argument("--dtype", type=dtype_name, choices=CHECK_DTYPES, default="float32")
    checking.add_argument("--steps", type=_steps, default=3, help="optimizer steps per run (default: 3)")
    checking.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    checking.add_argument("--quantize", choices=("4bit", "8bit"),
                       help="load the base model quantized by bitsandbytes (4bit: nf4, stored in --dtype), both the "
                            "reference and every strategy; runs the strategies that take it (docs/quantized.md)")

    plan = commands.add_parser(
        "plan", help="estimate the memory per GPU of ReFT training under each strategy",
        description="Estimate the memory per GPU of ReFT training (the base model frozen) under DDP, FSDP2, ZeRO-2, "
                    "ZeRO-3, ZeRO-3 with CPU offload and device_map, with and without gradient checkpointing, from "
                    "the model's config alone (built on the meta device; nothing is downloaded or allocated).")
    plan.add_argument("--model", required=True,
                      help=f"a local directory with config.json, a config .json file, a hub name already in the "
                           f"local cache, or built-in: {', '.join(sorted(BASE_MODELS))}")
    plan.add_argument("--gpus", type=_positive, required=True, help="GPUs per node")
    plan.add_argument("--nodes", type=_positive, default=1)
    plan.add_argument("--batch", type=_positive, default=1, help="sequences per GPU (default: 1)")
    plan.add_argument("--seq-len", "--seq_len", type=_positive, default=512,
                      help="tokens per sequence (default: 512)")
    plan.add_argument("--dtype", type=dtype_name, choices=DTYPES, default="bfloat16")
    plan.add_argument("--rank", type=_positive, default=4, help="LoReFT rank (default: 4)")
    plan.add_argument("--layers", type=_layers,
                      help="comma-separated decoder layers with an intervention, e.g. 2,8 (default: the first and "
                           "the last)")
    plan.add_argument("--attention", choices=("sdpa", "eager"), default="sdpa")
    plan.add_argument("--zero", default="{}", help='ZeRO-3 settings over DeepSpeed\'s defaults, as in your config, '
                      'e.g. \'{"stage3_max_live_parameters": 3e7, "reduce_bucket_size": 5e6}\'')
    plan.add_argument("--gpu-memory", "--gpu_memory", type=_gib,
                      help="GiB per GPU (default: the first GPU's, or 80 without one)")
    plan.add_argument("--json", action="store_true", help="print the estimates as JSON instead of a table")
    plan.add_argument("--quantize", choices=("4bit", "8bit"),
                      help="the base's linear layers quantized by bitsandbytes; adds FSDP2 with CPU offload, leaves "
                           "out what cannot shard it (docs/quantized.md)")

    listing = commands.add_parser(
        "fixes", help="list the fixes and whether patch() applies them here",
        description="List every fix: what it fixes, whether pyvene_dist.patch() applies it in this environment "
                    "(not when upstream carries it, or when a function it depends on changed to a form not checked), "
                    "the releases it was checked on, and whether those functions are unchanged here.")
    listing.add_argument("--json", action="store_true", help="print the fixes as JSON instead of text")

    tiny = commands.add_parser(
        "tiny-model", help="save a tiny Llama and its tokenizer to a folder, to try the examples on",
        description="Save a Llama with random weights (hidden 32, 2 layers) and a byte-level BPE tokenizer "
                    "trained here, with save_pretrained: a folder that AutoModelForCausalLM and AutoTokenizer "
                    "load. Nothing is downloaded.")
    tiny.add_argument("folder", help="where to save it: a new or empty folder (created)")

    evaluating = commands.add_parser(
        "eval", help="lm_eval (lm-eval-harness) with --model reft: a ReFT folder's interventions on its base",
        add_help=False, description="lm-eval-harness's lm_eval command, with --model reft registered; every argument "
                                    "after 'eval' is lm_eval's (docs/evaluation.md).")
    evaluating.add_argument("lm_eval_arguments", nargs=argparse.REMAINDER)
    commands.add_parser("serve", add_help=False,
                        help="serve a base model and its ReFTs over an OpenAI-compatible HTTP API "
                             "(pyvene-dist serve --help; docs/serving.md)")
    return root


def main(argv: list[str] | None = None) -> int:
    """The command; a reader that leaves early (``pyvene-dist fixes --json | head``) ends it quietly, with exit 1,
    as Python's documentation does it, instead of a ``BrokenPipeError`` traceback."""
    try:
        code = _command(argv)
        sys.stdout.flush()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the interpreter's own flush at exit
        return 1
    return code


def _command(argv: list[str] | None) -> int:
    given = sys.argv[1:] if argv is None else list(argv)
    if given[:1] == ["serve"]:  # its own parser (pyvene_dist.serving.command), imported only here
        from .serving.command import main as serve

        return serve(given[1:])
    if given[:1] == ["eval"]:  # before argparse, which would read lm_eval's flags as its own
        return _eval(given[1:])
    arguments = parser().parse_args(argv)
    if arguments.command == "plan":
        return _plan(arguments)
    if arguments.command == "fixes":
        with contextlib.redirect_stdout(sys.stderr):  # the fixes import pyvene, which prints on import
            found = fix_list.rows()
        print(fix_list.to_json(found) if arguments.json else fix_list.table(found))
        return 0
    if arguments.command == "tiny-model":
        return _tiny_model(arguments.folder)
    if argv is None:  # this process is the command's own (not a caller's of main): see _collections_at_exit
        atexit.register(_collections_at_exit)
    progress = check.Progress(sys.stderr)
    try:
        world_sizes = arguments.world_sizes or check.default_world_sizes()
        if arguments.quantize:
            arguments.strategies = check.quantized_strategies(arguments.strategies, arguments.quantize)
        check.validate(arguments.strategies, world_sizes)
        case = _case(arguments, world_sizes)
        print(check.case_summary(case), file=sys.stderr, flush=True)
        check.start_ranks_server(arguments.strategies, world_sizes)
        with contextlib.redirect_stdout(sys.stderr):  # pyvene prints on import; stdout is the table's, or the JSON's
            patch()
            rows = check.run(case, arguments.strategies, world_sizes, progress=progress)
    except check.UsageError as error:
        progress.close()
        print(f"pyvene-dist: {error}", file=sys.stderr)
        return 2
    print(check.to_json(rows) if arguments.json else check.table(rows))
    return 0 if check.passed(rows) else 1


def _collections_at_exit() -> None:
    """Leave the objects ``check`` made out of the interpreter's collections at exit (``gc.freeze``). Those walk
    every object left, about a million once torch, transformers and pyvene are imported: 1.7 s of a 2-core machine,
    0.2 s frozen. The command has printed its table and flushed its output by then."""
    gc.freeze()


def _case(arguments, world_sizes: list[int]):
    case = CheckCase(model=arguments.model, dtype=arguments.dtype, steps=arguments.steps)
    if arguments.quantize:
        case = QuantizedCase(model=arguments.model, dtype=arguments.dtype, steps=arguments.steps,
                             quantize=arguments.quantize)
    if arguments.model not in BASE_MODELS:
        try:
            config = model_config(arguments.model)
            layers = representation_layers(config)
        except ValueError as error:
            raise UsageError(f"--model {error}; expected one of {', '.join(sorted(BASE_MODELS))}, a directory "
                             "with config.json, or a config .json file") from None
        if getattr(config, "vocab_size", VOCAB_SIZE) < VOCAB_SIZE:
            raise UsageError(f"--model {arguments.model} has a vocabulary of {config.vocab_size} tokens; check "
                             f"feeds token ids up to {VOCAB_SIZE - 1}")
        case = dataclasses.replace(case, layers=layers)
    return dataclasses.replace(case, batch_size=batch_size(case, world_sizes))


def _tiny_model(folder: str) -> int:
    """Save into a new or empty folder only: saving over another model left its other files beside the tiny one's
    config.json (a mixed folder that loads neither), and a file in the way was reported as saved."""
    if os.path.exists(folder) and not os.path.isdir(folder):
        return _usage(f"tiny-model {folder}: a file is there; give a new or empty folder")
    if os.path.isdir(folder) and os.listdir(folder):
        held = sorted(os.listdir(folder))
        return _usage(f"tiny-model {folder}: the folder holds {len(held)} entr{'y' if len(held) == 1 else 'ies'} "
                      f"({', '.join(held[:3])}{', ...' * (len(held) > 3)}); give a new or empty folder")
    try:
        print(save_checkpoint(folder))
    except OSError as error:
        return _usage(f"tiny-model {folder}: cannot be written ({type(error).__name__}: {error.strerror or error})")
    return 0


def _eval(arguments: list[str]) -> int:
    """``lm_eval ARGUMENTS`` with ``--model reft`` registered, in this process (so that ``accelerate launch -m
    pyvene_dist eval`` and ``torchrun -m pyvene_dist eval`` give lm_eval its ranks)."""
    try:
        cli_evaluate = lm_eval_command.cli_evaluate
    except ImportError as error:
        return _usage(f"eval needs lm-eval-harness, which is not installed ({error}); pip install "
                      "'pyvene_dist[eval]' (or lm_eval)")
    with contextlib.redirect_stdout(sys.stderr):  # pyvene prints on import; stdout is lm_eval's table
        from .evaluation import harness  # noqa: F401 -- registers --model reft

        patch()
    program = sys.argv[0]
    sys.argv[:] = ["lm_eval", *arguments]  # lm_eval's parser reads sys.argv
    try:
        cli_evaluate()
    finally:
        sys.argv[:] = [program, "eval", *arguments]
    return 0


def _usage(message: str) -> int:
    print(f"pyvene-dist: {message}", file=sys.stderr)
    return 2


#: The ZeRO-3 settings HF Trainer fills in from the model's hidden size where a config says "auto".
HF_AUTO: Final = {"reduce_bucket_size": lambda hidden: hidden * hidden,
           "stage3_prefetch_bucket_size": lambda hidden: int(0.9 * hidden * hidden)}


def _zero_settings(given: dict, hidden: int) -> dict:
    """``--zero`` as the plan reads it: each of ``memory_plan.ZERO_DEFAULTS``' settings a number of elements (or
    ``"auto"`` where HF fills it in); DeepSpeed's other settings, as pasted from a config, left out (the estimate does
    not depend on them); any other key refused naming it (a misspelt one was echoed and ignored; a string value
    failed with a ``TypeError``)."""
    read = {}
    for key, value in given.items():
        if key not in memory_plan.ZERO_DEFAULTS:
            if key in _deepspeed_zero_settings():
                continue
            close = difflib.get_close_matches(key, memory_plan.ZERO_DEFAULTS, n=1)
            raise ValueError(f"{key!r} is no ZeRO setting{f' (did you mean {close[0]!r}?)' if close else ''}; the "
                             f"estimate reads {', '.join(memory_plan.ZERO_DEFAULTS)}")
        if value == "auto" and key in HF_AUTO:
            read[key] = HF_AUTO[key](hidden)
        elif isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            auto = " (or 'auto', which HF fills in)" if key in HF_AUTO else ""
            raise ValueError(f"{key} is {json.dumps(value)}; expected a number of elements, 0 or more{auto}")
        else:
            read[key] = value
    return read


def _deepspeed_zero_settings() -> set[str]:
    """The keys of DeepSpeed's ``zero_optimization`` section (with their aliases); none where it is not installed."""
    try:
        with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed reports its accelerator on import
            DeepSpeedZeroConfig = zero_config.DeepSpeedZeroConfig
    except ImportError:
        return set()
    return {name for field_name, field in DeepSpeedZeroConfig.model_fields.items() for name in (field_name, field.alias)
            if name}


def _plan(arguments) -> int:
    try:
        zero = json.loads(arguments.zero)
    except json.JSONDecodeError as error:
        return _usage(f"--zero {arguments.zero!r} is not JSON ({error}); expected an object such as "
                      '\'{"stage3_max_live_parameters": 3e7}\'')
    if not isinstance(zero, dict):
        return _usage(f"--zero {arguments.zero!r} is not a JSON object; expected one such as "
                      '\'{"stage3_max_live_parameters": 3e7}\'')
    try:
        shape = memory_plan.shape_of(memory_plan.meta_model(arguments.model), name=arguments.model)
    except ValueError as error:
        return _usage(f"--model {error}")
    try:
        zero = _zero_settings(zero, shape.hidden)
    except ValueError as error:
        return _usage(f"--zero {arguments.zero}: {error}")
    layers = arguments.layers or ((0,) if shape.layers == 1 else (0, shape.layers - 1))
    outside = [layer for layer in layers if not 0 <= layer < shape.layers]
    if outside:
        return _usage(f"--layers {','.join(map(str, layers))}: {arguments.model} has decoder layers "
                      f"0-{shape.layers - 1}, not {','.join(map(str, outside))}")
    run = memory_plan.Run(gpus=arguments.gpus, nodes=arguments.nodes, batch=arguments.batch, seq_len=arguments.seq_len,
                   dtype=arguments.dtype, rank=arguments.rank, layers=layers, attention=arguments.attention, zero=zero,
                   quantize=arguments.quantize)
    estimates = memory_plan.plan(shape, run)
    gpu_memory = arguments.gpu_memory or memory_plan.detected_gpu_memory() or 80.0
    if arguments.json:
        print(json.dumps([{**dataclasses.asdict(found), "total": found.total,
                           "total_checkpointed": found.total_checkpointed,
                           "fits": memory_plan.fits(found.total, gpu_memory),
                           "fits_checkpointed": memory_plan.fits(found.total_checkpointed, gpu_memory)}
                          for found in estimates], indent=1))
    else:
        print(memory_plan.table(shape, run, estimates, gpu_memory))
    return 0


if __name__ == "__main__":
    sys.exit(main())
