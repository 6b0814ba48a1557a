"""A ReFT generating in transformers' compiled decoding step (``fixes.fast_path``): the plan's own compiled step,
or a refusal on pyvene's general path (``compiled_decoding``)."""

from __future__ import annotations

import contextlib
import functools
import types

import torch

from ._fast_path_call import Plan


@contextlib.contextmanager
def compiled_decoding(model, plan: Plan | None, reason: str = ""):
    """While a ReFT generates: transformers' ``get_compiled_call`` of the base ``model`` (asked where generate
    compiles its decoding step: the static cache on CUDA, or ``compile_config._compile_all_devices``)
    returns the plan's own compiled step, or, on pyvene's general path (``plan`` None), refuses.

    The base model's own compiled call cannot serve: dynamo does not guard on module hooks
    (``torch._dynamo.config.skip_nnmodule_hook_guards``), so a step compiled for the bare model before the
    plan's hooks were registered runs without them (the interventions dropped, without a word), and one
    compiled with them keeps them. The plan's step is a function of its own (its own cache in dynamo), compiled
    with the plan's hooks registered. The general path registers new hooks at every call: no compiled step
    can follow them."""
    if not callable(getattr(type(model), "get_compiled_call", None)) or "get_compiled_call" in model.__dict__:
        yield
        return
    model.__dict__["get_compiled_call"] = functools.partial(_compiled_step, model, plan) if plan is not None \
        else functools.partial(_refused_step, reason)
    try:
        yield
    finally:
        model.__dict__.pop("get_compiled_call", None)


def _compiled_step(model, plan: Plan, compile_config):
    """transformers' ``get_compiled_call`` for the plan: one compiled step per compile config, kept on the
    plan (a plan rebuilt for new interventions compiles afresh)."""
    if "llama4" in model.config.model_type:  # as transformers: not compiled
        return model.__call__
    config = compile_config or model._default_compile_config()
    if plan.compiled is None or plan.compiled[0] != config:
        plan.compiled = (config, torch.compile(_decoding_step(model), **config.to_dict()))
    return plan.compiled[1]


def _decoding_step(model):
    """``model(...)`` as a function with a code object of its own. dynamo keeps its compiled entries on the code
    object and does not guard on hooks: the bare model's entries (``Module.__call__``'s code) or another
    plan's (of this function, before the plan was rebuilt, or before an ``unpatch()``) would match."""
    def reft_decoding_step(*args, **kwargs):
        return model(*args, **kwargs)

    return types.FunctionType(reft_decoding_step.__code__.replace(), reft_decoding_step.__globals__,
                              reft_decoding_step.__name__, None, reft_decoding_step.__closure__)


def _refused_step(reason: str, compile_config):
    raise CompiledGenerationError(
        f"pyvene_dist: this ReFT generate takes pyvene's general path ({reason}), whose hooks "
        f"cannot run inside the compiled decoding step that transformers asked for (compile_config="
        f"{compile_config!r}, a static cache with cache_implementation='static' on CUDA or "
        "compile_config._compile_all_devices=True): they would be dropped, or kept in the base model's "
        "compiled step after the call. Pass disable_compile=True to generate eagerly, or call generate as the "
        "fast path takes it (docs/fast_path.md, 'What falls back to the general path').")


class CompiledGenerationError(RuntimeError):
    """A ReFT generate on pyvene's general path with a compiled decoding step (``fixes.fast_path``)."""
