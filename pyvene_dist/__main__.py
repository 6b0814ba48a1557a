"""Command line: ``pyvene-dist check`` (also ``python -m pyvene_dist check``).

Exit codes: 0 every strategy that ran agrees with one device; 1 one differs or failed; 2 a usage
mistake (unknown strategy, missing model, more ranks than devices), reported as one line.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys


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


def parser() -> argparse.ArgumentParser:
    from .check import STRATEGIES
    from .testing.models import BASE_MODELS

    root = argparse.ArgumentParser(prog="pyvene-dist", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = root.add_subparsers(dest="command", required=True)
    check = commands.add_parser(
        "check", help="train under each strategy and compare with one device",
        description="Train ReFT on one device and under each strategy this machine can run; compare; print a "
                    "table. Exit 0 when every strategy that ran agrees, 1 when one differs or fails, 2 on a "
                    "usage mistake.")
    check.add_argument("--model", default="llama",
                       help=f"built-in: {', '.join(sorted(BASE_MODELS))} (default: llama); or a local path: a "
                            "directory with config.json (weights loaded when present, else built from the config) "
                            "or a config .json file")
    check.add_argument("--strategies", type=lambda t: t.split(","), default=list(STRATEGIES),
                       help=f"comma-separated, of: {', '.join(STRATEGIES)} (default: all)")
    check.add_argument("--world-sizes", type=_sizes,
                       help="comma-separated ranks per run (default: 2, or 1 on a one-GPU machine); at most one "
                            "rank per GPU, or per CPU core without GPUs")
    check.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    check.add_argument("--steps", type=_steps, default=3, help="optimizer steps per run (default: 3)")
    check.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    return root


def main(argv: list[str] | None = None) -> int:
    arguments = parser().parse_args(argv)
    from . import check, patch

    progress = check.Progress(sys.stderr)
    try:
        world_sizes = arguments.world_sizes or check.default_world_sizes()
        check.validate(arguments.strategies, world_sizes)
        case = _case(arguments, world_sizes)
        print(check.describe(case), file=sys.stderr, flush=True)
        with contextlib.redirect_stdout(sys.stderr):  # pyvene prints on import; stdout is the table's, or the JSON's
            patch()
            rows = check.run(case, arguments.strategies, world_sizes, progress=progress)
    except check.UsageError as error:
        progress.close()
        print(f"pyvene-dist: {error}", file=sys.stderr)
        return 2
    print(check.to_json(rows) if arguments.json else check.table(rows))
    return 0 if check.passed(rows) else 1


def _case(arguments, world_sizes: list[int]):
    from .check import UsageError, batch_size
    from .testing.check_runs import CheckCase, model_config, representation_layers
    from .testing.models import BASE_MODELS, VOCAB_SIZE

    case = CheckCase(model=arguments.model, dtype=arguments.dtype, steps=arguments.steps)
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


if __name__ == "__main__":
    sys.exit(main())
