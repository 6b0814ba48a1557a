"""Where a ReFT intervenes when lm-eval scores a continuation: pyreft's training positions of the context.

pyreft trains on (prompt, answer) with the interventions at the prompt's first and last positions and the loss
on the answer's tokens (``make_multiple_position_supervised_data_module``). Scoring a continuation given a
context is that forward: the context is the prompt, the continuation the answer, read by the same
``get_intervention_locations(last_position=len(context), pad_mode="last")``. A context too short for every
slot (pyreft takes at most half of it from each end) has the slots left over at position ``len(context)``, the
continuation's first token, as in training. Generation (``generate_until``) intervenes on the prompt alone and
takes ``pyvene_dist.positions_from_attention_mask`` instead (no answer token exists yet there).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .._optional import import_pyreft
from ..positions import parse_positions


def scoring_locations(context_lengths: Sequence[int], positions: str, *, num_interventions: int,
                      share_weights: bool) -> torch.Tensor:
    """int64 ``[num_interventions, rows, slots]``: for each row (its context at positions ``0 ..
    context_lengths[row] - 1``, padded on the right), pyreft's training locations for that context as prompt,
    from pyreft's own ``get_intervention_locations``."""
    pyreft = import_pyreft("pyvene_dist.evaluation scores ReFTs")

    first, last = parse_positions(positions)  # pyreft's parser reads a malformed form as no position
    rows = [pyreft.get_intervention_locations(last_position=length, first_n=first, last_n=last, pad_mode="last",
                                              num_interventions=num_interventions, share_weights=share_weights)
            for length in context_lengths]
    return torch.tensor(rows, dtype=torch.long).permute(1, 0, 2)
