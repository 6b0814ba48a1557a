"""A ReFT generating in transformers' compiled decoding step (``fixes.fast_path``): the plan's own compiled step,
or a refusal on pyvene's general path (``compiled_decoding``)."""

from __future__ import annotations

import contextlib
import functools
import traceback
import types
import warnings

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
        plan.compiled = (config, _FusionFallback(model, config))
    return plan.compiled[1]


#: Where torch's Inductor C++ code generator fails on a ReFT's decoding step (torch 2.13, CPU).
INDUCTOR_OUTER_LOOP_BUG = "try_outer_loop_fusion_with_local_buf"


class _FusionFallback:
    """The plan's compiled step, compiled again with Inductor's fusion limited where torch's C++ code generator fails
    on it: on the CPU (``compile_config._compile_all_devices``), with the bare model's step compiled first, torch
    2.13's Inductor raised ``InductorError: KeyError: 'buf61'`` in ``try_outer_loop_fusion_with_local_buf`` compiling a
    LoReFT's every-token step (hidden 64, one LoReFT at layer 1). ``options={"max_fusion_size": 1}`` (and no
    ``mode``, which torch takes with options only alone; CPU has no CUDA graphs to lose) compiles it, and generates the
    eager tokens; a warning says so once. Any other error is raised as it was."""

    def __init__(self, model, config):
        self.model, self.config = model, config
        self.step = torch.compile(_decoding_step(model), **config.to_dict())
        self.fell_back = False

    def __call__(self, *args, **kwargs):
        try:
            return self.step(*args, **kwargs)
        except Exception as error:  # noqa: BLE001 -- only Inductor's known failure is taken; the rest re-raised
            if self.fell_back or INDUCTOR_OUTER_LOOP_BUG not in "".join(traceback.format_exception(error)):
                raise
        self.fell_back = True
        warnings.warn(
            f"pyvene_dist: torch {torch.__version__}'s Inductor failed compiling this ReFT's decoding step "
            f"({INDUCTOR_OUTER_LOOP_BUG}, a bug of its C++ code generator); compiled again with "
            "options={'max_fusion_size': 1} (docs/troubleshooting.md). Pass disable_compile=True to generate eagerly.",
            RuntimeWarning, stacklevel=2)
        settings = self.config.to_dict()
        settings.update(mode=None, options={**(settings.get("options") or {}), "max_fusion_size": 1})
        self.step = torch.compile(_decoding_step(self.model), **settings)
        return self.step(*args, **kwargs)


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
