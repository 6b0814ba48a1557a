"""A checkpoint of a DeepSpeed run of a pyvene model no longer writes every rank's part of the frozen base.

HF Trainer saves DeepSpeed's engine checkpoint beside the others (``engine.save_checkpoint``, for its resume):
under ZeRO-3 every rank writes its partition of every parameter, the frozen base included (its "frozen param
fragments"), so each checkpoint held the whole base again, spread over the ranks' files (a 2-layer model:
2 x 292 KB of a 345 KB model per checkpoint; a 4-bit 70B, some 37 GB). HF Trainer leaves frozen parameters out for
PEFT models only. A pyvene model's base is frozen and read from its model folder, and what the run trains is in
the checkpoint's ``intervenable_model/`` folder too (``trainer_saves``), so its engine now saves with
``exclude_frozen_parameters=True`` and loads what it saved without the frozen parameters
(``load_module_strict=False``, as HF Trainer does for PEFT models).

Wraps ``deepspeed.runtime.engine.DeepSpeedEngine.save_checkpoint`` and ``.load_checkpoint``, for engines whose
module holds a pyvene model. Run on the CPU (ZeRO-3 over gloo, deepspeed 0.19.8).
"""

from __future__ import annotations

from ..._records import Fix, Site
from ...mechanisms.arguments import bound
from ...mechanisms.wrapped_models import holds_intervenable_model


def _wrap_save_checkpoint(wrapped, instance, args, kwargs):
    if not holds_intervenable_model(instance.module):
        return wrapped(*args, **kwargs)
    call = bound(wrapped, args, kwargs)
    call.arguments["exclude_frozen_parameters"] = True
    return wrapped(*call.args, **call.kwargs)


def _wrap_load_checkpoint(wrapped, instance, args, kwargs):
    if not holds_intervenable_model(instance.module):
        return wrapped(*args, **kwargs)
    call = bound(wrapped, args, kwargs)
    call.arguments["load_module_strict"] = False  # the frozen base was left out of the save
    return wrapped(*call.args, **call.kwargs)


FIX = Fix(
    __name__,
    sites=(
        Site("deepspeed.runtime.engine:DeepSpeedEngine.save_checkpoint", _wrap_save_checkpoint),
        Site("deepspeed.runtime.engine:DeepSpeedEngine.load_checkpoint", _wrap_load_checkpoint),
    ),
    upstream=(),  # runtime-only: HF Trainer, accelerate and DeepSpeed save a frozen base; docs/upstreaming.md
)
