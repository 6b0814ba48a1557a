"""A pyreft intervention whose layers meet the hidden states in another floating dtype is refused before its first
matmul fails (``mat1 and mat2 must have the same dtype``), naming the intervention, the layer, both dtypes and the
ways out. ``fixes.locations`` checks it in pyvene's input validation, the fast path in its own.
"""

from __future__ import annotations

import types

import torch


#: The layers pyreft's interventions call on the hidden states as given (no cast), by class: each must hold the
#: model's dtype. LoReFT's rotation (``LowRankRotateLayer``) and DiReFT cast for themselves.
HIDDEN_STATE_LAYERS = types.MappingProxyType({
    "LoreftIntervention": ("learned_source",),
    "NoreftIntervention": ("proj_layer", "learned_source"),
    "NodireftIntervention": ("proj_layer", "learned_source"),
})


def check_intervention_dtypes(model, base) -> None:
    """Refuse a pyreft intervention whose layers meet the hidden states in another floating dtype, outside
    autocast, before its first matmul fails with ``mat1 and mat2 must have the same dtype``.

    The model's dtype is its input embeddings' (or ``inputs_embeds``'); sharded embeddings (FSDP's DTensor,
    whose compute dtype its mixed-precision policy decides) and interventions with forward pre-hooks (which may
    cast their input, as ``mechanisms.own_dtype`` does) are left alone. Checked once per model and dtype."""
    if any(torch.is_autocast_enabled(device) for device in ("cpu", "cuda")):
        return
    embeds = base.get("inputs_embeds") if isinstance(base, dict) else None
    if embeds is None:
        embedding = getattr(model.model, "get_input_embeddings", lambda: None)()
        embeds = getattr(embedding, "weight", None)
    if not isinstance(embeds, torch.Tensor) or type(embeds).__name__ == "DTensor" or not embeds.is_floating_point():
        return
    expected = embeds.dtype
    if getattr(model, "_pyvene_dist_dtype_checked", None) is expected:
        return
    for key, intervention in model.interventions.items():
        kind = type(intervention)
        if not kind.__module__.startswith("pyreft.") or intervention._forward_pre_hooks:
            continue
        for name in HIDDEN_STATE_LAYERS.get(kind.__name__, ()):
            weight = getattr(getattr(intervention, name, None), "weight", None)
            if isinstance(weight, torch.Tensor) and weight.is_floating_point() and weight.dtype != expected:
                raise ValueError(
                    f"the intervention {key} ({kind.__name__}) holds its {name} in {weight.dtype} but the model "
                    f"computes in {expected}: its first matmul would fail (mat1 and mat2 must have the same dtype). "
                    f"pyreft's interventions take dtype= and default to torch.bfloat16: build them with "
                    f"dtype={expected}, load the model in {weight.dtype}, or run under autocast "
                    "(TrainingArguments(bf16=True), torch.autocast)")
    model._pyvene_dist_dtype_checked = expected
