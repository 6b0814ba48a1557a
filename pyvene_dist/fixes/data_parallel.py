"""``nn.DataParallel`` over an ``IntervenableModel``: split by batch, independent replicas, right devices.

What users see today with two GPUs and no torchrun (HF Trainer then wraps ``nn.DataParallel``):
``KeyError: Parameter containing: ...`` in ``replicate`` (fixed by ``fixes.parameters``); past that,
locations split on the intervention axis or copied whole to every replica; a hook registered by one
replica's thread firing in every replica (``Expected all tensors to be on the same device, but got
index is on cuda:1, different from other tensors on cuda:0``); ``StopIteration`` from ``get_device``
on a replica; and ``lazy wrapper should be called at most once`` from LoReFT's orthogonal
parametrization, first called in DataParallel's threads.

- ``DataParallel.scatter``: for an ``IntervenableModel``, every argument is split along its batch axis
  into the chunks ``torch.chunk`` gives the input (``pyvene_dist.mechanisms.batch_split``), and moved to its replica's
  device. Other models go through the original untouched.
- ``DataParallel.replicate``: a replica is a shallow copy, sharing its original's hook dicts and
  pyvene's state (caches, counters, ``InterventionState``s) across threads. Each replica gets copies of
  the hook dicts of the modules pyvene hooks (hooks present before stay; new ones stay its own; every
  module's where neither ``fixes.hooks`` nor a pyvene carrying it removes pyvene's hooks only, as pyvene
  then pops every hook after each forward),
  ``intervention_hooks`` bound to its own modules, fresh pyvene state, and its device. LoReFT's Householder product is initialised
  once per device from the calling thread.
- ``BaseModel.get_device``: a replica answers its device (its weights are plain tensors, so
  ``model.device`` has no parameter to look at). Any other model answers its first parameter's device
  through the path to that parameter, found at the first call, without walking the modules each time.

What the fix knows (a replica's device, the devices it initialised, the model's ``forward`` signature and
the names of its hooked modules, found once per model) is kept in the model's state
(``DataParallelState``). ``mechanisms.wrapped_models.is_replica`` reads torch's private mark of a replica, for the
fixes that leave replicas alone.

Gathering needs nothing: outputs come back as one batch in input order, and the per-replica losses
as a vector, which HF Trainer averages (``loss.mean()`` when ``n_gpu > 1``).

Run on 2 x H200; the splitting logic on the CPU too.
"""

from __future__ import annotations

import collections
import dataclasses
import inspect
from typing import Any

import pyvene
import torch
from pyvene.models.intervenable_base import BaseModel, IntervenableModel
from pyvene.models.intervention_utils import InterventionState
from torch.nn.parallel.data_parallel import DataParallel
from torch.nn.parallel.replicate import replicate

from .._records import Fix, Site
from .._registry import MODELS, applied
from ..mechanisms.batch_split import batch_size_of, chunk_sizes, split_forward_arguments


@dataclasses.dataclass(eq=False)
class DataParallelState:
    #: for a replica, its device (its weights are plain tensors that cannot say).
    replica_device: Any = None
    #: the names from the base model down to its first parameter (``get_device``).
    first_parameter: Any = None
    #: the signature of the model's ``forward`` (scatter binds its arguments to it).
    forward_signature: Any = None
    #: intervention key -> the name of the module its hook sits on.
    hooked_module_names: Any = None
    #: devices whose Householder product was initialised from the calling thread.
    warmed_devices: set = dataclasses.field(default_factory=set)
    #: whether pyvene removes only the hooks it registered (``removes_only_its_hooks``), found at the first
    #: replicate: the fixes applied and pyvene's ``FIXES`` do not change while patched.
    removes_only_its_hooks: bool | None = None

    def close(self) -> None:  # nothing registered, nothing swapped: what it holds goes with it
        pass
_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
)


def _wrap_scatter(wrapped, instance, args, kwargs):
    model = instance.module
    if not isinstance(model, IntervenableModel):
        return wrapped(*args, **kwargs)
    inputs, module_kwargs, device_ids = _arguments(args, kwargs, "inputs", "kwargs", "device_ids")
    arguments = _forward_signature(model).bind(*inputs, **module_kwargs).arguments
    sizes = chunk_sizes(batch_size_of(arguments["base"]), len(device_ids))
    pieces = split_forward_arguments(model, arguments, sizes)
    devices = [_cuda(device_id) for device_id in device_ids[: len(sizes)]]
    return tuple(() for _ in sizes), tuple(_to_device(piece, device) for piece, device in zip(pieces, devices))


def _wrap_replicate(wrapped, instance, args, kwargs):
    replicas = wrapped(*args, **kwargs)
    original = instance.module
    if isinstance(original, BaseModel):
        _, device_ids = _arguments(args, kwargs, "module", "device_ids")
        for replica, device_id in zip(replicas, device_ids):
            device = _cuda(device_id)
            _warm_householder(original, device)
            _make_independent(replica, original, device)
    return replicas


def _wrap_get_device(wrapped, instance, args, kwargs):
    state = MODELS.of(instance, DataParallelState)
    if state.replica_device is not None:
        return state.replica_device
    parameter = _first_parameter(instance.model, state.first_parameter)
    if parameter is not None:
        return parameter.device
    device = wrapped(*args, **kwargs)
    state.first_parameter = next((tuple(name.split(".")) for name, _ in instance.model.named_parameters()), None)
    return device


def _first_parameter(model, path):
    """The parameter at ``path`` (names from ``model`` down), or None where nothing is there now.

    pyvene's ``get_device`` is ``model.device``, transformers' device of the first parameter, found by
    walking the modules (36 Python calls), and pyvene asks it twice per intervention per forward and per
    generated token (for gather and scatter, which ``fixes.devices`` makes ignore it): some 290 calls per
    token of every-token generation with 4 interventions. The path to that parameter is found once; the
    parameter is read through it each time (a moved model, FSDP's unsharded parameters, a replaced module
    are seen), and looked for again when the path no longer leads to one."""
    if path is None:
        return None
    module = model
    for name in path[:-1]:
        module = module._modules.get(name)
        if module is None:
            return None
    parameter = module._parameters.get(path[-1])
    return parameter if isinstance(parameter, torch.Tensor) else None


def _make_independent(replica, original, device: torch.device) -> None:
    state = MODELS.of(original, DataParallelState)
    if state.hooked_module_names is None:
        module_names = {id(module): name for name, module in original.named_modules(remove_duplicate=False)}
        state.hooked_module_names = {key: module_names[id(register.__self__)]
                                     for key, register in original.intervention_hooks.items()}
    if state.removes_only_its_hooks is None:
        state.removes_only_its_hooks = removes_only_its_hooks()
    hooks = {key: getattr(replica.get_submodule(name), original.intervention_hooks[key].__name__)
             for key, name in state.hooked_module_names.items()}
    # pyvene registers its hooks on the hooked modules only; unless fixes.hooks removes just those, it pops
    # every hook of every module after each forward, which in a shared dict would be the original's.
    changed = (register.__self__ for register in hooks.values()) if state.removes_only_its_hooks else replica.modules()
    for module in changed:
        for name in _HOOK_DICTS:
            module.__dict__[name] = collections.OrderedDict(module.__dict__[name])
    replica.__dict__.update({
        "intervention_hooks": hooks,
        "activations": {},
        "hot_activations": {},
        "_batched_setter_activation_select": {},
        "full_intervention_outputs": [],
        "_intervention_state": {key: InterventionState(key) for key in original._intervention_state},
        "_key_getter_call_counter": dict.fromkeys(original._key_getter_call_counter, 0),
        "_key_setter_call_counter": dict.fromkeys(original._key_setter_call_counter, 0),
    })
    MODELS.of(replica, DataParallelState).replica_device = device


def _warm_householder(model, device: torch.device) -> None:
    # torch initialises householder_product's backend lazily, and not thread-safely.
    warmed = MODELS.of(model, DataParallelState).warmed_devices
    if device not in warmed:
        torch.linalg.householder_product(torch.eye(2, 1, device=device), torch.zeros(1, device=device))
        warmed.add(device)


def removes_only_its_hooks() -> bool:
    """Whether pyvene removes only the hooks it registered: ``fixes.hooks`` is applied, or the pyvene imported
    carries it (``hooks`` in ``pyvene.FIXES``; ``patch()`` then leaves it off). Asked once per model
    (``DataParallelState``), not per replica and forward."""
    return applied("hooks", by=FIX) or "hooks" in getattr(pyvene, "FIXES", ())


def _arguments(args, kwargs, *names):
    """The arguments ``names`` of a call of torch's ``DataParallel.scatter``/``replicate``, by position or by
    keyword: their signatures are fixed and have no defaults, so nothing is bound per forward."""
    return tuple(args[i] if i < len(args) else kwargs[name] for i, name in enumerate(names))


def _forward_signature(model) -> inspect.Signature:
    """The signature of ``model.forward``, found once and kept in the model's state."""
    state = MODELS.of(model, DataParallelState)
    if state.forward_signature is None:
        state.forward_signature = inspect.signature(model.forward)
    return state.forward_signature


def _cuda(device_id: int) -> torch.device:
    return torch.device("cuda", device_id)  # DataParallel keeps device_ids as indices


def _to_device(value, device: torch.device):
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    if isinstance(value, dict):
        return {key: _to_device(item, device) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_device(item, device) for item in value)
    return value


FIX = Fix(
    __name__,
    sites=(
        Site((DataParallel, "scatter"), _wrap_scatter),
        Site((DataParallel, "replicate"), _wrap_replicate),
        Site((BaseModel, "get_device"), _wrap_get_device),
    ),
    after=("hooks",),  # a replica's hook record is that fix's, where it is applied (removes_only_its_hooks)
    state=DataParallelState,
    relies_on=(replicate,),  # its replicas' shared hook dicts and _is_replica mark
)
