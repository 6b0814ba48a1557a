"""Sharded launches load the whole base on every rank: each rank now reads and keeps only its share.

Measured at 7424c13 on a 206M Llama folder (787 MiB of float32 safetensors), 2 CPU ranks: the largest rank's peak
memory was 1.75 x the model under FSDP2 and 3.19 x under ZeRO-3, against 1.33 x for one process. transformers
reads every safetensors file whole on every rank (under ZeRO-3 on rank 0, then gathers each weight on every rank to
copy it in), accelerate's ``cpu_ram_efficient_loading`` keeps the whole model on rank 0 and broadcasts it, and
without that flag every rank holds all of it until ``fully_shard`` runs. A 4-bit 70B (~37 GiB) cannot start on two
24 GB GPUs that would hold it sharded.

Where the launch shards the model, ``from_pretrained`` (``PreTrainedModel._load_pretrained_model``) now reads none of
the weights; it pairs each tensor of the model with its tensor in the folder's safetensors (``loading.fill``) and:

- under ZeRO-3 (transformers' ``zero.Init``, which partitions the model as it builds it), copies each rank's
  partition of each weight from the memory-mapped files at once;
- under FSDP2 (accelerate's plugin or HF Trainer's ``fsdp_config`` with ``cpu_ram_efficient_loading``, or inside
  ``pyvene_dist.loading.sharded()``), leaves the model on the meta device on every rank and records its files; each
  rank reads its rows of each weight when ``fully_shard`` has sharded all of the model (an entry around
  ``fully_shard``), and accelerate's ``fsdp2_load_full_state_dict`` then broadcasts from rank 0 only what no file
  holds (the interventions), copying it into the tensors in place: its own ``load_state_dict(assign=True)`` gave
  the interventions new parameters, without the gradient-averaging hooks ``fixes.fsdp`` put on the old ones.

``BaseModel.set_device`` of a pyvene model over a base still on the meta device (``pyreft.get_reft_model`` calls
``set_device(model.device)``) keeps the interventions where they are: moved to the meta device they lost the weights
they were built with. FSDP2 under accelerate without ``cpu_ram_efficient_loading`` is refused by ``from_pretrained``,
naming the flag (every rank would load the whole model), and so is ZeRO-3 under accelerate without
``zero3_init_flag``. A checkpoint that cannot be read in parts (``.bin`` files, tensors the model names otherwise, a
quantized base, a ``device_map``) is loaded as transformers loads it, with a warning saying why.

``patch(sharded_loading=False)`` or ``PYVENE_DIST_SHARDED_LOADING=0`` leaves ``from_pretrained`` as it is.
Run on the CPU (gloo, 2 and 4 ranks) with transformers 5.24 and accelerate 1.16.
"""

from __future__ import annotations

import logging
import os
import warnings

import torch
import torch.distributed as dist
import torch.distributed.fsdp._fully_shard._fully_shard as fully_shard_module
from pyvene.models.intervenable_base import BaseModel
from torch import nn
from torch.distributed import fsdp as fsdp_package
from torch.distributed.fsdp import _fully_shard as fully_shard_package
from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled
from transformers.modeling_utils import PreTrainedModel

from .._options import Option, switch
from .._records import Fix, Site
from .._registry import MODELS, OPTIONS
from ..loading.broadcast import broadcast_in_place
from ..loading.checkpoint_files import CheckpointFiles
from ..loading.four_bit import pack_on_meta, quantized_weights
from ..loading.fill import ShardedLoadingError, checkpoint_names, fill, materialize, named_tensors, whole_bytes
from ..loading.record import ASKED, ShardedLoad
from ..mechanisms.arguments import bound
from ..mechanisms.wrapped_models import intervenable_models

log = logging.getLogger("pyvene_dist")
SHARDED_LOADING = Option("sharded_loading", "PYVENE_DIST_SHARDED_LOADING", default=True)
#: Set where accelerate applies HF Trainer's FSDP plugin on CPUs (``pyvene_dist.testing.hf.fsdp_on_cpu``): by
#: itself accelerate trains DDP on a machine without an accelerator, whatever FSDP flags the launch sets.
FSDP_ON_CPU = "PYVENE_DIST_FSDP_ON_CPU"


class WholeLoadWarning(RuntimeWarning):
    """A sharded launch's model was loaded whole on every rank, and why."""


def launch_shards() -> str | None:
    """How this process's launch shards a model ``from_pretrained`` loads now: ``"zero3"``, ``"fsdp2"`` or None.
    Raises ``ShardedLoadingError`` for a launch that would load the whole model on every rank, naming the flag."""
    if ASKED.get():
        return "fsdp2"
    several = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if is_deepspeed_zero3_enabled():
        return "zero3"
    if several and switch("ACCELERATE_USE_DEEPSPEED", False) and os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE") \
            == "3" and not switch("ACCELERATE_DEEPSPEED_ZERO3_INIT", True):
        raise ShardedLoadingError(
            "from_pretrained under accelerate's DeepSpeed ZeRO-3 with zero3_init_flag off loads the whole model on "
            "every rank; set zero3_init_flag: true under deepspeed_config in the accelerate config (or "
            "PYVENE_DIST_SHARDED_LOADING=0 to load it whole anyway)")
    fsdp = switch("ACCELERATE_USE_FSDP", False) or "FSDP_CPU_RAM_EFFICIENT_LOADING" in os.environ
    if not (several and fsdp) or os.environ.get("FSDP_VERSION") == "1":
        return None  # FSDP1 broadcasts rank 0's whole model (sync_module_states): left as it is
    if not (torch.accelerator.is_available() or switch(FSDP_ON_CPU, False)):
        return None  # accelerate trains DDP here, which needs the whole model on every rank
    if not switch("FSDP_CPU_RAM_EFFICIENT_LOADING", False):
        raise ShardedLoadingError(
            "from_pretrained under FSDP2 with cpu_ram_efficient_loading off loads the whole model on every rank; set "
            "fsdp_cpu_ram_efficient_loading: true in the accelerate config's fsdp_config (HF Trainer: --fsdp_config "
            "'{\"cpu_ram_efficient_loading\": true}'), and each rank reads only its shard (or set "
            "PYVENE_DIST_SHARDED_LOADING=0 to load it whole anyway)")
    return "fsdp2"


def _wrap_load_pretrained_model(wrapped, instance, args, kwargs):
    call = bound(wrapped, args, kwargs).arguments
    model, files, config = call["model"], call["checkpoint_files"], call["load_config"]
    if not OPTIONS.current.sharded_loading:
        return wrapped(*args, **kwargs)
    how = launch_shards()
    if how is None:
        return wrapped(*args, **kwargs)
    why = _cannot_read_in_parts(call, how)
    names, checkpoint, quantized = {}, None, {}
    if why is None and getattr(config, "hf_quantizer", None) is not None:
        quantized, why = quantized_weights(model, config.dtype)
    if why is None:
        checkpoint = CheckpointFiles(files)
        names, unpaired = checkpoint_names(model, checkpoint)
        if unpaired:
            why = (f"the safetensors hold no tensor of the model's name and shape for {len(unpaired)} of its tensors "
                   f"(the first {unpaired[0]!r})")
    if why is not None:
        if checkpoint is not None:
            checkpoint.close()
        warnings.warn(f"pyvene_dist: {type(model).__name__} is loaded whole on every rank of this {how} launch: {why}",
                      WholeLoadWarning, stacklevel=3)
        return wrapped(*args, **kwargs)
    loading_info, rest = wrapped(model, {}, files, config, call["expected_keys"])  # reads nothing
    pack_on_meta(model, quantized)
    tensors = named_tensors(model)
    loading_info.missing_keys.difference_update(names)
    for name in names:  # transformers' initialization skips them (under ZeRO-3 it would gather them whole)
        tensors[name]._is_hf_initialized = True
    state = MODELS.of(model, ShardedLoad)
    state.files, state.names, state.how, state.quantized = checkpoint, names, how, quantized
    if how == "zero3":
        _fill(model, state)
    return loading_info, rest


def _cannot_read_in_parts(call: dict, how: str) -> str | None:
    config = call["load_config"]
    if call["state_dict"] is not None:
        return "it was given a state_dict"
    files = call["checkpoint_files"] or []
    if not files or not all(str(file).endswith(".safetensors") for file in files):
        return "its weights are not safetensors (save the folder with save_pretrained())"
    quantizer = getattr(config, "hf_quantizer", None)
    if quantizer is not None:
        if not getattr(quantizer.quantization_config, "load_in_4bit", False):
            return "it is quantized other than by bitsandbytes in 4 bits, which each rank quantizes whole"
        if how != "fsdp2":
            return "a 4-bit base is read in parts under FSDP2 only (under ZeRO-3 each rank quantizes it whole)"
    if len(set((getattr(config, "device_map", None) or {}).values())) > 1:  # one device: no split
        return "a device_map places it (each device then reads its own layers: docs/loading.md)"
    return None


def _fill(module: nn.Module, state: ShardedLoad) -> None:
    state.filled = fill(module, state.files, state.names, state.quantized)
    state.bytes_read = state.files.bytes_read
    state.files.close()
    whole = whole_bytes(module)
    rank = dist.get_rank() if dist.is_initialized() else 0
    log.info(f"rank {rank} read {state.bytes_read / 2**20:.1f} MiB of {type(module).__name__}'s "
             f"{whole / 2**20:.1f} MiB ({state.how})", extra={"bytes_read": state.bytes_read, "whole_bytes": whole})


def _fill_after_fully_shard(current):
    """An entry around ``fully_shard`` (and ``fixes.fsdp``'s wrap of it): once every tensor of a model waiting for
    its sharded load is a shard, give it storage on the mesh's device (or the CPU, under a CPU offload policy) and
    read each rank's shards."""

    def fully_shard(*args, **kwargs):
        sharded = current(*args, **kwargs)
        modules = args[0] if args else kwargs.get("module")
        for module in modules if isinstance(modules, (list, tuple)) else [modules]:
            for inner in module.modules():
                state = MODELS.get(inner, ShardedLoad)
                if state is not None and state.pending and _all_sharded(inner):
                    materialize(inner, _shard_device(inner, kwargs.get("offload_policy")))
                    _fill(inner, state)
        return sharded

    return fully_shard


def _all_sharded(module: nn.Module) -> bool:
    return all(hasattr(tensor, "device_mesh") for tensor in dict(module.named_parameters()).values())


def _shard_device(module: nn.Module, offload_policy) -> torch.device:
    mesh = next(tensor.device_mesh for tensor in module.parameters())
    if mesh.device_type == "cpu" or type(offload_policy).__name__ == "CPUOffloadPolicy":
        return torch.device("cpu")
    return torch.device(mesh.device_type, torch.get_device_module(mesh.device_type).current_device())


def _wrap_fsdp2_load_full_state_dict(wrapped, instance, args, kwargs):
    call = bound(wrapped, args, kwargs).arguments
    accelerator, model = call["accelerator"], call["model"]
    loads = {name: MODELS.get(module, ShardedLoad) for name, module in model.named_modules()}
    loads = {name: state for name, state in loads.items() if state is not None and state.files is not None}
    if not loads and not intervenable_models(model):
        return wrapped(*args, **kwargs)
    device = torch.device("cpu") if call["cpu_offload"] else accelerator.device
    filled = set()
    for prefix, state in loads.items():
        module = model.get_submodule(prefix)
        if state.pending:  # fully_shard left some of it unsharded (ignored): read those whole
            materialize(module, device)
            _fill(module, state)
        aliases = {id(tensor): [] for tensor in named_tensors(module).values()}
        for name, tensor in named_tensors(module).items():
            aliases[id(tensor)].append(name)
        filled.update(f"{prefix}.{alias}" if prefix else alias for name in state.names
                      for alias in aliases[id(named_tensors(module)[name])])
    broadcast_in_place(model, call["full_sd"], skip=filled, device=device, main=accelerator.is_main_process)
    return None


def _keep_interventions_off_meta(current):
    """An entry around ``BaseModel.set_device`` (and ``device_map``'s wrap of it)."""

    def set_device(self, device, set_model=True):
        if torch.device(device).type == "meta" and _waits_for_its_load(self.model):
            return None  # the base is on the meta device until it is sharded; the interventions keep their weights
        return current.__get__(self, type(self))(device, set_model)  # as the class binds it: a wrap sees its instance

    return set_device


def _waits_for_its_load(model: nn.Module) -> bool:
    return any((state := MODELS.get(module, ShardedLoad)) is not None and state.pending for module in model.modules())


FIX = Fix(
    __name__,
    sites=(
        Site((PreTrainedModel, "_load_pretrained_model"), _wrap_load_pretrained_model),
        Site((fully_shard_module, "fully_shard"), _fill_after_fully_shard, kind="entry",
             reexported_in=(fully_shard_package, fsdp_package)),
        Site("accelerate.utils.fsdp_utils:fsdp2_load_full_state_dict", _wrap_fsdp2_load_full_state_dict),
        Site((BaseModel, "set_device"), _keep_interventions_off_meta, kind="entry"),
    ),
    # fsdp: its wrap of fully_shard places the interventions and hooks their gradients first; device_map: its wrap of
    # set_device is inside this entry.
    after=("fsdp", "device_map"),
    options=(SHARDED_LOADING,),
    state=ShardedLoad,
)
