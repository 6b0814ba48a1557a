"""accelerate's ``fsdp2_load_full_state_dict`` for what no checkpoint file holds, into the model's own tensors.

accelerate broadcasts every tensor of the state dict from rank 0 and hands the model new parameters
(``load_state_dict(assign=True)``). After a sharded load, the base's shards are read already and rank 0 holds none of
them whole; what is left (a pyvene model's interventions, a trainable head built in the script) is broadcast here
and copied into the tensors the model holds, so that the hooks on them stay (``fixes.fsdp`` averages each
intervention's gradient through a hook on the parameter itself).
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
            whole = full_state[name].detach()
            whole = whole.to_local() if isinstance(whole, DTensor) else whole
            whole = whole.to(device=device, dtype=tensor.dtype).contiguous()
        else:
            whole = torch.empty(tuple(tensor.shape), device=device, dtype=tensor.dtype)
        dist.broadcast(whole, src=0)
        with torch.no_grad():
            if isinstance(tensor, DTensor):
                tensor.to_local().copy_(distribute_tensor(whole, tensor.device_mesh, tensor.placements).to_local())
            elif tensor.device.type == "meta":  # nothing gave it storage: a new tensor, as accelerate gives one
                _replace(model, name, tensor, whole)
            else:
                tensor.copy_(whole)
        done.append(name)
    return done


def _replace(model: nn.Module, name: str, old: torch.Tensor, value: torch.Tensor) -> None:
    owner, _, leaf = name.rpartition(".")
    module = model.get_submodule(owner)
    if isinstance(old, nn.Parameter):
        module._parameters[leaf] = nn.Parameter(value.clone(), requires_grad=old.requires_grad)
    else:
        module._buffers[leaf] = value.clone()
