"""Fill a sharded model's parameters from its checkpoint files, each rank its own part only.

What a rank holds of each parameter says what it reads:

- an FSDP2 (or tensor-parallel) ``DTensor``: its local shard, a block of the whole tensor at the offsets
  ``compute_local_shape_and_global_offset`` gives for its mesh and placements (FSDP2: whole rows of dimension 0);
- a DeepSpeed ZeRO-3 parameter: its partition ``ds_tensor``, elements ``rank * size`` to ``(rank + 1) * size`` of the
  flattened tensor (the last partition padded);
- a plain tensor (a buffer, a parameter nothing shards): all of it.

``checkpoint_names`` first pairs every parameter and persistent buffer of the module with its tensor in the files
(a tied parameter, such as a head that shares the embedding, is read once under the name the files hold), and says
what it cannot pair, so that a caller can refuse before anything is built.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from .checkpoint_files import CheckpointFiles
from .four_bit import exchange_scales, quant_state, quantize_local_part


class ShardedLoadingError(RuntimeError):
    """A sharded load cannot go on: the checkpoint does not hold the model's tensors, or a rank's part is missing."""


@dataclasses.dataclass
class Filled:
    """What one fill put into this rank: tensors, their elements, and the bytes of the parts it holds."""

    tensors: int = 0
    elements: int = 0
    bytes_held: int = 0


def named_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and persistent buffer of ``module`` by every name it has (a tied parameter twice)."""
    found = dict(nn.Module.named_parameters(module, remove_duplicate=False))
    persistent = module.state_dict(keep_vars=True).keys()
    found.update((name, buffer) for name, buffer in module.named_buffers(remove_duplicate=False) if name in persistent)
    return found


def checkpoint_names(module: nn.Module, files: CheckpointFiles) -> tuple[dict[str, str], list[str]]:
    """``(names, unpaired)``: one name per tensor object of ``module`` -> its key in ``files`` (a key missing from
    them is tried with ``module.base_model_prefix`` added or taken off), and the names of tensors no key holds with
    the tensor's shape."""
    prefix = getattr(module, "base_model_prefix", "") or ""
    by_object: dict[int, list[str]] = {}
    tensors = named_tensors(module)
    for name, tensor in tensors.items():
        by_object.setdefault(id(tensor), []).append(name)
    names, unpaired = {}, []
    for aliases in by_object.values():
        shape = full_shape(tensors[aliases[0]])
        key = next((key for name in aliases for key in _candidates(name, prefix)
                    if key in files and files.shape(key) == shape), None)
        if key is None:
            unpaired.append(aliases[0])
        else:
            names[aliases[0]] = key
    return names, unpaired


def full_shape(tensor: torch.Tensor) -> tuple[int, ...]:
    """The shape of the whole tensor: a ZeRO-3 parameter's own shape is that of its empty placeholder."""
    return tuple(getattr(tensor, "ds_shape", None) or tensor.shape)


def _candidates(name: str, prefix: str) -> list[str]:
    keys = [name]
    if prefix:
        keys += [name.removeprefix(prefix + ".")] if name.startswith(prefix + ".") else [f"{prefix}.{name}"]
    return keys


def fill(module: nn.Module, files: CheckpointFiles, names: dict[str, str], quantized: dict | None = None) -> Filled:
    """Copy each of ``names``' tensors' local part (see the module's docstring) from ``files`` into it; a 4-bit
    weight named in ``quantized`` is quantized from its part of the files (``loading.four_bit``), and its layer
    given the whole weight's quantization state. Every tensor must be materialized (not on the meta device)."""
    tensors = named_tensors(module)
    quantized = quantized or {}
    filled, scales, group = Filled(), {}, None
    with torch.no_grad():
        for name, key in names.items():
            tensor = tensors[name]
            if name in quantized:
                local, data, scales[name], group = _quantized_part(tensor, key, files, quantized[name])
            else:
                local, data = _local_part(name, tensor, key, files)
            if local is None:
                continue
            local.copy_(data)
            filled.tensors += 1
            filled.elements += local.numel()
            filled.bytes_held += local.numel() * local.element_size()
    if quantized:
        for name, absmax in exchange_scales(scales, group).items():
            record = quantized[name]
            layer = module.get_submodule(record.module)
            layer.quant_state = quant_state(record, absmax, _local_device(tensors[name]))
    return filled


def _quantized_part(tensor: torch.Tensor, key: str, files: CheckpointFiles, record):
    """(this rank's rows of a packed 4-bit weight, those rows quantized from the files, the scales of the blocks
    that start in them, the process group the rows are split over)."""
    group, first, local = None, 0, tensor
    if _is_dtensor(tensor):
        local = tensor.to_local()
        _, offsets = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
        first, group = offsets[0], tensor.device_mesh.get_group(0)
    packed, scales = quantize_local_part(files, key, record, first, local.shape[0], local.device)
    return (local if local.numel() else None), packed, scales, group


def _local_device(tensor: torch.Tensor) -> torch.device:
    return tensor.to_local().device if _is_dtensor(tensor) else tensor.device


def _local_part(name: str, tensor: torch.Tensor, key: str, files: CheckpointFiles):
    """(this rank's part of ``tensor``, that part read from ``files``); (None, None) where the rank holds none."""
    if hasattr(tensor, "ds_tensor"):  # ZeRO-3: a flat partition
        group = getattr(tensor, "ds_process_group", None)
        size = tensor.ds_tensor.ds_numel
        start = size * dist.get_rank(group=group)
        stop = min(start + size, tensor.ds_numel)
        if stop <= start:
            return None, None
        return tensor.ds_tensor.data[: stop - start], files.elements(key, start, stop)
    if _is_dtensor(tensor):
        local = tensor.to_local()
        if local.numel() == 0:
            return None, None
        shape, offsets = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
        if tuple(shape) != tuple(local.shape):
            raise ShardedLoadingError(f"{name}: its local shard has shape {tuple(local.shape)}, and its placements "
                                      f"{tensor.placements} over its mesh give {tuple(shape)}")
        return local, files.block(key, offsets, shape)
    if tensor.device.type == "meta":
        raise ShardedLoadingError(f"{name} is still on the meta device: materialize the model (to_empty) first")
    return tensor.data, files.block(key, (0,) * tensor.dim(), tuple(tensor.shape))


def _is_dtensor(tensor: torch.Tensor) -> bool:
    return type(tensor).__name__ == "DTensor" or hasattr(tensor, "device_mesh") and hasattr(tensor, "placements")


def materialize(module: nn.Module, device: torch.device) -> None:
    """Give every tensor of ``module`` on the meta device storage on ``device`` (``to_empty``, which FSDP2 takes
    for its sharded parameters), keeping the values of those that had them (buffers such as a rotary embedding's
    frequencies, a parameter already loaded)."""
    kept = {name: tensor.detach().clone() for name, tensor in _all_tensors(module).items()
            if tensor.device.type != "meta" and not _is_dtensor(tensor)}
    module.to_empty(device=device)
    now = _all_tensors(module)
    with torch.no_grad():
        for name, value in kept.items():
            now[name].copy_(value)


def _all_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(module.named_parameters()), **dict(module.named_buffers())}


def local_bytes(module: nn.Module) -> int:
    """Bytes of parameters and buffers this rank holds of ``module``: a shard or partition counts its local part, a
    tensor on the meta device nothing."""
    total = 0
    for tensor in {id(t): t for t in _all_tensors(module).values()}.values():
        if hasattr(tensor, "ds_tensor"):
            tensor = tensor.ds_tensor
        elif _is_dtensor(tensor):
            tensor = tensor.to_local()
        if tensor.device.type != "meta":
            total += tensor.numel() * tensor.element_size()
    return total


def whole_bytes(module: nn.Module) -> int:
    """Bytes of every parameter and buffer of ``module`` whole (a shard or partition counts its full tensor)."""
    total = 0
    for tensor in {id(t): t for t in _all_tensors(module).values()}.values():
        numel = math.prod(full_shape(tensor))
        total += numel * tensor.element_size()
    return total
