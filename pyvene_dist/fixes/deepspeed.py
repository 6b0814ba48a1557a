"""DeepSpeed: sizes reported whole under ZeRO-3.

The rest of what DeepSpeed needs lives elsewhere: ZeRO-3 partitions what ``module.parameters()``
yields, and pyvene 0.1.8's override hid the frozen base (0 of 147 base parameters partitioned; fixed by
``fixes.parameters``); saving and loading gather partitioned interventions and update ZeRO's fp32
master weights (``pyvene_dist.gather``, ``fixes.checkpoints``). Interventions that read a submodule's
weight after that submodule's forward returned (NoReFT, DiReFT; LoReFT through its parametrization)
train correctly under ZeRO-3 with every parameter partitioned on deepspeed 0.19.8, and their
parameters are released after each forward (``tests/test_deepspeed.py``).

- A model loaded under ZeRO-3's ``zero.Init`` (HF's order: ``TrainingArguments`` first, then
  ``from_pretrained``) is partitioned in the config's dtype, bf16 or fp16; DeepSpeed then casts nothing
  more (``_cast_module_mixed_precision`` skips a ZeRO-Init model), yet the interventions pyvene adds
  afterwards hold LoReFT's rotation in float32: ``AssertionError`` in stage 3's ``defragment`` at
  ``deepspeed.initialize``. Built on such a model, the interventions take its dtype, as DeepSpeed gives
  every parameter of a model it partitions itself (the order of pyreft's examples).
- ``count_parameters`` (pyvene's and pyreft's) and ``ReftModel.print_trainable_parameters`` count
  ``numel()``, 0 for a partitioned parameter (pyreft then divides by zero). They count ``ds_numel``.

pyreft is patched when (and if) it is imported.
Run on the CPU (DS_ACCELERATOR=cpu, gloo) and on 2 x H200.
"""

from __future__ import annotations

from pyvene.models import basic_utils, intervenable_base
from pyvene.models.intervenable_base import BaseModel, IntervenableModel

from .._records import Fix, Site
from ..mechanisms.partitioned_dtype import take_partitioned_dtype


def numel(parameter) -> int:
    """The parameter's full size, also when ZeRO-3 holds only a partition of it here."""
    return getattr(parameter, "ds_numel", None) or parameter.numel()


def _wrap_count_parameters(wrapped, instance, args, kwargs):
    model = args[0] if args else kwargs["model"]
    return sum(numel(p) for p in model.parameters() if p.requires_grad)


def _wrap_model_count_parameters(wrapped, instance, args, kwargs):
    include_model = args[0] if args else kwargs.get("include_model", False)
    total = wrapped(include_model=False)  # the interventions, through the count_parameters above
    if include_model:
        total += sum(numel(p) for p in instance.model.parameters() if p.requires_grad)
    return total


def _wrap_print_trainable_parameters(wrapped, instance, args, kwargs):
    interventions = instance.count_parameters()
    trainable_model = sum(numel(p) for p in instance.model.parameters() if p.requires_grad)
    every_model = sum(numel(p) for p in instance.model.parameters())
    print(
        f"trainable intervention params: {interventions:,d} || trainable model params: {trainable_model:,d}\n"
        f"model params: {every_model:,d} || trainable%: {100 * (interventions + trainable_model) / every_model}"
    )


def _wrap_model_init(wrapped, instance, args, kwargs):
    wrapped(*args, **kwargs)
    take_partitioned_dtype(instance)


def _load_entry(load):
    """``IntervenableModel.load`` (a static method), then the partitioned dtype again: a load restores each
    intervention's saved dtype (the ``saved_dtypes`` fix), float32 where it was saved so, which a ZeRO-3 bf16 base
    refuses at ``deepspeed.initialize``. Harmless twice: a parameter in that dtype is left alone."""

    load = load.__get__(None, IntervenableModel)  # as the class gives it: a wrap of it then binds as it expects

    def load_in_the_partitioned_dtype(*args, **kwargs):
        loaded = load(*args, **kwargs)
        take_partitioned_dtype(loaded)
        return loaded

    return load_in_the_partitioned_dtype


FIX = Fix(
    __name__,
    sites=(
        Site((basic_utils, "count_parameters"), _wrap_count_parameters, kind="replace",
             reexported_in=(intervenable_base,)),
        Site((BaseModel, "count_parameters"), _wrap_model_count_parameters),
        Site((IntervenableModel, "__init__"), _wrap_model_init),
        Site((IntervenableModel, "load"), _load_entry, kind="entry"),
        Site("pyreft.reft_model:count_parameters", _wrap_count_parameters,  # pyreft's own copy of pyvene's
             kind="replace"),
        Site("pyreft.reft_model:ReftModel.print_trainable_parameters", _wrap_print_trainable_parameters,
             kind="replace"),
    ),
    # saved_dtypes: its wrap of IntervenableModel.load restores the saved dtypes; this fix's entry, outside it,
    # then gives the interventions a ZeRO-3 partition's dtype again.
    after=("saved_dtypes",),
    upstream=("pyvene", "pyreft"),
)
