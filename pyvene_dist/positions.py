"""Each row's intervention positions from a batch's attention mask (pyreft issue #105).

pyreft computes one example's positions with ``get_intervention_locations(last_position=..., positions="f1+l1",
num_interventions=...)``: the first ``n`` and last ``m`` positions of the prompt, each at most half its length.
A batch of prompts of different lengths, padded on the left (as generation pads) or on the right, needs
them per row and shifted by the row's padding; ``positions_from_attention_mask`` does that from the
attention mask, so that batched generation intervenes on each row where generating it alone would::

    prompt = tokenizer(texts, return_tensors="pt", padding=True)      # padding_side="left"
    locations = pyvene_dist.positions_from_attention_mask(prompt["attention_mask"], "f1+l1",
                                                          num_interventions=len(reft_model.interventions))
    _, out = reft_model.generate(prompt, unit_locations={"sources->base": (None, locations)},
                                 intervene_on_prompt=True, max_new_tokens=64)

It needs no ``patch()`` (stock pyvene takes ``locations.tolist()``).
"""

from __future__ import annotations

import re

import torch

_FORM = re.compile(r"f(\d+)\+l(\d+)|f(\d+)|l(\d+)")


def parse_positions(positions: str) -> tuple[int, int]:
    """pyreft's ``parse_positions``: ``"f1+l1"`` -> (1, 1), ``"f3"`` -> (3, 0), ``"l2"`` -> (0, 2); anything
    else is refused (pyreft's reads ``"l1+f1"`` as (0, 1) and ``"x"`` as (0, 0)), as is a form that selects no
    position (``"f0"``, ``"f0+l0"``: pyreft trains nothing there)."""
    found = _FORM.fullmatch(positions) if isinstance(positions, str) else None
    if found is None:
        raise ValueError(f"positions={positions!r}: expected pyreft's form 'f<n>+l<m>', 'f<n>' or 'l<m>' "
                         "(for example 'f1+l1' or 'l1')")
    both_first, both_last, first, last = found.groups()
    if both_first is not None:
        counts = int(both_first), int(both_last)
    else:
        counts = (int(first), 0) if first is not None else (0, int(last))
    if sum(counts) == 0:
        raise ValueError(f"positions={positions!r} selects no position; expected at least one first or last "
                         "position, as in 'l1' or 'f1+l1'")
    return counts


def positions_from_attention_mask(attention_mask: torch.Tensor, positions: str = "l1", *,
                                  num_interventions: int = 1, share_weights: bool = False) -> torch.Tensor:
    """Each row's positions, as pyreft's ``get_intervention_locations`` gives them for that row's prompt alone,
    shifted to where the prompt starts in the row: int64 ``[num_interventions, batch, slots]`` on the mask's
    device, for ``unit_locations={"sources->base": (None, locations)}``.

    ``attention_mask``: ``[batch, length]``, 1 (or True) at each prompt token, the tokens of a row contiguous
    (left or right padding). ``positions``: pyreft's ``"f<n>+l<m>"``, ``"f<n>"`` or ``"l<m>"``: the first
    ``n`` and last ``m`` tokens, each at most half the row's prompt (pyreft's rule, so a short prompt gets
    fewer). ``share_weights`` (pyreft's flag): every intervention takes the first and the last positions;
    otherwise, with both ``n`` and ``m``, the first half of the interventions takes the first positions and
    the second half the last (``num_interventions`` even), as pyreft's.

    Every row has the same number of slots (pyreft's count: ``n + m`` shared, else ``max(n, m)``). Where a
    row's prompt is too short for all of them, pyreft points the slots left over at a padding token its
    dataset adds; here they repeat the row's last position in that list: pyvene gathers every position
    before it writes any, so a repeated position is written twice with the same value, as if once.
    """
    first_n, last_n = parse_positions(positions)
    if isinstance(num_interventions, bool) or not isinstance(num_interventions, int) or num_interventions < 1:
        raise ValueError(f"num_interventions={num_interventions!r}: expected a positive int (the number of "
                         "interventions, len(reft_model.interventions))")
    split = not share_weights and first_n > 0 and last_n > 0
    if split and num_interventions % 2:
        raise ValueError(f"num_interventions={num_interventions}: with positions={positions!r} and "
                         "share_weights=False the first half of the interventions takes the first positions and "
                         "the second half the last, so it must be even (or pass share_weights=True)")
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
        found = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask)
        raise ValueError(f"attention_mask: expected a [batch, length] tensor, found {found}")
    mask = attention_mask.detach().to("cpu") != 0
    rows = []
    for row, tokens in enumerate(mask):
        where = tokens.nonzero().flatten().tolist()
        if not where:
            raise ValueError(f"attention_mask row {row} has no token")
        start, length = where[0], len(where)
        if where[-1] - start + 1 != length:
            raise ValueError(f"attention_mask row {row}: its tokens are not contiguous (positions {where}); "
                             "expected left or right padding")
        first, last = min(length // 2, first_n), min(length // 2, last_n)
        heads = [start + i for i in range(first)]
        tails = [start + i for i in range(length - last, length)]
        if not (heads and tails if split else heads or tails):
            raise ValueError(f"attention_mask row {row} has {length} token(s): positions={positions!r} takes at "
                             "most half of a prompt's tokens from each end (pyreft's rule), none here")
        if split:
            slots = max(first_n, last_n)
            rows.append((_fill(heads, slots), _fill(tails, slots)))
        else:
            shared = _fill(heads + tails, first_n + last_n)
            rows.append((shared, shared))
    heads = torch.tensor([row[0] for row in rows], dtype=torch.long)
    tails = torch.tensor([row[1] for row in rows], dtype=torch.long)
    half = num_interventions // 2 if split else num_interventions
    locations = torch.stack([heads] * half + [tails] * (num_interventions - half))
    return locations.to(attention_mask.device)


def _fill(found: list, slots: int) -> list:
    return found + [found[-1]] * (slots - len(found))
