"""The runners on a device mesh: tensor parallel over every rank (``from_pretrained(tp_plan=...)`` or by hand),
TP inside FSDP2, and HSDP."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from ..fully_shard import fully_shard_model
from . import models
from .runners import DDP


class TensorParallel(DDP):
    """Tensor parallel over every rank: the base model loaded with ``from_pretrained(tp_plan="auto")`` on a
    1-D mesh (``by_hand``: torch's ``parallelize_module`` with the model's ``base_model_tp_plan``). Every
    rank sees the whole batch; the interventions are whole on every rank."""

    name = "tp"
    #: The mesh dimensions, outermost first; the last is ``tp``, the others split the data.
    dims: tuple[str, ...] = ("tp",)

    def __init__(self, device: str | torch.device | None = None, *, by_hand: bool = False, shape=None):
        super().__init__(device)
        shape = shape or (self._world_size(),)
        if math.prod(shape) != self._world_size():
            raise ValueError(f"strategy {self.name!r} needs a world size of {math.prod(shape)} {self.dims}, "
                             f"got {self._world_size()}")
        self.by_hand = by_hand
        if by_hand:
            self.name += "-by-hand"
        self.mesh = init_device_mesh(self.device.type, tuple(shape), mesh_dim_names=self.dims)

    @staticmethod
    def _world_size() -> int:
        return dist.get_world_size()

    @property
    def data_dims(self) -> tuple[str, ...]:
        return tuple(name for name in self.dims if name != "tp")

    @property
    def world_size(self) -> int:  # the ranks the batch is split over
        return math.prod(self.mesh[name].size() for name in self.data_dims)

    @property
    def rank(self) -> int:
        rank = 0
        for name in self.data_dims:
            rank = rank * self.mesh[name].size() + self.mesh[name].get_local_rank()
        return rank

    @property
    def devices(self) -> int:
        return self._world_size()

    def build(self, case):
        if "tp" not in self.dims:
            return case.build()
        base = case.base_model()
        if self.by_hand:
            return case.reft_model(parallelize_by_hand(base, self.mesh["tp"]))
        return case.reft_model(models.reload_pretrained(base, dtype=base.dtype, tp_plan="auto", device_mesh=self.mesh["tp"]))

    def wrap(self, model):
        return model

    def mean(self, value):
        # Every rank of a TP group holds its data-parallel group's loss: the mean over all ranks is theirs.
        value = value.detach().clone()
        dist.all_reduce(value)
        return value.item() / self.devices


class TensorParallelFSDP2(TensorParallel):
    """2-D: tensor parallel (torch's ``parallelize_module``) inside each ``tp`` group of 2, FSDP2 over the
    ``dp_shard`` dimension. By hand, because transformers 5.24's ``from_pretrained(tp_plan=...)`` builds its
    own mesh over the whole world and ignores ``device_mesh``, so FSDP2 cannot share its TP mesh's root."""

    name = "tp-fsdp2"
    dims = ("dp_shard", "tp")

    def __init__(self, device=None):
        super().__init__(device, by_hand=True, shape=(self._world_size() // 2, 2))
        self.name = "tp-fsdp2"

    def wrap(self, model):
        return fully_shard_model(model, mesh=self.mesh["dp_shard"])


class HSDP(TensorParallel):
    """FSDP2 replicated over ``dp_replicate`` and sharded over ``dp_shard`` (a 2-D mesh, no tensor parallel)."""

    name = "hsdp"
    dims = ("dp_replicate", "dp_shard")

    def __init__(self, device=None):
        super().__init__(device, shape=(self._world_size() // 2, 2))

    def wrap(self, model):
        return fully_shard_model(model, mesh=self.mesh)


def parallelize_by_hand(base: nn.Module, tp_mesh) -> nn.Module:
    """torch's ``parallelize_module`` over ``tp_mesh``, with the styles the model's ``base_model_tp_plan`` names
    (``colwise``, ``rowwise``): what a user who does not load through ``from_pretrained`` writes."""
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan = getattr(base.config, "base_model_tp_plan", None) or {}
    prefix = base.base_model_prefix
    unknown = sorted({style for style in plan.values() if style not in styles})
    if not plan or unknown:
        raise ValueError(f"{type(base).__name__}'s base_model_tp_plan {plan!r} has no plan of only {sorted(styles)}")
    parallelize_module(base, tp_mesh, {f"{prefix}.{name}": styles[style]() for name, style in plan.items()})
    return base
