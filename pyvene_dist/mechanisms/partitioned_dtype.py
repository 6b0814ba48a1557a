"""Interventions take the dtype ZeRO-3 partitioned their base model in (``zero.Init`` in bf16 or fp16).

DeepSpeed casts nothing more for a model partitioned under ``zero.Init``, yet pyvene adds interventions afterwards
(LoReFT's rotation in float32): ``AssertionError`` in stage 3's ``defragment`` at ``deepspeed.initialize``.
``fixes.deepspeed`` runs ``take_partitioned_dtype`` as a pyvene model is built and after ``load`` restored the
saved dtypes.
"""

from __future__ import annotations


def take_partitioned_dtype(model) -> None:
    """Where ZeRO-3 partitioned the base model in bf16 or fp16 (``zero.Init``), give every intervention
    parameter that dtype, as DeepSpeed needs (also after ``load`` restored the saved dtypes)."""
    base = getattr(model, "model", None)
    partitioned = {p.dtype for p in base.parameters() if hasattr(p, "ds_id")} if base is not None else set()
    if len(partitioned) != 1 or not next(iter(partitioned)).is_floating_point \
            or next(iter(partitioned)).itemsize >= 4:
        return
    dtype = next(iter(partitioned))
    for key, intervention in model.interventions.items():
        for parameter in intervention.parameters():
            if parameter.is_floating_point() and parameter.dtype != dtype and not hasattr(parameter, "ds_id"):
                parameter.data = parameter.data.to(dtype)
