"""FSDP (``fully_shard``, and ``FullyShardedDataParallel``) shards the base model and leaves interventions whole.

When FSDP wraps a module that holds a pyvene model, the interventions' parameters are passed to it as
ignored (``ignored_params`` for FSDP2, ``ignored_modules``/``ignored_states`` for FSDP1): they stay
plain, replicated tensors on the device FSDP computes on, and pyvene_dist averages their gradients
over the data-parallel group as each one is accumulated, as DDP would. The frozen base model, which
is nearly all the bytes, is sharded as usual.

Why not shard the interventions too: they are ~0.01% of the parameters, so sharding saves nothing
measurable, and pyvene and pyreft read their weights outside their own forward, where FSDP holds them
sharded. Sharded, LoReFT's rotation fails whenever it is read there (``RuntimeError: aten.mm.default
got mixed torch.Tensor and DTensor`` on CPU; ``NotImplementedError: Operator
aten.linalg_householder_product.default does not have a sharding strategy registered`` under HF
Trainer on 2 x H200), and saving would need every rank to take part. Whole, rank 0 saves them alone.

**Mixed precision.** A ``MixedPrecisionPolicy`` (``fully_shard(..., mp_policy=...)``) makes every unit compute in
its ``param_dtype``; the interventions are left out of sharding, and so out of the policy: they kept their own
dtype. accelerate's FSDP2 with ``mixed_precision="bf16"`` (HF Trainer's ``--bf16``) sets ``param_dtype=bfloat16``
and first casts every trainable parameter to float32 (its master weights), the interventions' included, and it
applies no autocast under FSDP2 (its other strategies run the forward under ``torch.autocast``). The hidden states
reached the interventions in bf16 and met float32 weights: ``RuntimeError: mat1 and mat2 must have the same dtype,
but got BFloat16 and Float`` in the first forward on a GPU. (On the CPU accelerate trains DDP under autocast with
the same flags: it applies FSDP in a GPU world only.) Where the policy's ``param_dtype`` differs from the one dtype
of an intervention's floating-point parameters, the intervention now computes in its own dtype: the hidden states
are cast to it on the way in and back to ``param_dtype`` on the way out (``mechanisms.own_dtype``: forward hooks on the
intervention, removed by ``unpatch()``). Its weights stay as they are (accelerate's
float32 master weights), and so do its gradients. An intervention whose parameters mix dtypes (pyreft's LoReFT
built with ``dtype=torch.bfloat16`` keeps its rotation in float32 and casts for itself) is left alone.

**Trainable parameters of the base.** Where the base trains parameters of its own beside the interventions
(pyreft's classifier trains its ``score`` head, ReFT with LoRA its adapters), FSDP2 makes those DTensors while the
interventions stay plain tensors. An optimizer whose one param group holds both fails at its first step when it runs
foreach or fused, as torch's optimizers do by default on CUDA: ``RuntimeError: aten._foreach_mul_.Scalar got mixed
torch.Tensor and DTensor, need to convert all torch.Tensor to DTensor before calling distributed operators!``
(pytorch/pytorch#183207, open). pyvene_dist cannot see the optimizer when ``fully_shard`` runs, so the wrap warns
(``optim.MixedParameterGroupsWarning``, a ``RuntimeWarning``; once per pyvene model), naming the sharded trainable
parameters and the ways out: the interventions in a param group of their own (Adam, AdamW and SGD run foreach per
group; ``pyvene_dist.optim.param_groups`` builds them so, and where it does the warning may be filtered by its
class), or ``foreach=False``. HF Trainer makes no such group: transformers 5.24+ gives each device mesh, and the
plain tensors, groups of their own, and 5.17 turns foreach and fused off for its ``adamw_torch`` optimizers when the
trainable parameters mix.

Apply FSDP to the module that holds the pyvene model (the ``IntervenableModel``/``ReftModel`` itself,
as HF Trainer and accelerate do); ``pyvene_dist.fsdp.fully_shard_model`` does that with one unit per
decoder layer. Sharding only ``reft_model.model`` leaves the interventions' gradients unreduced.

The gradient-averaging hooks are kept in the pyvene model's state (``FsdpState.reduced``):
they are removed by ``unpatch()``, and when the model is garbage collected.

Run on 2 x H200 (nccl) and on the CPU (gloo).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import warnings
import weakref
from typing import Iterable

import torch
import torch.distributed as dist
import torch.distributed.fsdp._fully_shard._fully_shard as fully_shard_module
from torch import nn
from torch.distributed import fsdp as fsdp_package
from torch.distributed.fsdp import _fully_shard as fully_shard_package
from torch.distributed.fsdp.fully_sharded_data_parallel import FullyShardedDataParallel
from torch.distributed.tensor import DTensor  # fully_shard's module imports it anyway

from .._records import Fix, Site
from .._registry import MODELS, applied
from ..quantized import refuse_unshardable
from ..mechanisms.dtensors import forget_dtensor_parameters
from ..mechanisms.own_dtype import compute_in_own_dtype
from ..mechanisms.same_interventions import check_same_interventions
from ..mechanisms.wrapped_models import intervenable_models
from ..optim import MixedParameterGroupsWarning


@dataclasses.dataclass(eq=False)
class FsdpState:
    """A pyvene model's intervention parameters -> the handle of the hook that averages the gradient; whether
    the model was warned of trainable DTensors beside its plain interventions."""

    reduced: "weakref.WeakKeyDictionary" = dataclasses.field(default_factory=weakref.WeakKeyDictionary)
    warned_of_mixed_parameters: bool = False

    def close(self) -> None:
        for handle in list(self.reduced.values()):
            handle.remove()
        self.reduced = weakref.WeakKeyDictionary()
        self.warned_of_mixed_parameters = False


def pyvene_models(modules: Iterable[nn.Module]) -> list[nn.Module]:
    """Every pyvene model inside ``modules``, each with interventions of its own (the first that holds them)."""
    found, interventions = [], []
    for module in modules:
        for model in intervenable_models(module):
            if not any(model.interventions is seen for seen in interventions):
                found.append(model)
                interventions.append(model.interventions)
    return found


def _check_same_interventions(module, group) -> None:
    """``consistency``'s check as FSDP wraps ``module``, where that fix is applied (``exclude=["consistency"]``
    leaves it out under FSDP as under DDP)."""
    if applied("consistency", by=FIX):
        check_same_interventions(module, group)


def _wrap_fully_shard(wrapped, instance, args, kwargs):
    modules = args[0] if args else kwargs["module"]
    modules = list(modules) if isinstance(modules, (list, tuple)) else [modules]
    models = pyvene_models(modules)
    if not models:
        return wrapped(*args, **kwargs)
    refuse_unshardable(modules, "FSDP2 (fully_shard)")  # 8-bit fails at the first forward otherwise
    mesh = kwargs.get("mesh")
    for module in modules:  # the same on every rank of each mesh dimension: the same on the whole mesh
        for group in [mesh.get_group(dim) for dim in range(mesh.ndim)] if mesh is not None else [None]:
            _check_same_interventions(module, group)
    parameters = {p for model in models for p in model.interventions.parameters()}
    kwargs["ignored_params"] = set(kwargs.get("ignored_params") or ()) | parameters
    sharded = wrapped(*args, **kwargs)
    for model in models:  # its parameters are DTensors now: tensor_parallel looks again
        forget_dtensor_parameters(model)
    mesh = mesh or _default_mesh(modules, parameters)
    groups = [mesh.get_group(dim) for dim in range(mesh.ndim)]
    _place_and_reduce(models, _compute_device(modules, parameters, mesh), groups)
    _warn_of_mixed_parameters(modules, models)
    compute_dtype = getattr(kwargs.get("mp_policy"), "param_dtype", None)
    if compute_dtype is not None:  # the policy computes the base in it, and leaves the interventions out
        for model in models:
            compute_in_own_dtype(model, compute_dtype)
    return sharded


#: How many of the sharded trainable parameters the warning names.
NAMED_IN_WARNING = 3
#: This package's folder: frames there are fixes' wraps, not the user's call.
FIXES_FOLDER = os.path.dirname(os.path.abspath(__file__))


def _warn_of_mixed_parameters(modules: list[nn.Module], models: list[nn.Module]) -> None:
    """Warn, once per pyvene model whose interventions train, where FSDP2 made trainable parameters outside them
    DTensors: a foreach or fused optimizer step fails on a param group that holds both kinds."""
    states = {model: MODELS.of(model, FsdpState) for model in models}
    unwarned = [model for model, state in states.items() if not state.warned_of_mixed_parameters
                and any(p.requires_grad for p in model.interventions.parameters())]
    if not unwarned:
        return
    sharded = [name for module in modules for name, parameter in nn.Module.named_parameters(module)
               if parameter.requires_grad and isinstance(parameter, DTensor)]
    if not sharded:
        return
    for model in unwarned:
        states[model].warned_of_mixed_parameters = True
        named = ", ".join(sharded[:NAMED_IN_WARNING]) + (f" and {len(sharded) - NAMED_IN_WARNING} more"
                                                          if len(sharded) > NAMED_IN_WARNING else "")
        warnings.warn(
            f"FSDP2 sharded trainable parameters of {type(model).__name__} outside its interventions ({named}): they "
            "are DTensors now, and the interventions stay plain tensors. An optimizer step that runs foreach or fused "
            "(torch's default on CUDA) over one param group holding both fails with 'RuntimeError: "
            "aten._foreach_mul_.Scalar got mixed torch.Tensor and DTensor' (pytorch/pytorch#183207). Give the "
            "interventions a param group of their own (pyvene_dist.optim.param_groups(model, weight_decay) does), or "
            "pass foreach=False; HF Trainer (pyreft's trainers too) does one or the other itself "
            "(docs/troubleshooting.md).",
            MixedParameterGroupsWarning, stacklevel=_caller_of_fully_shard())


def _caller_of_fully_shard() -> int:
    """The ``stacklevel`` of ``_warn_of_mixed_parameters``' warning that names the caller of ``fully_shard``: the first
    frame outside pyvene_dist's fixes, whose wraps and entries around ``fully_shard`` add a frame each (this fix's,
    then ``sharded_loading``'s entry)."""
    frame, level = sys._getframe(2), 2
    while frame is not None and frame.f_code.co_filename.startswith(FIXES_FOLDER):
        frame, level = frame.f_back, level + 1
    return level


def _wrap_fsdp1_init(wrapped, instance, args, kwargs):
    module = args[0] if args else kwargs["module"]
    models = pyvene_models([module])
    interventions = [model.interventions for model in models]
    if interventions:
        refuse_unshardable([module], "FSDP1 (FullyShardedDataParallel)")
        _check_same_interventions(module, kwargs.get("process_group"))
        device_id = kwargs.get("device_id")
        if device_id is not None:  # FSDP moves what it manages there; sync_module_states wants the rest there too
            device = torch.device("cuda", device_id) if isinstance(device_id, int) else torch.device(device_id)
            for intervention in interventions:
                intervention.to(device)
        if kwargs.get("ignored_states") is not None:
            kwargs["ignored_states"] = list(kwargs["ignored_states"]) + [
                p for m in interventions for p in m.parameters()
            ]
        else:
            kwargs["ignored_modules"] = list(kwargs.get("ignored_modules") or ()) + interventions
    wrapped(*args, **kwargs)
    if interventions:
        groups = [instance.process_group] + [g for g in [getattr(instance, "_inter_node_pg", None)] if g is not None]
        _place_and_reduce(models, instance.compute_device, groups)


def _place_and_reduce(models: list[nn.Module], device: torch.device, groups: list) -> None:
    size = 1
    for group in groups:
        size *= dist.get_world_size(group)
    for model in models:
        if any(p.device.type == "meta" for p in model.interventions.parameters()):
            # accelerate's cpu_ram_efficient_loading moved them there before sharding; its load (through
            # fixes.sharded_loading) copies rank 0's weights into these tensors, keeping the hooks below
            model.interventions.to_empty(device=device)
        else:
            model.interventions.to(device)
        reduced = MODELS.of(model, FsdpState).reduced
        for parameter in model.interventions.parameters():
            if parameter.requires_grad and not _averaged(parameter):
                reduced[parameter] = parameter.register_post_accumulate_grad_hook(_averager(groups, size))


def _averaged(parameter: nn.Parameter) -> bool:
    """Whether some pyvene model's state already averages ``parameter``'s gradient (a second FSDP wrap,
    or interventions that two models share)."""
    return any(parameter in state.reduced for state in MODELS.all(FsdpState))


def _averager(groups: list, size: int):
    def average(parameter: torch.Tensor) -> None:
        for group in groups:
            dist.all_reduce(parameter.grad, group=group)
        parameter.grad.div_(size)

    return average


def _default_mesh(modules: list[nn.Module], ignored: set):
    """The mesh FSDP2 built when none was given: that of any parameter it now shards."""
    for module in modules:
        for parameter in module.parameters():
            if parameter not in ignored and isinstance(parameter, DTensor):
                return parameter.device_mesh
    raise RuntimeError("fully_shard left no parameter sharded; pyvene_dist cannot tell its process group")


def _compute_device(modules: list[nn.Module], ignored: set, mesh) -> torch.device:
    """Where the sharded parameters are; for a model still on the meta device (a sharded load fills it after
    ``fully_shard``, ``fixes.sharded_loading``), the mesh's device."""
    for module in modules:
        for parameter in module.parameters():
            if parameter not in ignored and parameter.device.type != "meta":
                return parameter.device
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(mesh.device_type, torch.get_device_module(mesh.device_type).current_device())


FIX = Fix(
    __name__,
    sites=(
        Site((fully_shard_module, "fully_shard"), _wrap_fully_shard,
             reexported_in=(fully_shard_package, fsdp_package)),  # looked up in each
        Site((FullyShardedDataParallel, "__init__"), _wrap_fsdp1_init),
    ),
    # consistency: its check of the ranks' interventions, where that fix is applied. (A model's DTensor record,
    # reset when fully_shard makes some, is mechanisms.dtensors', whichever fixes read it.)
    after=("consistency",),
    state=FsdpState,
)
