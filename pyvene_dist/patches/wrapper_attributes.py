"""The wrapper answers what HF Trainer, accelerate and FSDP ask of the model it wraps.

``IntervenableModel`` is a plain ``nn.Module`` around an HF model, so questions tools ask of HF models
go unanswered. ``_no_split_modules``: accelerate's and HF Trainer's FSDP auto-wrap policy reads it to
find the decoder layers; without it every parameter lands in one FSDP unit, gathered whole for the
forward (no memory saved), or, with ``TRANSFORMER_BASED_WRAP`` and no class named, ``Exception: Could
not find the transformer layer class to wrap in the model``. The wrapper now reports its base model's.

Checked with accelerate 1.15, transformers 5.17 and 5.24.
"""

from __future__ import annotations

SITES = ("pyvene.models.intervenable_base:BaseModel._no_split_modules",)


def patch(registry) -> None:
    from pyvene.models.intervenable_base import BaseModel

    registry.add(BaseModel, "_no_split_modules", property(_no_split_modules))


def _no_split_modules(self):
    return getattr(self.model, "_no_split_modules", None)
