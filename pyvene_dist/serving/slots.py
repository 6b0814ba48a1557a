"""Every loaded ReFT's interventions as rows of stacked tables, so that one step applies them all to a flattened
batch of tokens with a few batched matmuls, whatever ReFT each token's request names (``continuous`` uses it).

pyreft's six interventions with their default identity activation are all ``h + (A(h) - B(h)) U^T``:

====================  ==============================  ====================  ======
intervention          A(h)                            B(h)                  U
====================  ==============================  ====================  ======
LoReFT                ``learned_source(h)``           ``h R``               ``R``
NoReFT                ``learned_source(h)``           ``proj_layer(h)``     ``P^T``
DiReFT                ``learned_source(h)``           0                     ``R``
NodiReFT              ``learned_source(h)``           0                     ``P^T``
ConsReFT              ``learned_source`` (a vector)   ``h R``               ``R``
LobiReFT              ``learned_source`` (a vector)   0                     ``R``
====================  ==============================  ====================  ======

(``R`` the rotation, ``P`` the projection's weight.) A ``Stage`` holds, for one hooked module, the ``j``-th
intervention there of every ReFT as row ``slot`` of each table: ``A(h) = h @ A[slot] + a[slot]``, ``B(h) = h @
V[slot] + c[slot]``, and ``U[slot]``, with zeros where a part is absent and past a ReFT's rank. Row 0 is all
zeros, the identity: a token that no intervention of this stage acts on takes entry 0, and ``h + 0`` is ``h``
exactly. Each step a token's entry gathers its own weights (``Stage.apply``), in the order of pyreft's forward
(``B(h)``, ``A(h)``, their difference times ``U^T``, added to ``h``), as vLLM's punica kernels gather each
token's LoRA by index. The tables keep their shapes while ReFTs come and go (a freed slot is zeroed; they grow
only for more ReFTs than they have room for, or a larger rank).
"""

from __future__ import annotations

import dataclasses

import torch
from transformers.activations import LinearActivation

#: Where a stage's intervention acts in the prompt (pyreft's locations): the first positions, the last, or both.
FIRST, LAST, BOTH = 1, 2, 3
#: A stage's tables (see the module's docstring).
PARTS = ("A", "a", "V", "c", "U")
#: Rows of each table beyond those in use, allocated when a table grows (fewer reallocations, never needed).
SPARE_SLOTS = 4


def linear_form(intervention) -> dict[str, torch.Tensor | None]:
    """The intervention's ``A``, ``a``, ``V``, ``c`` and ``U`` (see the module's docstring), or a ValueError naming
    what ``continuous`` cannot stack."""
    kind = type(intervention).__name__
    act = getattr(intervention, "act_fn", None)
    if act is not None and not isinstance(act, LinearActivation):
        raise ValueError(f"{kind} with activation {type(act).__name__}: continuous batching stacks pyreft's "
                         "interventions with their default identity activation (act_fn=None)")
    source = intervention.learned_source
    if kind in ("ConsreftIntervention", "LobireftIntervention"):
        learned = {"A": None, "a": source.detach()}
    else:
        learned = {"A": source.weight.detach().T, "a": None if source.bias is None else source.bias.detach()}
    if kind in ("NoreftIntervention", "NodireftIntervention"):
        projection = intervention.proj_layer
        up = projection.weight.detach().T
        down = {"V": up, "c": None if projection.bias is None else projection.bias.detach()}
    elif kind in ("LoreftIntervention", "ConsreftIntervention", "LobireftIntervention", "DireftIntervention"):
        up = intervention.rotate_layer.weight.detach()
        down = {"V": up, "c": None}
    else:
        raise ValueError(f"{kind}: continuous batching serves pyreft's LoReFT, NoReFT, DiReFT, NodiReFT, ConsReFT "
                         "and LobiReFT")
    if kind in ("DireftIntervention", "NodireftIntervention", "LobireftIntervention"):
        down = {"V": None, "c": None}
    return {**learned, **down, "U": up}


@dataclasses.dataclass(eq=False)
class Stage:
    """The ``j``-th intervention of each ReFT at one module: its tables (row ``slot`` for that slot's ReFT) and
    ``where[slot]``, where in the prompt it acts (``FIRST``, ``LAST``, ``BOTH``; 0: that ReFT has none here)."""

    width: int
    rank: int
    slots: int
    device: torch.device
    dtype: torch.dtype
    tables: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    where: torch.Tensor | None = None

    def __post_init__(self):
        width, rank, rows = self.width, self.rank, self.slots + 1
        make = dict(device=self.device, dtype=self.dtype)
        self.tables = {"A": torch.zeros(rows, width, rank, **make), "a": torch.zeros(rows, 1, rank, **make),
                       "V": torch.zeros(rows, width, rank, **make), "c": torch.zeros(rows, 1, rank, **make),
                       "U": torch.zeros(rows, width, rank, **make)}
        self.where = torch.zeros(rows, dtype=torch.int64, device=self.device)

    def resized(self, slots: int, rank: int) -> Stage:
        """A copy with room for ``slots`` ReFTs and rank ``rank`` (both at least the present ones)."""
        bigger = Stage(self.width, max(rank, self.rank), max(slots, self.slots), self.device, self.dtype)
        for name, table in self.tables.items():
            bigger.tables[name][:table.shape[0], :table.shape[1], :table.shape[2]] = table
        bigger.where[:self.where.shape[0]] = self.where
        return bigger

    def write(self, slot: int, intervention, where: int) -> None:
        for name, tensor in linear_form(intervention).items():
            table = self.tables[name]
            table[slot].zero_()
            if tensor is not None:
                tensor = tensor.reshape(1, -1) if name in ("a", "c") else tensor
                table[slot, :tensor.shape[0], :tensor.shape[1]] = tensor.to(table.dtype)
        self.where[slot] = where

    def clear(self, slot: int) -> None:
        for table in self.tables.values():
            table[slot].zero_()
        self.where[slot] = 0



def apply_stage(tables: dict[str, torch.Tensor], flat: torch.Tensor, entry: torch.Tensor) -> None:
    """``flat`` (``[tokens, width]``, in place) with each token's entry's intervention (0: none), from a stage's
    ``tables`` (``Stage.tables``, as the forward is given them)."""
    h = flat.unsqueeze(1).to(tables["U"].dtype)
    lowered = torch.baddbmm(tables["c"][entry], h, tables["V"][entry])
    learned = torch.baddbmm(tables["a"][entry], h, tables["A"][entry])
    delta = torch.bmm(learned - lowered, tables["U"][entry].transpose(1, 2))
    flat.add_(delta.squeeze(1).to(flat.dtype))


def rank_of(intervention) -> int:
    return linear_form(intervention)["U"].shape[1]


def width_of(intervention) -> int:
    return linear_form(intervention)["U"].shape[0]
