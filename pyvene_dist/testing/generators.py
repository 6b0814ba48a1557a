"""Hypothesis generators (what hypothesis calls strategies; here "strategy" means a parallel one) for pyvene's
forward arguments, in every location format pyvene accepts.

    from hypothesis import given
    from pyvene_dist.testing.generators import forward_calls, world_sizes

    @given(call=forward_calls(max_interventions=3), world_size=world_sizes())
    def test_split(call, world_size): ...

Keyword-only, small defaults. ``forward_calls`` draws a ``ForwardCall``: the keyword arguments of
``IntervenableModel.forward`` for a batch, plus the facts a test checks pieces against.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from hypothesis import strategies as st

from .matrix import ARCHITECTURES, INTERVENTIONS, LAYERS, Configuration, attentions, components

#: How ``unit_locations`` is spelled. Each is a form pyvene's ``forward`` accepts.
LOCATION_FORMATS = (
    "nested-list",               # {"sources->base": (None, [[[p, ...] per example] per intervention])}
    "tensor",                    # {"sources->base": (None, tensor[interventions, batch, positions])}
    "tensor-per-intervention",   # {"sources->base": (None, [tensor[batch, positions], ...])}
    "base-key",                  # {"base": [[[p, ...] per example] per intervention]}
    "with-none",                 # some interventions get None: they act on every position
    "broadcast-int",             # {"base": p}: pyvene expands it with the batch size
    "broadcast-positions",       # {"base": [p, q]}: likewise
)
BROADCAST_FORMATS = frozenset({"broadcast-int", "broadcast-positions"})


@dataclasses.dataclass
class ForwardCall:
    batch: int
    interventions: int
    positions: int
    location_format: str
    locations: torch.Tensor  # [interventions, batch, positions], the truth behind every format
    arguments: dict[str, Any]


def world_sizes(*, max_size: int = 8) -> st.SearchStrategy[int]:
    return st.integers(min_value=1, max_value=max_size)


def forward_call(
    *,
    batch: int,
    interventions: int = 2,
    positions: int = 2,
    location_format: str = "nested-list",
    seed: int = 0,
    seq_len: int = 8,
    vocab_size: int = 97,
    with_subspaces: bool = False,
) -> ForwardCall:
    """One call, fully determined by its arguments: for ``@example`` and hand-written cases."""
    if location_format not in LOCATION_FORMATS:
        raise ValueError(f"unknown location format {location_format!r}; known: {LOCATION_FORMATS}")
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(vocab_size, (batch, seq_len), generator=generator)
    locations = torch.randint(seq_len, (interventions, batch, positions), generator=generator)
    keep = torch.randint(2, (interventions,), generator=generator).bool().tolist()
    arguments: dict[str, Any] = {
        "base": {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)},
        "unit_locations": _spell(location_format, locations, keep),
        "labels": input_ids.clone(),
    }
    if with_subspaces and location_format not in BROADCAST_FORMATS:
        arguments["subspaces"] = torch.randint(4, (interventions, batch, 2), generator=generator).tolist()
    return ForwardCall(batch, interventions, positions, location_format, locations, arguments)


@st.composite
def forward_calls(
    draw,
    *,
    max_batch: int = 12,
    max_interventions: int = 3,
    max_positions: int = 3,
    seq_len: int = 8,
    formats: tuple[str, ...] = LOCATION_FORMATS,
) -> ForwardCall:
    return forward_call(
        batch=draw(st.integers(1, max_batch)),
        interventions=draw(st.integers(1, max_interventions)),
        positions=draw(st.integers(1, min(max_positions, seq_len))),
        location_format=draw(st.sampled_from(formats)),
        seed=draw(st.integers(0, 2**31 - 1)),
        seq_len=seq_len,
        with_subspaces=draw(st.booleans()),
    )


def _spell(location_format: str, locations: torch.Tensor, keep: list[bool]) -> dict[str, Any]:
    if location_format == "nested-list":
        return {"sources->base": (None, locations.tolist())}
    if location_format == "tensor":
        return {"sources->base": (None, locations)}
    if location_format == "tensor-per-intervention":
        return {"sources->base": (None, list(locations))}
    if location_format == "base-key":
        return {"base": locations.tolist()}
    if location_format == "with-none":
        return {"sources->base": (None, [entry.tolist() if k else None for entry, k in zip(locations, keep)])}
    if location_format == "broadcast-int":
        return {"base": int(locations[0, 0, 0])}
    return {"base": sorted(set(locations[0, 0].tolist()))}  # broadcast-positions


@st.composite
def configurations(draw, *, attention: str = "eager", max_layers: int = 3) -> Configuration:
    """A ``matrix.Configuration`` using ``attention``: an architecture that has it, any component pyvene maps
    for it, 1-``max_layers`` of its layers, pyreft positions ``fN``, ``lN`` or ``fN+lM`` with or without
    shared weights, any pyreft intervention, float32 or bfloat16, padding on either side."""
    architecture = draw(st.sampled_from([a for a in ARCHITECTURES if attention in attentions(a)]))
    first, last = draw(st.tuples(st.integers(0, 2), st.integers(0, 2)).filter(any))
    positions = "+".join(f"{side}{count}" for side, count in (("f", first), ("l", last)) if count)
    return Configuration(
        architecture=architecture,
        attention=attention,
        component=draw(st.sampled_from(components(architecture))),
        layers=tuple(sorted(draw(st.sets(st.integers(0, LAYERS - 1), min_size=1, max_size=max_layers)))),
        positions=positions,
        share_weights=draw(st.booleans()),
        intervention=draw(st.sampled_from(INTERVENTIONS)),
        dtype=draw(st.sampled_from(("float32", "bfloat16"))),
        padding=draw(st.sampled_from(("left", "right"))),
        lengths=tuple(draw(st.lists(st.integers(4, 8), min_size=2, max_size=3))),
        seed=draw(st.integers(0, 2**16)),
    )
