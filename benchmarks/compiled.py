"""ReFT under torch.compile against LoRA under torch.compile: one GPU, side by side in one run, as ratios.

    python benchmarks/compiled.py --out benchmarks/results/compiled.jsonl      # Llama 1B-class, bf16, inductor
    python benchmarks/compiled.py --smoke --parity /tmp/parity.pt               # CPU, tiny model, aot_eager

Training steps, interleaved in ``--rounds`` rounds (as ``overhead.py``), all after ``pyvene_dist.patch()``:

- ``peft-lora-compiled``: ``torch.compile(peft_model)``, LoRA rank 8 on q and v of the intervened layers;
  the baseline of the goal (the compiled ReFT step at most 1.03 x this one);
- ``pyvene_dist-compiled``: ``torch.compile(reft_model)``, the intervenable model compiled whole, called by
  pyreft's ``ReftTrainer.compute_loss`` (HF Trainer's ``torch_compile=True`` compiles the model it is given);
- ``pyvene_dist-base-compiled``: ReFT on a base model compiled on its own (``model.compile()`` before
  ``get_reft_model``), pyvene's hooks outside the compiled frames;
- ``peft-lora`` and ``pyvene_dist``: the same steps eager, for what compiling gains.

Each compiled row records the seconds its first step took (compiling), the graph breaks dynamo met while
compiling it (``torch._dynamo.utils.counters``: the count and the reasons) and the graphs it compiled before
and after the timed steps (a growth means recompiles while timing). ``TORCH_LOGS=graph_breaks`` prints each
break with its source line. ``--parity FILE`` first trains an eager and a compiled copy of the same ReFT
model for ``--parity-steps`` steps on the same batch and saves their losses and intervention gradients
(``tests/benchmarks/test_benchmarks.py`` compares them). ``--profile FILE``: top operators of each step by host and
device time. On CPU the backend is ``aot_eager`` (inductor's C++ compile of the backward takes minutes
there); on a GPU ``inductor``. Inside compiled frames dynamo traces pyvene's own code, not pyvene_dist's
``wrapt`` wraps (docs/benchmarks.md says what that means), except ``fixes.fast_path``'s entries, which are
plain functions: ``torch.compile(reft)`` with pyreft's collated locations traces the plan, one graph without
breaks in the intervention path (docs/fast_path.md).
"""

from __future__ import annotations

import argparse
import collections
import copy
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import common  # noqa: E402

import pyvene_dist  # noqa: E402
from pyvene_dist.testing import models  # noqa: E402

def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_step_arguments(parser)
    parser.add_argument("--backend", help="torch.compile backend (default: inductor on a GPU, aot_eager on CPU)")
    parser.add_argument("--providers", default="peft-lora-compiled,pyvene_dist-compiled,pyvene_dist-base-compiled,"
                        "peft-lora,pyvene_dist")
    parser.add_argument("--parity", help="save eager and compiled ReFT losses and gradients here (torch.save)")
    parser.add_argument("--parity-steps", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/compiled.jsonl")
    options = parser.parse_args(argv)
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    if options.smoke:
        common.smoke_sizes(options, interventions=1, warmup=0)
    backend = options.backend or ("inductor" if device.type == "cuda" else "aot_eager")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    wanted = options.providers.split(",")
    unknown = set(wanted) - set(BUILDERS)
    if unknown:
        parser.error(f"--providers: {sorted(unknown)} not among {sorted(BUILDERS)}")
    pyvene_dist.patch()
    base = models.llama(options.model, dtype=dtype, device=device)
    layers = common.middle_layers(base, options.interventions)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(base.config.vocab_size, (options.batch, options.seq_len), generator=generator).to(device)
    locations = common.edge_locations(batch=options.batch, seq_len=options.seq_len, positions=options.positions,
                                      interventions=len(layers), device=device)
    setup = Setup(base, layers, ids, common.reft_batch(ids, locations), backend)
    if options.parity:
        save_parity(setup, options.parity_steps, options.parity)

    steps, compiling, failed = {}, {}, []
    meta = common.metadata(device, dtype)
    for name in wanted:
        broken, graphs = collections.Counter(_counters()["graph_break"]), _counters()["stats"]["unique_graphs"]
        started = time.perf_counter()
        try:
            built = BUILDERS[name](setup)
            if built is None:
                continue
            built()  # the compiling step
            common.drain(device)
        except Exception as error:  # noqa: BLE001 -- a provider that fails is a row; the others still run
            traceback.print_exc()
            failed.append({"provider": name, "measure": "train", "strategy": "single", "world_size": 1,
                           "model": options.model, "batch": options.batch, "seq_len": options.seq_len,
                           "backend": backend, "error": f"{type(error).__name__}: {error}"[:2000], **meta})
            continue
        compiling[name] = {"compile_s": time.perf_counter() - started,
                           "graph_breaks": sum((collections.Counter(_counters()["graph_break"]) - broken).values()),
                           "break_reasons": _reasons(collections.Counter(_counters()["graph_break"]) - broken),
                           "graphs_compiled": _counters()["stats"]["unique_graphs"] - graphs}
        common.timed(built, warmup=options.warmup, steps=0, device=device)
        steps[name] = built
        print(f"{name}: first step {compiling[name]['compile_s']:.1f} s, {compiling[name]['graph_breaks']} graph "
              f"breaks, {compiling[name]['graphs_compiled']} graphs", flush=True)
    graphs_before = _counters()["stats"]["unique_graphs"]
    host = {}
    times = common.interleaved(steps, rounds=options.rounds, steps=options.steps, device=device, host=host)
    recompiled = _counters()["stats"]["unique_graphs"] - graphs_before
    rows = [{"provider": name, "measure": "train", "strategy": "single", "world_size": 1, "model": options.model,
             "batch": options.batch, "seq_len": options.seq_len, "tokens": options.batch * options.seq_len,
             "positions": options.positions, "layers": layers, "rounds": options.rounds,
             "backend": backend if name.endswith("compiled") else None,
             **common.summary(times[name], host[name]), **compiling.get(name, {}),
             "graphs_compiled_while_timing": recompiled,
             "peak_memory_gib": common.peak_memory_gib(device), **meta} for name in steps]
    common.compare(rows, "peft-lora-compiled", ("pyvene_dist-compiled", "pyvene_dist-base-compiled"))
    common.compare(rows, "peft-lora", ("pyvene_dist",))
    common.append_rows(options.out, rows + failed)
    for row in rows:
        print(common.show(row), flush=True)
    if options.profile:
        for name, step in steps.items():
            common.profile_top_ops(step, path=options.profile, label=f"{name} train ({backend})", device=device)
    if recompiled:
        print(f"{recompiled} graphs compiled while timing: a provider recompiled", file=sys.stderr)
    return 1 if failed else 0


class Setup:
    """What the providers' builders share: the base model (copied by each), the layers, the batch."""

    def __init__(self, base, layers, ids, batch, backend):
        self.base, self.layers, self.ids, self.batch, self.backend = base, layers, ids, batch, backend
        self._lora = None

    def reft(self, base=None):
        return common.reft_model(base if base is not None else copy.deepcopy(self.base), self.layers)

    def lora(self):
        if self._lora is None:
            self._lora = common.lora_model(self.base, self.layers) or False
        return self._lora or None


def _compiled_reft(setup: Setup):
    reft = setup.reft()
    return common.reft_step(reft, setup.batch, call=torch.compile(reft, backend=setup.backend))


def _base_compiled_reft(setup: Setup):
    base = copy.deepcopy(setup.base)
    base.compile(backend=setup.backend)
    return common.reft_step(setup.reft(base), setup.batch)


def _lora(setup: Setup, compiled: bool):
    lora = setup.lora()
    if lora is None:
        return None
    return common.lora_step(torch.compile(lora, backend=setup.backend) if compiled else lora, setup.ids,
                            torch.optim.AdamW([p for p in lora.parameters() if p.requires_grad], lr=1e-4))


BUILDERS = {
    "peft-lora-compiled": lambda setup: _lora(setup, True),
    "pyvene_dist-compiled": _compiled_reft,
    "pyvene_dist-base-compiled": _base_compiled_reft,
    "peft-lora": lambda setup: _lora(setup, False),
    "pyvene_dist": lambda setup: common.reft_step(setup.reft(), setup.batch),
}


def save_parity(setup: Setup, steps: int, path: str) -> None:
    """Train an eager and a compiled copy of one ReFT model ``steps`` steps on the same batch; save each
    one's per-step losses and intervention gradients (``{"eager": ..., "compiled": ...}``)."""
    import pyreft

    trainer = object.__new__(pyreft.ReftTrainer)
    record = {}
    for name in ("eager", "compiled"):
        reft = setup.reft()
        call = torch.compile(reft, backend=setup.backend) if name == "compiled" else reft
        optimizer = torch.optim.AdamW(reft.get_trainable_parameters(), lr=1e-2, weight_decay=0.0)
        losses, grads = [], []
        for _ in range(steps):
            loss = trainer.compute_loss(call, setup.batch)
            loss.backward()
            losses.append(loss.detach().float().cpu())
            grads.append({key: p.grad.detach().float().cpu().clone() for key, p in reft.named_parameters()
                          if p.grad is not None})
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        record[name] = {"losses": torch.stack(losses), "grads": grads, "backend": setup.backend}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    torch.save(record, path)


def _counters():
    from torch._dynamo.utils import counters

    return counters


def _reasons(broken: collections.Counter, limit: int = 8) -> list[str]:
    """The most frequent graph-break reasons, each cut to one line."""
    return [f"{count} x {reason.splitlines()[0][:200]}" for reason, count in broken.most_common(limit)]


if __name__ == "__main__":
    sys.exit(main())
