"""accelerate's ``fsdp2_load_full_state_dict`` for what no checkpoint file holds, into the model's own tensors.

accelerate broadcasts every tensor of the state dict from rank 0 and hands the model new parameters
(``load_state_dict(assign=True)``). After a sharded load, the base's shards are read already and rank 0 holds none of
them whole; what is left (a pyvene model's interventions, a trainable head built in the script) is broadcast here
and copied into the tensors the model holds, so that the hooks on them stay (``fixes.fsdp`` averages each
intervention's gradient through a hook on the parameter itself).

A tensor with no storage gets a new one, as accelerate gives it: accelerate moves the whole model to the meta device
before ``fully_shard``, so where nothing was read in parts (a world of one process loads whole) every shard of the
base is still on the meta device here, and copying into it would leave it there (FSDP2's first forward then fails:
"FSDP parameters should be materialized from meta device before training").
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor


def broadcast_in_place(model: nn.Module, full_state: dict, *, skip: set[str], device: torch.device,
                       main: bool) -> list[str]:
    """Broadcast each tensor of ``model.state_dict()`` that ``skip`` does not name from rank 0 (``main``), where
    ``full_state`` holds it whole, and copy it into the model's tensor: a ``DTensor`` its local shard, any other
    tensor all of it (storage on ``device`` where it had none). Returns the names broadcast."""
    done = []
    for name, tensor in model.state_dict(keep_vars=True).items():
        if name in skip:
            continue
        if main:
            whole = _storage_of(full_state[name].detach()).to(device=device, dtype=tensor.dtype).contiguous()
        else:
            whole = torch.empty(tuple(tensor.shape), device=device, dtype=tensor.dtype)
        dist.broadcast(whole, src=0)
        if isinstance(tensor, DTensor):
            whole = distribute_tensor(whole, tensor.device_mesh, tensor.placements)
        with torch.no_grad():
            if _storage_of(tensor).device.type == "meta":  # no storage: a new tensor, as accelerate gives one
                _replace(model, name, tensor, whole)
            else:
                _storage_of(tensor).copy_(_storage_of(whole))
        done.append(name)
    return done


def _storage_of(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _replace(model: nn.Module, name: str, old: torch.Tensor, value: torch.Tensor) -> None:
    """Put ``value`` in place of ``old`` through ``load_state_dict(assign=True)``, as accelerate does: FSDP2's hook on
    it then takes the new sharded parameter for its own (``FSDPParam.reset_sharded_param``)."""
    owner, _, leaf = name.rpartition(".")
    value = nn.Parameter(value.clone(), requires_grad=old.requires_grad) if isinstance(old, nn.Parameter) else (
        value.clone())
    model.get_submodule(owner).load_state_dict({leaf: value}, strict=False, assign=True)
