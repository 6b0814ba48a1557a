"""pyreft's trainers refuse a model ZeRO-3 partitioned in another precision than they train in.

Under ZeRO-3, ``from_pretrained`` partitions the model in the precision of the DeepSpeed config of the
``TrainingArguments`` alive when it runs: float32 if that config has no ``"bf16"`` section, or if those arguments
are an earlier run's (a notebook, two runs in one script, loading before making the arguments). DeepSpeed casts
nothing already partitioned and silently mixes the precisions: a bf16 run trained its first step in float32, and
resuming it from its own checkpoint ended 3.4e-5 off. pyreft's trainers refuse it at ``train``, naming both dtypes
and what avoids it.

pyreft is patched when (and if) it is imported.
"""

from __future__ import annotations

import torch

from ..._records import Fix
from ...mechanisms.trainer_steps import CHECK_TRAIN, step_sites
from ...mechanisms.wrapped_models import holds_intervenable_model, unwrap_intervenable_model


def _refuse_a_partition_in_another_dtype(trainer) -> None:
    """Raise if ZeRO-3 partitioned the model (``zero.Init``) in another floating dtype than the arguments train in.

    ``from_pretrained`` runs ``zero.Init`` in the precision of the DeepSpeed config of the ``TrainingArguments``
    alive at the time, as those arguments filled it in: float32 when the config has no ``"bf16"`` section
    (accelerate adds one later, when the trainer is made), or when the arguments are an earlier run's.
    DeepSpeed casts nothing it finds partitioned, so the run mixes the two precisions (its first step is
    the float32 run's) and resuming it from its own checkpoint does not give the same result. Parameters a
    model keeps in float32 under bf16 (``_keep_in_fp32_modules``) do not trip the check: it asks only that
    some partitioned parameter has the arguments' dtype.
    """
    arguments = trainer.args
    if not getattr(arguments, "deepspeed", None) or not holds_intervenable_model(trainer.model):
        return
    found = {p.ds_tensor.dtype for p in unwrap_intervenable_model(trainer.model).parameters()
             if getattr(p, "ds_tensor", None) is not None and p.ds_tensor.is_floating_point()}
    expected = torch.bfloat16 if arguments.bf16 else torch.float16 if arguments.fp16 else torch.float32
    if found and expected not in found:
        flag = "bf16=True" if arguments.bf16 else "fp16=True" if arguments.fp16 else "neither bf16 nor fp16"
        section = "bf16" if arguments.bf16 else "fp16" if arguments.fp16 else "bf16 and fp16"
        raise ValueError(
            f"{type(trainer).__name__}.train: DeepSpeed ZeRO-3 partitioned the model in "
            f"{', '.join(sorted(map(str, found)))} when it was loaded, but its TrainingArguments ({flag}) train in "
            f"{expected}; DeepSpeed casts nothing already partitioned and would mix the two. from_pretrained "
            "partitions in the precision of the DeepSpeed config of the TrainingArguments alive at the time: give "
            f"the config a \"{section}\" section ({{\"enabled\": \"auto\"}}), make the TrainingArguments before "
            "loading the model (HF's order under ZeRO-3), and let no earlier run's arguments be alive then "
            "(del its trainer and arguments, gc.collect()).")


FIX = Fix(
    __name__,
    sites=step_sites(CHECK_TRAIN, __name__, _refuse_a_partition_in_another_dtype),
    upstream=("pyreft",),
    relies_on=("transformers.trainer:Trainer.train",),  # DeepSpeed set up in it, casting nothing partitioned
)
