"""Whether every rank built the same interventions: ``check_same_interventions(module, group)`` exchanges one row
per intervention of each pyvene model in ``module`` (``intervention_rows``: key, type, layer, component, unit, rank,
parameter shapes and dtypes) and raises ``ValueError`` on every rank naming the ranks and what differs.

``fixes.consistency`` runs it before DDP wraps a module, ``fixes.fsdp`` before ``fully_shard`` (where the
consistency fix is applied).
"""

from __future__ import annotations

import torch.distributed as dist

from .wrapped_models import intervenable_models


def intervention_rows(model) -> list[tuple]:
    """One row per intervention, in pyvene's order: what every rank must agree on."""
    rows = []
    for key in model.sorted_keys:
        representation = model.representations[key]
        intervention = model.interventions[key]
        parameters = tuple((name, tuple(p.shape), str(p.dtype)) for name, p in intervention.named_parameters())
        rows.append((key, type(intervention).__name__, representation.layer, representation.component,
                     representation.unit, representation.low_rank_dimension, parameters))
    return rows


def check_same_interventions(module, group=None) -> None:
    models = intervenable_models(module)
    if not models or not (dist.is_available() and dist.is_initialized()):
        return
    mine = [intervention_rows(model) for model in models]
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    differences = [_difference(everyone[0], theirs, rank) for rank, theirs in enumerate(everyone) if theirs != everyone[0]]
    if differences:
        raise ValueError("the ranks built different interventions; every rank must build the same: "
                         + "; ".join(differences))


def _difference(reference: list, theirs: list, rank: int) -> str:
    fields = ("type", "layer", "component", "unit", "low_rank_dimension", "parameters")
    lines = []
    for ours_model, their_model in zip(reference, theirs):
        ours, others = {row[0]: row for row in ours_model}, {row[0]: row for row in their_model}
        for key in sorted(set(ours) - set(others)):
            lines.append(f"rank 0 has {_summary(ours[key])}, rank {rank} does not")
        for key in sorted(set(others) - set(ours)):
            lines.append(f"rank {rank} has {_summary(others[key])}, rank 0 does not")
        for key in sorted(set(ours) & set(others)):
            for name, a, b in zip(fields, ours[key][1:], others[key][1:]):
                if a != b:
                    lines.append(f"{key}: {name} is {a!r} on rank 0 and {b!r} on rank {rank}")
        if not lines and [row[0] for row in ours_model] != [row[0] for row in their_model]:
            lines.append(_order_difference(ours_model, their_model, rank))
    return "; ".join(lines) or f"rank {rank} holds {len(theirs)} pyvene models, rank 0 {len(reference)}"


def _order_difference(ours: list, theirs: list, rank: int) -> str:
    """The same interventions built in another order: pyvene's keys (and DDP's buckets) follow the order."""
    first = next(i for i, (a, b) in enumerate(zip(ours, theirs)) if a[0] != b[0])
    return (f"the same interventions in another order: position {first} is {ours[first][0]} on rank 0 and "
            f"{theirs[first][0]} on rank {rank} (rank 0: {', '.join(row[0] for row in ours)}; rank {rank}: "
            f"{', '.join(row[0] for row in theirs)})")


def _summary(row: tuple) -> str:
    key, kind, layer, component, unit, rank, _ = row
    return f"{key} ({kind} at layer {layer} {component}, unit {unit}, rank {rank})"
