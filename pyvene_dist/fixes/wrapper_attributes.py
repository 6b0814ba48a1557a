"""The wrapper answers what HF Trainer, accelerate and PEFT ask of the model it wraps.

``IntervenableModel`` is a plain ``nn.Module`` around an HF model, so the questions tools ask of HF
models go unanswered. What users see today:

- ``TrainingArguments(gradient_checkpointing=True)``: ``AttributeError: 'ReftModel' object has no
  attribute 'gradient_checkpointing_enable'`` (transformers 5.2x asks for ``activation_checkpointing_enable``);
- FSDP auto-wrap reads ``_no_split_modules`` to find the decoder layers; without it every parameter
  lands in one unit (no memory saved) or accelerate stops with ``Could not find the transformer layer
  class to wrap in the model``.

The wrapper now forwards these names to its base model (``self.model``), methods bound to it:
``_no_split_modules``, ``hf_device_map``, ``is_parallelizable``, ``model_parallel`` (HF Trainer reads them
to tell a model-parallel model, which it must not wrap in ``nn.DataParallel``), ``supports_gradient_checkpointing``, ``is_gradient_checkpointing``,
``is_activation_checkpointing``, ``gradient_checkpointing_disable``, ``activation_checkpointing_disable``,
``enable_input_require_grads``, ``disable_input_require_grads``, ``get_input_embeddings``. Enabling
checkpointing (``gradient_checkpointing_enable``, ``activation_checkpointing_enable``) also makes the
embeddings' output require grad unless ``use_reentrant=False`` is asked for: reentrant checkpointing
needs an input that requires grad, and the frozen base gives none (PEFT's answer; the base's weights
stay frozen). Unlike HF's ``enable_input_require_grads``, which turns that output into a leaf, the
hook returns a copy that is not one, so an intervention writing in place into a layer's input
(``block_input`` of layer 0) is allowed (``RuntimeError: a leaf Variable that requires grad is being
used in an in-place operation`` otherwise). ``disable_input_require_grads`` removes it as HF's.
Interventions surviving the recomputation is ``fixes.gradient_checkpointing``.
"""

from __future__ import annotations

from pyvene.models.intervenable_base import BaseModel

from .._records import Fix, Site

FORWARDED = (
    "_no_split_modules",
    "hf_device_map",
    "is_parallelizable",
    "model_parallel",
    "supports_gradient_checkpointing",
    "is_gradient_checkpointing",
    "is_activation_checkpointing",
    "gradient_checkpointing_disable",
    "activation_checkpointing_disable",
    "enable_input_require_grads",
    "disable_input_require_grads",
    "get_input_embeddings",
)
ENABLERS = ("gradient_checkpointing_enable", "activation_checkpointing_enable")


class _Forwarded:
    """``wrapper.<name>`` is ``wrapper.model.<name>``; an AttributeError names the base model."""

    def __init__(self, name: str):
        self.name = name

    def __get__(self, instance, owner):
        if instance is None:
            return self
        try:
            return getattr(instance.model, self.name)
        except AttributeError:
            raise AttributeError(
                f"{type(instance).__name__} forwards {self.name!r} to its base model, "
                f"{type(instance.model).__name__}, which has none"
            ) from None


class _CheckpointingEnabler(_Forwarded):
    def __get__(self, instance, owner):
        if instance is None:
            return self
        enable = super().__get__(instance, owner)

        def enable_checkpointing(*args, **kwargs):
            options = (args[0] if args else None) or next(
                (v for k, v in kwargs.items() if k.endswith("checkpointing_kwargs")), None) or {}
            enable(*args, **kwargs)
            if options.get("use_reentrant", True) or hasattr(instance.model, "_require_grads_hook"):
                _make_inputs_require_grads(instance.model)

        return enable_checkpointing


def _make_inputs_require_grads(base) -> None:
    previous = getattr(base, "_require_grads_hook", None)  # transformers 5.2x registers its own, making a leaf
    if previous is not None:
        previous.remove()
    base._require_grads_hook = base.get_input_embeddings().register_forward_hook(_require_grads_not_as_leaf)


def _require_grads_not_as_leaf(module, inputs, output):
    return output.requires_grad_(True).clone()


FIX = Fix(
    __name__,
    sites=(
        *(Site((BaseModel, name), _Forwarded(name), kind="add") for name in FORWARDED),
        *(Site((BaseModel, name), _CheckpointingEnabler(name), kind="add") for name in ENABLERS),
    ),
    upstream=("pyvene",),
)
