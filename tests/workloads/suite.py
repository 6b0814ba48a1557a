"""pyreft's own flows, each trained by a stock pyreft trainer on a checkpoint folder loaded with ``Auto*``.

    python tests/workloads/suite.py [--strategies ddp,zero2] [--table OUT.md]

runs every workload in one process (the reference) and under each strategy (one spawned world of 2 ranks
per strategy, which runs every workload with checkpointing off and on) and prints the largest deviation
of each workload x strategy x checkpointing from the reference without checkpointing. The tests in
``test_workloads.py`` make the same worlds once per session and assert parity case by case.

A workload is ``fn(folder, output_dir, strategy, checkpointing) -> Run``. The training loop is always
HF Trainer's, through a pyreft trainer class; strategies are what users switch on: a process group
(DDP), ``deepspeed=`` (ZeRO-2/3), ``fsdp=`` (FSDP2, which HF Trainer runs on GPUs only).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1]))  # helpers, also in the spawned ranks

from example_flows import alpaca_train, loreft, loreft_glue, reward  # noqa: E402
from flows import alpaca, classification, dpo, layouts, quickstart, trainer_options  # noqa: E402
from trainer_runs import LR, STEPS, Run, make_checkpoint, process_rank  # noqa: E402, F401 -- STEPS: for the tests

from pyvene_dist.testing import STRATEGIES as HARNESS_STRATEGIES  # noqa: E402

#: The harness's strategies that HF Trainer switches on here (``Registered.trainer_arguments``), but one process.
STRATEGIES = tuple(name for name, registered in HARNESS_STRATEGIES.items()
                   if registered.trainer_arguments is not None and name != "single")
CHECKPOINTING = (False, True)

#: Cases that need another branch's fix: ``(workload, strategy, checkpointing)``, ``None`` for any.
#: The tests skip them with this reason and the worlds do not run them (some hang); remove an entry
#: once its fix is merged.
NEEDS_FIX: dict[tuple[str, str | None, bool | None], str] = {
}


def needs_fix(workload: str, strategy: str, checkpointing: bool) -> str | None:
    for (name, on, ckpt), reason in NEEDS_FIX.items():
        if name == workload and on in (None, strategy) and ckpt in (None, checkpointing):
            return reason
    return None


def _partial(fn, **bound):
    def run(folder, output_dir, strategy, checkpointing):
        return fn(folder, output_dir, strategy, checkpointing, **bound)

    run.__doc__ = fn.__doc__
    return run


WORKLOADS = {
    "a-quickstart": quickstart,
    "b-alpaca": alpaca,
    "c-classification": classification,
    "d-dpo-concatenated": _partial(dpo, concatenated=True),
    "d-dpo-two-forwards": _partial(dpo, concatenated=False),
    "e-noreft": _partial(layouts, intervention="NoreftIntervention"),
    "e-direft": _partial(layouts, intervention="DireftIntervention"),
    "e-shared-weights": _partial(layouts, intervention="LoreftIntervention", share_weights=True),
    "e-subspaces": _partial(layouts, intervention="LoreftIntervention", subspaces=True),
    "f-trainer-options": trainer_options,
    "f-trainer-options-bf16": _partial(trainer_options, dtype="bfloat16"),
    "g-loreft-commonsense": _partial(loreft, task="commonsense"),
    "g-loreft-math": _partial(loreft, task="math"),
    "g-loreft-glue": loreft_glue,
    "h-alpaca-train": alpaca_train,
    "i-reward": reward,
}
#: The example scripts' flows run as the scripts do: checkpointing off, and ZeRO-3 only where the script
#: takes a DeepSpeed config (loreft's and alpaca's TrainingArguments). The others run under every strategy,
#: checkpointing off and on.
SCOPE: dict[str, tuple[tuple[str, ...], tuple[bool, ...]]] = {
    **{name: (("ddp", "zero3"), (False,)) for name in ("g-loreft-commonsense", "g-loreft-math", "g-loreft-glue",
                                                         "h-alpaca-train")},
    "i-reward": (("ddp",), (False,)),
}


def in_scope(workload: str, strategy: str, checkpointing: bool) -> bool:
    strategies, checkpointing_options = SCOPE.get(workload, (STRATEGIES, CHECKPOINTING))
    return strategy in ("single", *strategies) and checkpointing in checkpointing_options
#: The workloads a GPU run compares with checkpointing on and off (``--gpu``).
GPU_WORKLOADS = ("a-quickstart", "b-alpaca", "c-classification", "d-dpo-concatenated", "d-dpo-two-forwards")


# --- one world per strategy --------------------------------------------------------------------------

def run_world(folder: str, output: str, strategy: str, cases: list[tuple[str, bool]]) -> None:
    """In every rank: each case in turn, each in its own output folder; rank 0 saves ``{case: Run or error}``.

    A workload that raises is recorded as its traceback and the next one runs: one broken workload names
    itself instead of hiding the others (if it left a collective half done, the world's timeout says so).
    """
    import warnings

    import helpers

    warnings.filterwarnings("ignore")
    helpers.patch()
    results = {}
    for workload, checkpointing in cases:
        scratch = Path(output).parent / f"{workload}-{'checkpointing' if checkpointing else 'plain'}"
        try:
            results[(workload, checkpointing)] = WORKLOADS[workload](Path(folder), str(scratch), strategy,
                                                                     checkpointing)
        except Exception:  # noqa: BLE001 -- recorded, compared (and reported) per case in the parent
            results[(workload, checkpointing)] = traceback.format_exc()
    if process_rank() == 0:
        torch.save(results, output)


def world(folder: Path, strategy: str, cases, *, timeout: float = 900.0) -> dict:
    """Spawn ``strategy``'s world (1 rank for ``single``, else 2), run ``cases``, return rank 0's results."""
    from pyvene_dist.testing import spawn

    backend = "nccl" if torch.cuda.is_available() else "gloo"  # accelerate gathers CUDA tensors, even alone
    with tempfile.TemporaryDirectory(prefix=f"workloads-{strategy}-") as scratch:
        output = Path(scratch) / "results.pt"
        outcome = spawn(run_world, world_size=1 if strategy == "single" else 2, backend=backend, timeout=timeout,
                        workdir=scratch, args=(str(folder), str(output), strategy, list(cases)))
        if outcome.failed:
            raise RuntimeError(f"the {strategy} world failed:\n{outcome.report()}")
        return torch.load(output, weights_only=False)


def cases_for(strategy: str, workloads=WORKLOADS, checkpointing=CHECKPOINTING) -> list[tuple[str, bool]]:
    return [(w, c) for w in workloads for c in checkpointing
            if in_scope(w, strategy, c) and needs_fix(w, strategy, c) is None]

def tolerance(workload: str, strategy: str):
    """The harness's bound for ``strategy`` in the workload's dtype."""
    from pyvene_dist.testing import DEEPSPEED_BF16
    from pyvene_dist.testing.case import dtype_tolerance

    bound = dtype_tolerance(torch.bfloat16 if workload.endswith("bf16") else torch.float32, strategy)
    if bound == DEEPSPEED_BF16:
        # Final weights, besides: Adam steps an element by about lr whatever its gradient's size, so where
        # the reference's gradient was within bf16's noise, DeepSpeed's rounding may have stepped it the other
        # way (ZeRO-2, CPU: one rotation element with gradient 1.1e-3 of its tensor's largest, +3.1e-5 in one
        # process and -2.3e-5 under ZeRO-2 at step 1, ends 0.041 = 2 x lr off; see DEEPSPEED_BF16)
        return dataclasses.replace(bound, adam_lr=LR)
    return bound


def table(reference: dict, worlds: dict[str, dict], workloads=tuple(WORKLOADS)) -> str:
    """Markdown: one row per workload x checkpointing, one column per strategy, each cell the largest
    relative deviation from the reference without checkpointing (loss, gradients, weights), or why not
    ("-": not run there, see SCOPE)."""
    from pyvene_dist.testing import differences

    strategies = list(worlds)
    lines = ["| workload | checkpointing | " + " | ".join(strategies) + " |",
             "|---|---|" + "---|" * len(strategies)]
    for workload in workloads:
        for checkpointing in SCOPE.get(workload, (STRATEGIES, CHECKPOINTING))[1]:
            cells = []
            for strategy in strategies:
                expected = reference.get((workload, False))
                found = worlds[strategy].get((workload, checkpointing))
                reason = needs_fix(workload, strategy, checkpointing)
                if not in_scope(workload, strategy, checkpointing):
                    cells.append("-")
                elif reason:
                    cells.append(f"skip: {reason.split('(')[0].split(':')[0].strip()}")
                elif not isinstance(expected, Run):
                    cells.append("reference failed: " + (expected or "not run").strip().splitlines()[-1][:60])
                elif not isinstance(found, Run):
                    cells.append("error: " + (found or "not run").strip().splitlines()[-1][:60])
                else:
                    d = differences(expected.record, found.record)
                    cells.append(f"{max(d.loss, d.grad, d.weight):.1e}")
            lines.append(f"| {workload} | {'on' if checkpointing else 'off'} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--workloads", help="comma-separated (default: all; with --gpu, the GPU workloads)")
    parser.add_argument("--gpu", action="store_true", help=f"workloads {', '.join(GPU_WORKLOADS)} on one GPU, "
                                                          "checkpointing on against off")
    parser.add_argument("--table", help="also write the table (markdown) here")
    options = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if not torch.cuda.is_available() else "cuda")
    with tempfile.TemporaryDirectory(prefix="workloads-") as scratch:
        folder = make_checkpoint(Path(scratch) / "checkpoint")
        workloads = options.workloads.split(",") if options.workloads else GPU_WORKLOADS if options.gpu else list(WORKLOADS)
        reference = world(folder, "single", cases_for("single", workloads))
        worlds = {"single": reference} if options.gpu else {
            strategy: world(folder, strategy, cases_for(strategy, workloads))
            for strategy in options.strategies.split(",")}
    for strategy, results in {"single": reference, **worlds}.items():
        for (workload, checkpointing), found in results.items():
            if isinstance(found, str):  # a traceback: the table shows its last line
                print(f"--- {workload} under {strategy}, checkpointing {checkpointing}:\n{found}", file=sys.stderr)
    text = table(reference, worlds, workloads)
    print(text)
    if options.table:
        Path(options.table).write_text(text + "\n")


if __name__ == "__main__":
    main()
