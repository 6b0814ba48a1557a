"""The hooks of ``MultiReftModel.generate``: each row's ReFT applied at its positions, as pyvene's
``unit="pos"`` hooks apply one ReFT to a whole batch (``multi_reft``'s docstring says how), and the LoReFTs of several
ReFTs at one module together (``StackedLoreft``). ``multi_reft`` calls ``left_padded``, ``rows_by_module`` and
``register_hook``."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from pyvene.models.modeling_utils import do_intervention
from torch import nn
from transformers.activations import LinearActivation

from .._optional import import_pyreft


def left_padded(mask: torch.Tensor | None, input_ids: torch.Tensor) -> tuple[list[int], list[int]]:
    """Each row's prompt length and its left padding, from the attention mask (all ones without one)."""
    rows, width = input_ids.shape
    if mask is None:
        return [width] * rows, [0] * rows
    if tuple(mask.shape) != tuple(input_ids.shape):
        raise ValueError(f"inputs['attention_mask']: expected shape {tuple(input_ids.shape)} as input_ids, found "
                         f"{tuple(mask.shape)}")
    lengths = mask.sum(dim=1).tolist()
    for row, length in enumerate(lengths):
        if not bool(mask[row, width - length:].all()):
            raise ValueError(f"inputs['attention_mask']: row {row} is not padded on the left (found "
                             f"{mask[row].tolist()}); set tokenizer.padding_side = 'left' for generation")
    return lengths, [width - length for length in lengths]


def rows_by_module(refts: dict, names: Sequence[str | None], lengths, offsets, on_prompt: bool, device) -> dict:
    """Per hooked (module, pre-hook or not): (intervention, rows, positions) in the order pyvene applies
    them, for the ReFTs ``names`` uses. Positions are ``[rows, n]`` indices into the batch's tensors (every-token:
    position 0)."""
    pyreft = import_pyreft("pyvene_dist.serving serves ReFTs")

    calls: dict = {}
    for name in dict.fromkeys(name for name in names if name is not None):
        reft = refts[name]
        rows = [row for row, chosen in enumerate(names) if chosen == name]
        per_row = None
        if on_prompt:
            first, last = pyreft.parse_positions(reft.positions)
            per_row = []
            for row in rows:
                found = pyreft.get_intervention_locations(
                    last_position=lengths[row], first_n=first, last_n=last, pad_mode="last",
                    num_interventions=len(reft.interventions), share_weights=reft.share_weights)
                if any(position >= lengths[row] for where in found for position in where):
                    raise ValueError(f"inputs: row {row}'s prompt has {lengths[row]} tokens, too few for ReFT {name!r}"
                                     f"'s positions {reft.positions!r} (pyreft would intervene past its end)")
                per_row.append([[offsets[row] + position for position in where] for where in found])
        row_index = torch.tensor(rows, device=device).unsqueeze(1)
        first_position = torch.zeros_like(row_index)  # every-token: position 0 of each later forward
        for item in reft.interventions:
            positions = first_position if per_row is None else torch.tensor([where[item.index] for where in per_row],
                                                                            device=device)
            calls.setdefault((item.module, item.pre), []).append((item, row_index, positions))
    return calls


def register_hook(module: nn.Module, pre: bool, entries: list, on_prompt: bool, batch_rows: int):
    """One hook on ``module`` applying every entry's intervention to its rows: on the first call only
    (``on_prompt``) or on every call but the first (every-token), as pyvene's generation counters do. The
    LoReFTs of several ReFTs are applied together where they can be (``StackedLoreft``).

    ``generate`` may run its forwards on more rows than the ``batch_rows`` it was given: beam search and
    ``num_return_sequences`` repeat each row in place (``repeat_interleave``), so row ``i``'s copies are rows
    ``i * k`` to ``i * k + k - 1`` of a forward of ``k * batch_rows`` rows, and each copy takes its row's ReFT."""
    calls = [0]
    one_by_one, stacked = _stackable(entries)

    def apply(hidden: torch.Tensor) -> None:
        copies = _copies(hidden.shape[0], batch_rows)
        for item, rows, positions in one_by_one:
            where = expanded(rows, positions, copies)
            intervened = do_intervention(hidden[where], None, item.intervention, None)
            hidden[where] = intervened.to(hidden.dtype)
        if stacked is not None:
            stacked.apply(hidden, copies)

    def hook(module, args, kwargs, output=None):
        first = calls[0] == 0
        calls[0] += 1
        if on_prompt != first:
            return None
        if pre:
            hidden = args[0] if args else next(iter(kwargs.values()))
        else:
            hidden = output[0] if isinstance(output, tuple) else output
        apply(hidden)
        return None

    if pre:
        return module.register_forward_pre_hook(hook, with_kwargs=True)
    return module.register_forward_hook(hook, with_kwargs=True)


def _copies(found: int, batch_rows: int) -> int:
    """How many copies of each row a forward of ``found`` rows holds (1 without beams or return sequences)."""
    if found % batch_rows:
        raise RuntimeError(f"generate ran a forward of {found} rows for a batch of {batch_rows}: expected a "
                           "multiple (each row repeated in place, as beam search and num_return_sequences do)")
    return found // batch_rows


def expanded(rows: torch.Tensor, positions: torch.Tensor, copies: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``[n, 1]`` rows and ``[n, m]`` positions of a batch, for a forward holding ``copies`` of each row."""
    if copies == 1:
        return rows, positions
    spread = torch.arange(copies, device=rows.device)
    return (rows * copies + spread).reshape(-1, 1), positions.repeat_interleave(copies, dim=0)


def _stackable(entries: list) -> tuple[list, StackedLoreft | None]:
    """The entries to apply one by one, and the LoReFTs to apply together: those of the ReFTs whose every
    intervention on this module is pyreft's LoReFT with the identity activation (its default), a bias, and one
    dtype; only where two ReFTs or more are such (one ReFT keeps pyreft's own forward), and each stage's
    interventions act at as many positions per row (in the prompt, ``f1+l1`` and ``l1`` do; ``l2`` does not)."""
    pyreft = import_pyreft("pyvene_dist.serving serves ReFTs")

    def stackable(intervention) -> bool:
        return (type(intervention) is pyreft.LoreftIntervention and isinstance(intervention.act_fn, LinearActivation)
                and intervention.learned_source.bias is not None and not intervention.training
                and len({p.dtype for p in intervention.parameters()}) == 1)

    by_reft: dict = {}
    for entry in entries:
        by_reft.setdefault(id(entry[1]), []).append(entry)  # one row tensor per ReFT
    chosen = [group for group in by_reft.values() if all(stackable(item.intervention) for item, _, _ in group)]
    if len(chosen) < 2:
        return entries, None
    stacked_ids = {id(group[0][1]) for group in chosen}
    stages = [[(group[stage][0].intervention, group[stage][1], group[stage][2]) for group in chosen
               if stage < len(group)] for stage in range(max(len(group) for group in chosen))]
    if any(len({positions.shape[1] for _, _, positions in stage}) > 1 for stage in stages):
        return entries, None
    return [entry for entry in entries if id(entry[1]) not in stacked_ids], StackedLoreft(stages)


class StackedLoreft:
    """The LoReFTs of several ReFTs at one module in one set of batched matmuls: stage ``j`` applies the ``j``-th
    LoReFT of each ReFT here to that ReFT's rows at their positions, ``h + (W h + b - R^T h) R^T`` with each
    row's own ``R``, ``W`` and ``b`` (in the order of pyreft's forward: ``h R``, ``W h + b``, their difference
    times ``R^T``). The per-row weights are gathered once per ``generate``, at the first call (the rotations are
    cached for the ``generate`` then), so a step costs the same few kernels whatever the number of ReFTs."""

    def __init__(self, stages: list):
        self.stages = stages
        self.weights: dict[int, list] = {}  # copies of each row -> the stages' gathered weights

    def _stack(self, stage: list, copies: int) -> tuple:
        where = [expanded(rows, positions, copies) for _, rows, positions in stage]
        rows = torch.cat([rows for rows, _ in where])
        positions = torch.cat([positions for _, positions in where])
        parts = [(intervention.rotate_layer.weight, intervention.learned_source.weight.T,
                  intervention.learned_source.bias, len(rows)) for (intervention, _, _), (rows, _) in zip(stage, where)]
        rotation = torch.cat([r.expand(n, *r.shape) for r, _, _, n in parts])
        source = torch.cat([w.expand(n, *w.shape) for _, w, _, n in parts])
        bias = torch.cat([b.expand(n, 1, *b.shape) for _, _, b, n in parts])
        return rows, positions, rotation, source, bias

    def apply(self, hidden: torch.Tensor, copies: int = 1) -> None:
        if copies not in self.weights:
            self.weights[copies] = [self._stack(stage, copies) for stage in self.stages]
        for rows, positions, rotation, source, bias in self.weights[copies]:
            base = hidden[rows, positions]
            rotated = torch.bmm(base.to(rotation.dtype), rotation)
            learned = torch.baddbmm(bias, base, source)
            hidden[rows, positions] = (base + torch.bmm(learned - rotated, rotation.transpose(1, 2))).to(hidden.dtype)
