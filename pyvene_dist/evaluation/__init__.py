"""Evaluate a ReFT where users evaluate: lm-eval-harness's ``--model reft``, and pyreft's own evaluation loop
(batched generation over an eval set) on N processes. docs/evaluation.md has the commands.

    pyvene-dist eval --model reft --model_args reft=out/run/reft --tasks TASK      # lm_eval's command line

    import lm_eval, pyvene_dist.evaluation
    pyvene_dist.evaluation.register()                                           # --model reft for lm_eval
    lm_eval.simple_evaluate(model="reft", model_args="reft=out/run/reft", tasks=["TASK"])

    from pyvene_dist.evaluation import generate_over
    answers = generate_over(reft_model, tokenizer, prompts, positions="f1+l1")  # every rank its share, in order

``ReftLM`` (lm-eval's model class) is imported from ``pyvene_dist.evaluation.harness`` or read here; lm-eval
(the ``eval`` extra) is imported only then, never by importing this package.
"""

from __future__ import annotations

from .._optional import EVAL_INSTALL, OnFirstUse
from ._loading import ReftSettings, reft_settings
from .generation import generate_over

lm_eval_models = OnFirstUse("lm_eval.models", EVAL_INSTALL)
lm_eval_registry = OnFirstUse("lm_eval.api.registry", EVAL_INSTALL)

#: The name lm-eval knows the ReFT model by (``--model reft``).
MODEL_NAME = "reft"

__all__ = ("MODEL_NAME", "ReftLM", "ReftSettings", "generate_over", "reft_settings", "register")


def register() -> None:
    """Make ``reft`` a model lm-eval knows (``simple_evaluate(model="reft")``, ``--model reft``); lm-eval imports
    ``ReftLM`` when first asked for it. Registering again does nothing."""
    lm_eval_models.module()  # lm-eval's own models first: it reads its registry as empty otherwise
    model_registry = lm_eval_registry.model_registry
    if MODEL_NAME not in model_registry:
        model_registry.register(MODEL_NAME, target=f"{__name__}.harness:ReftLM")


def __getattr__(name: str):
    if name == "ReftLM":
        from .harness import ReftLM

        return ReftLM
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
