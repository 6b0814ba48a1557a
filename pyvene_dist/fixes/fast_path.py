"""ReFT at positions runs on a plan built once per model: hooks registered once, enabled per call.

Stock pyvene does, at every ``forward`` (and every ``generate``): clear its state, broadcast and
check the locations, register one hook per intervention, run the base model, remove the hooks and
clear its state again; every hook builds its index tensors from nested lists, asks the model for its
device and computes the slice it writes from an ``arange`` of the hidden size. That is some 1,500
Python calls per forward of 4 interventions on top of the base model's 2,400 (benchmarks/calls.py),
and under ``torch.compile`` a graph break at each ``.tolist()`` and at each hook registration.

For the common case (pyreft's interventions at positions, see ``plan_refusal``) the model gets a
``Plan``, kept in its state and rebuilt when its interventions change: per intervention, the hooked
module, the hook, registered once on it, the intervention and the slice of the last dimension it
writes, as Python ints. ``IntervenableModel.forward`` and ``generate`` (plain functions here, so that
torch.compile traces them: ``Site`` kind ``entry``) turn the locations into one index tensor per
intervention, set them as the plan's ``call``, run the base model inside one
``parametrize.cached()`` (each LoReFT rotation built once per forward, or once per ``generate``) and
clear the call. A hook without a call returns at once: the base model called directly, or a call that
takes pyvene's general path, is not touched.

A hook does what pyvene's does for ``unit="pos"``, on the same operands in the same order: a
``torch.gather`` of the positions (from a copy of the output where autograd records, as pyvene
copies: gather saves its input for backward), the intervention, and the index write of
``scatter_neurons``; so outputs are bit-identical to stock pyvene's and gradients equal to rounding
(``fixes.parametrizations`` says why). Every-token generation does what pyvene's counters do: the prompt's
forward is left alone and position 0 of each later one is intervened on (with ``intervene_on_prompt``
the reverse). Where transformers compiles the decoding step (the static cache), the ReFT generates in a
compiled step of its own (``compiled_decoding``). Where pyvene's in-place write would change a tensor autograd
saved (``mechanisms.copy_on_write``, as ``fixes.hooks``), the hook writes into a copy; whether it must is asked
once per hooked module and shape of the output.

Anything else takes pyvene's (patched) general path: the call or the model names why in
``plan_refusal``/``call_refusal``, and docs/fast_path.md lists them. ``patch(fast_path=False)`` or
``PYVENE_DIST_FAST_PATH=0`` sends every call there.

Its parts, one way down: this module (the record, the entries, the plan's building, its state ``FastPathState``);
``_fast_path_decoding`` (the compiled decoding step); ``_fast_path_call`` (``Plan``, one call's locations and the
hook); ``_fast_path_operations`` (LoReFT and DiReFT as their operations). None of them imports one above it.
"""

from __future__ import annotations

import functools
import sys
import warnings
from types import MappingProxyType

import torch
from pyvene.models.intervenable_base import IntervenableModel, IntervenableModelOutput
from pyvene.models.intervenable_modelcard import type_to_module_mapping
from torch import nn
from torch.nn.utils import parametrize
from transformers.activations import LinearActivation

from .._options import Option
from .._records import Fix, Site
from .._registry import MODELS, OPTIONS
from ..mechanisms.checkpoint_functions import checkpoint_functions
from ..mechanisms.dtensors import is_tensor_parallel
from ..mechanisms.parametrization_cache import cached_parametrizations
from ..versions import fingerprint
from ._fast_path_call import Call, Plan, Step, _call, _hook
from ._fast_path_decoding import CompiledGenerationError, compiled_decoding  # noqa: F401 -- public here

#: The sources (``versions.fingerprint``) of pyvene 0.1.8's ``forward`` and ``generate``, which the entries
#: do the work of for the plan's calls.
WRITTEN_FROM = MappingProxyType({"forward": "743628762e997fbf", "generate": "c81e261a7029aa42"})

#: pyreft's interventions, by name (pyreft is imported only where a model holds one).
REFT_TYPES = ("LoreftIntervention", "NoreftIntervention", "ConsreftIntervention", "LobireftIntervention",
              "DireftIntervention", "NodireftIntervention")


class FastPathState:
    """The plan a model's calls run on; its hooks are removed at close."""

    def __init__(self) -> None:
        self.plan: Plan | None = None

    def close(self) -> None:
        if self.plan is not None:
            self.plan.remove()
        self.plan = None


def _changed(name: str, general) -> str | None:
    """Why the entry of ``name`` sends every call to ``general`` (what it stands in front of): the installed
    pyvene's differs from 0.1.8's, whose work the entry does. Asked once, when the entry is made (``patch()``)."""
    if fingerprint(getattr(general, "__wrapped__", general)) == WRITTEN_FROM[name]:
        return None
    return f"the installed pyvene's {name} differs from 0.1.8's, which the plan does the work of"


def _forward_entry(general):
    changed = _changed("forward", general)

    def forward(self, base, sources=None, unit_locations=None, source_representations=None, subspaces=None,
                labels=None, output_original_output=False, return_dict=None, use_cache=None,
                intervention_additional_kwargs=None):
        plan = _plan(self) if changed is None else None
        call = None
        if plan is not None and sources is None and source_representations is None and subspaces is None \
                and not intervention_additional_kwargs and not _checkpointing_training(self):
            call = _call(self, base, unit_locations)
        if call is None:
            return _bound(general, self)(
                base, sources=sources, unit_locations=unit_locations, source_representations=source_representations,
                subspaces=subspaces, labels=labels, output_original_output=output_original_output,
                return_dict=return_dict, use_cache=use_cache,
                intervention_additional_kwargs=intervention_additional_kwargs)
        if self.full_intervention_outputs:
            self.full_intervention_outputs.clear()
        base_outputs = self.model(**base) if output_original_output else None
        model_kwargs = {}
        if labels is not None:
            model_kwargs["labels"] = labels
        if use_cache is not None and plan.config_has_use_cache:
            model_kwargs["use_cache"] = use_cache
        outputs = _run(plan, call, self.model, base, model_kwargs)
        if return_dict:
            return IntervenableModelOutput(original_outputs=base_outputs, intervened_outputs=outputs,
                                           collected_activations=None)
        return base_outputs, outputs

    return forward


def _generate_entry(general):
    changed = _changed("generate", general)

    def generate(self, base, sources=None, unit_locations=None, source_representations=None,
                 intervene_on_prompt=False, subspaces=None, output_original_output=False,
                 intervention_additional_kwargs=None, **kwargs):
        plan = _plan(self) if changed is None else None
        call = None
        if plan is not None and sources is None and source_representations is None and subspaces is None \
                and not intervention_additional_kwargs:
            every_token = not intervene_on_prompt and unit_locations is None  # pyvene's own default
            call = _call(self, base, {"base": 0} if every_token else unit_locations)
        if call is None:
            with compiled_decoding(self.model, None, changed or _why_general(self, plan)):  # the general path: refused
                return _bound(general, self)(
                    base, sources=sources, unit_locations=unit_locations,
                    source_representations=source_representations, intervene_on_prompt=intervene_on_prompt,
                    subspaces=subspaces, output_original_output=output_original_output,
                    intervention_additional_kwargs=intervention_additional_kwargs, **kwargs)
        call.generating, call.on_prompt, call.seen = True, intervene_on_prompt, [False] * len(plan.steps)
        base_outputs = self.model.generate(**base, **kwargs) if output_original_output else None
        with compiled_decoding(self.model, plan):
            return base_outputs, _run(plan, call, self.model.generate, base, kwargs, generating=True)

    return generate


def _bound(general, model):
    """``general`` (what the entry stands in front of) bound to ``model``. Compiling, the original: dynamo runs
    a ``wrapt`` wrapper's original anyway, and binding through the wrapper sends it back to the entry."""
    if torch.compiler.is_compiling():
        return functools.partial(getattr(general, "__wrapped__", general), model)
    return general.__get__(model, type(model))


def _run(plan: Plan, call: Call, run, base, kwargs, generating: bool = False):
    """``run(**base, **kwargs)`` with ``call`` enabled, each parametrized weight computed once in it. A
    generate computes them first, eagerly and without grad (as generate runs), so that a compiled decoding
    step reads them as its inputs: built in the step's graph, a rotation would be kept in
    ``parametrize``'s cache as the graph's output and read by the next step (under CUDA graphs after the
    replay that overwrote it), and each step would build the rotations again."""
    if torch.compiler.is_compiling():  # traced: the graph computes each rotation where it is read
        plan.call = call
        try:
            return run(**base, **kwargs)
        finally:
            plan.call = None
    with cached_parametrizations():
        if generating:
            _compute_parametrized(plan)
        plan.call = call
        try:
            return run(**base, **kwargs)
        finally:
            plan.call = None


def _compute_parametrized(plan: Plan) -> None:
    """Read each parametrized tensor of the plan's interventions once, inside ``parametrize.cached()``."""
    with torch.no_grad():
        for step in plan.steps:
            for module in step.intervention.modules():
                if parametrize.is_parametrized(module):
                    for name in module.parametrizations:
                        getattr(module, name)


def _why_general(model, plan: Plan | None) -> str:
    """Why a generate of ``model`` (pyvene's model) takes the general path, in a few words."""
    if plan is not None:
        return ("its arguments: sources, source_representations, subspaces or intervention_additional_kwargs, "
                "or unit_locations in a form the plan does not take")
    options = OPTIONS.current
    if options is None or not options.fast_path:
        return "fast_path is off"
    built = plan_of(model)
    if built is not None and built.refusal is not None:
        return built.refusal
    return "a DataParallel replica or a tensor-parallel model"


def _checkpointing_training(model) -> bool:
    """A training forward of a model that checkpoints: backward's recomputation needs the general path's
    kept hooks (``fixes.gradient_checkpointing``)."""
    if not (torch.is_grad_enabled() and model.training):
        return False
    return bool(checkpoint_functions(model.model))


# --- the plan ------------------------------------------------------------------------------------------------

def _plan(model) -> Plan | None:
    """The model's plan, built when its interventions are new; None where it takes the general path."""
    options = OPTIONS.current
    if options is None or not options.fast_path or model.__dict__.get("_is_replica"):
        return None  # a DataParallel replica is a new object per forward: no plan to reuse
    state = MODELS.of(model, FastPathState)
    plan = state.plan
    if plan is None or plan.interventions != list(model.interventions.values()):
        if plan is not None:
            plan.remove()
        plan = state.plan = _build(model)
    if plan.refusal is not None:
        return None
    return None if is_tensor_parallel(model) else plan  # its fact, found once per model


def plan_of(model) -> Plan | None:
    """The plan ``model`` holds now (built at its first call), or None."""
    state = MODELS.get(model, FastPathState)
    return None if state is None else state.plan


def plan_refusal(model) -> str | None:
    """Why ``model`` takes pyvene's general path, or None where its calls can take the plan (an entry whose
    pyvene function is not 0.1.8's sends its own calls there, whatever the model: ``_changed``)."""
    if model.mode != "parallel":
        return f"mode={model.mode!r} (the plan runs pyvene's 'parallel' mode)"
    if model.as_adaptor or model.return_collect_activations:
        return "as_adaptor or return_collect_activations is set"
    if model._intervention_reverse_link:
        return "interventions are linked (shared subspaces)"
    if not model.interventions:
        return "the model has no interventions"
    reft = sys.modules.get("pyreft.interventions")
    reft_types = tuple(getattr(reft, name) for name in REFT_TYPES) if reft is not None else ()
    mapping = type_to_module_mapping.get(model.model_type, {})
    for key in model.sorted_keys:
        intervention, representation = model.interventions[key], model.representations[key]
        if not isinstance(intervention, reft_types):
            return f"{key}: a {type(intervention).__name__}, not one of pyreft's {', '.join(REFT_TYPES)}"
        if representation.unit != "pos":
            return f"{key}: unit {representation.unit!r}, not 'pos'"
        if getattr(model.intervention_hooks[key], "__name__", None) != "register_forward_hook":
            return f"{key}: component {representation.component!r} is not a module's output"
        if len(mapping.get(representation.component, ())) > 2:
            return f"{key}: component {representation.component!r} is a split of its module's output"
    return None


def _compiled_module(base) -> str | None:
    """The first module of ``base`` compiled on its own (``Module.compile()``, or a compiled ``forward`` set on
    it), named, or None."""
    for name, module in base.named_modules():
        forward = module.__dict__.get("forward")
        if module.__dict__.get("_compiled_call_impl") is not None or hasattr(forward, "_torchdynamo_orig_callable"):
            return f"module {name!r}" if name else "forward"
    return None


@torch.compiler.disable  # built eagerly where the first call is compiled: registering hooks breaks a graph
def _build(model) -> Plan:
    interventions = list(model.interventions.values())
    refusal = plan_refusal(model)
    if refusal is not None:
        return Plan(interventions, refusal)
    plan = Plan(interventions, None, config_has_use_cache="use_cache" in model.model.config.to_dict())
    compiled = _compiled_module(model.model)
    if compiled is not None:
        warnings.warn(
            f"pyvene_dist: the base model's {compiled} was compiled before its ReFT's first call. dynamo does not "
            "guard on module hooks: where that compiled code already ran, its graphs run without the hooks "
            "registered now and the interventions are dropped; compile the base model after the ReFT's first "
            "call, or compile the step that calls the ReFT (docs/fast_path.md)", RuntimeWarning, stacklevel=3)
    order = [key for keys in model._intervention_group.values() for key in keys]  # pyvene's registration order
    for number, key in enumerate(order):
        step = Step(number, model.sorted_keys.index(key), model.interventions[key])
        plan.steps.append(step)
        plan.handles.append(model.intervention_hooks[key](_hook(plan, step), with_kwargs=True))
    return plan


FIX = Fix(
    __name__,
    sites=(
        # a forward or generate other than 0.1.8's (WRITTEN_FROM) sends its calls to the general path (``_changed``)
        Site((IntervenableModel, "forward"), _forward_entry, kind="entry", any_form=True),
        Site((IntervenableModel, "generate"), _generate_entry, kind="entry", any_form=True),
    ),
    # Its wrap of IntervenableModel.forward (the general path) stays under the entry: applied first.
    after=("gradient_checkpointing",),
    state=FastPathState,
    # off: every forward and generate takes pyvene's general path (docs/fast_path.md)
    options=(Option("fast_path", "PYVENE_DIST_FAST_PATH", default=True),),
    # the plan calls what these do (Linear, Dropout, LinearActivation) when _call_impl would run only them
    relies_on=(
        nn.Module._call_impl,
        nn.Linear.forward,
        nn.Dropout.forward,
        nn.functional.dropout,
        LinearActivation.forward,
    ),
)
