"""Remove only pyvene's own hooks, never anyone else's; keep the intervening ones when backward needs them.

``IntervenableModel._cleanup_states`` runs at the start and end of every ``forward`` and ``generate``
and calls ``remove_forward_hooks(self.model)``, which pops *every* forward and pre-forward hook of
every module of the base model. DeepSpeed ZeRO-3 and FSDP2 gather and free parameters in such hooks;
profilers and users keep theirs there too. After one pyvene forward they are silently gone.

The fix records the handles pyvene's hook factories (``_intervention_getter``,
``_intervention_setter``) return in the model's state (``HookState.handles``), and
``_remove_forward_hooks`` removes exactly those. The state is found from the model object, so
``nn.DataParallel`` replicas (shallow copies) keep their own; ``unpatch()`` removes what is left.

While ``fixes.gradient_checkpointing`` keeps a forward's intervening hooks for backward's recomputation
(``mechanisms.hook_handles.setters_kept_alive``), their handles go to it instead of to pyvene, which would
remove them when its forward returns.

The hooks that apply interventions also write into a copy where pyvene's in-place write would change a
tensor autograd saved. pyvene's scatter writes into the hooked tensor itself. Under ``sdpa`` attention
the input of ``o_proj`` (``attention_value_output``, ``head_attention_value_output``) is a view of
the attention's output: ``transpose(1, 2).contiguous()`` copies nothing, as the CPU and CUDA kernels
lay the output out as ``[batch, positions, heads, head size]``, and the attention saved that output
for its backward. With an intervention at an earlier layer (so that the attention records its
backward) training fails in backward with ``one of the variables needed for gradient computation has
been modified by an inplace operation: [torch.FloatTensor [4, 4, 16, 16]], which is output 0 of
ScaledDotProductFlashAttentionForCpu``. The hook then hands pyvene a copy to write into and the module
that copy (``mechanisms.copy_on_write``), which changes neither outputs nor gradients. Whether the tensor aliases
a saved one is read from the few autograd nodes that made it (``aliases_saved``: the sdpa node behind the
views, also behind the autograd Function DeepSpeed ZeRO-3 puts around a module's inputs, and flex
attention's compiled function, which keeps what it saved in ``saved_tensors``). The hook copies too where
autograd refuses writes into the view it is handed (``forbids_writes``: under flex attention on a GPU,
o_proj's input is a view of the compiled function's output). A tensor that aliases nothing saved (eager
attention's copy, a linear layer's output) is written in place as before: no copy; the check costs some
15-25 us per intervention and forward on a CPU.

An intervention at ``attention_weight`` (GPT-2's attention probabilities, the input of the module
``attn.attn_dropout``) is refused where the model never calls that module, which stock pyvene silently
left without an intervention (the matrix found it: training then failed with ``element 0 of tensors
does not require grad``, inference was silently the base model's). ``sdpa``, flash and flex attention
never compute the probabilities, and transformers 5's eager attention drops them out with
``nn.functional.dropout``: the module runs only in ``reorder_and_upcast_attn=True``'s path.
"""

from __future__ import annotations

import transformers
from pyvene.models.intervenable_base import IntervenableModel

from .._records import Fix, Site
from .._registry import MODELS
from ..mechanisms.copy_on_write import must_copy, writing_to_copies
from ..mechanisms.hook_handles import HookState, keeping



def _wrap_hook_factory(wrapped, instance, args, kwargs):
    handler_list = wrapped(*args, **kwargs)
    MODELS.of(instance, HookState).handles.extend(handler_list.handlers)
    return handler_list


#: GPT-2's attention probabilities: computed by its module under eager attention only (see the docstring).
ATTENTION_PROBABILITIES = "attention_weight"


def _wrap_setter_factory(wrapped, instance, args, kwargs):
    _refuse_components_never_computed(instance, args[0] if args else kwargs["keys"])
    handler_list = wrapped(*args, **kwargs)
    kept = keeping(instance)
    for handle in handler_list.handlers:
        hooks = handle.hooks_dict_ref()
        if hooks is not None and handle.id in hooks:
            hook = writing_to_copies(hooks[handle.id], inputs=must_copy, outputs=must_copy)
            hooks[handle.id] = kept.wrap_hook(hook) if kept is not None and kept.wrap_hook is not None else hook
    if kept is None:
        MODELS.of(instance, HookState).handles.extend(handler_list.handlers)
        return handler_list
    kept.handles.extend(handler_list.handlers)
    return type(handler_list)([])  # what pyvene removes when its forward returns: nothing


def _refuse_components_never_computed(model, keys) -> None:
    for key in keys:
        if model.representations[key].component == ATTENTION_PROBABILITIES:
            why = _why_attention_probabilities_are_not_computed(getattr(model.model, "config", None))
            if why:
                raise ValueError(f"intervention {key!r} is at component {ATTENTION_PROBABILITIES!r}, which this "
                                 f"model never computes, so it would never apply: {why}")


def _why_attention_probabilities_are_not_computed(config) -> str | None:
    attention = getattr(config, "_attn_implementation", None) or "eager"
    if attention != "eager":
        return (f"the model's attn_implementation is {attention!r}, expected 'eager' (load the model with "
                "attn_implementation='eager')")
    if int(transformers.__version__.split(".")[0]) >= 5 and not getattr(config, "reorder_and_upcast_attn", False):
        return (f"transformers {transformers.__version__}'s eager attention applies dropout as a function and "
                "calls attn.attn_dropout only with config.reorder_and_upcast_attn=True, found False")
    return None


def _wrap_remove_forward_hooks(wrapped, instance, args, kwargs):
    state = MODELS.get(instance, HookState)
    if state is None:
        return
    handles, state.handles = state.handles, []
    for handle in handles:
        handle.remove()


FIX = Fix(
    __name__,
    sites=(
        Site((IntervenableModel, "_intervention_getter"), _wrap_hook_factory),
        Site((IntervenableModel, "_intervention_setter"), _wrap_setter_factory),
        Site((IntervenableModel, "_remove_forward_hooks"), _wrap_remove_forward_hooks, kind="replace"),
    ),
    state=HookState,
    upstream=("pyvene",),
)
