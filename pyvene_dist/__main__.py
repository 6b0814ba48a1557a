"""Command line: ``pyvene-dist check`` (also ``python -m pyvene_dist check``)."""

from __future__ import annotations

import argparse
import contextlib
import sys


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"world sizes are comma-separated integers, got {text!r}") from None
    if any(size < 1 for size in sizes):
        raise argparse.ArgumentTypeError(f"world sizes must be at least 1, got {text!r}")
    return sizes


def parser() -> argparse.ArgumentParser:
    from .check import STRATEGIES
    from .testing.models import BASE_MODELS

    root = argparse.ArgumentParser(prog="pyvene-dist", description=__doc__)
    commands = root.add_subparsers(dest="command", required=True)
    check = commands.add_parser("check", help="train under each strategy and compare with one device")
    check.add_argument("--model", choices=sorted(BASE_MODELS), default="llama", help="tiny model built from a config")
    check.add_argument("--strategies", type=lambda t: t.split(","), default=list(STRATEGIES),
                       help=f"comma-separated, of: {', '.join(STRATEGIES)} (default: all)")
    check.add_argument("--world-sizes", type=_sizes, default=[2], help="comma-separated (default: 2)")
    check.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    check.add_argument("--steps", type=int, default=3)
    check.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    return root


def main(argv: list[str] | None = None) -> int:
    arguments = parser().parse_args(argv)
    from . import check, patch
    from .testing import ParityCase

    unknown = [s for s in arguments.strategies if s not in check.STRATEGIES]
    if unknown:
        print(f"pyvene-dist: unknown strategy {', '.join(unknown)}; known: {', '.join(check.STRATEGIES)}",
              file=sys.stderr)
        return 2
    case = ParityCase(model=arguments.model, dtype=arguments.dtype, steps=arguments.steps)
    progress = None if arguments.json else (lambda what: print(f"running {what} ...", file=sys.stderr, flush=True))
    with contextlib.redirect_stdout(sys.stderr):  # pyvene prints on import; stdout is the table's, or the JSON's
        patch()
        rows = check.run(case, arguments.strategies, arguments.world_sizes, progress=progress)
    print(check.to_json(rows) if arguments.json else check.table(rows))
    return 0 if all(row.verdict in ("agrees", "unavailable") for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
