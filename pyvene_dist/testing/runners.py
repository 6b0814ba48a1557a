"""The parallel strategies as runners: how a run builds, places and wraps the model, shards each global
micro-batch, steps backward and the optimizer, and averages the loss over ranks (``training.train`` drives
them). Tensor parallel and the 2-D meshes are in ``mesh_runners``; the registry of names in ``strategies``."""

from __future__ import annotations

import os
import tempfile
from typing import TYPE_CHECKING, Sequence

import torch
import torch.distributed as dist
import transformers
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from ..fully_shard import fully_shard_model, layer_classes
from ..loading import has_safetensors, report, sharded
from .._optional import ACCELERATE_INSTALL, DEEPSPEED_INSTALL, OnFirstUse
from ..optim import param_groups

# Optional (requirements.py skips their strategies): imported by those strategies alone.
deepspeed = OnFirstUse("deepspeed", DEEPSPEED_INSTALL)
accelerate = OnFirstUse("accelerate", ACCELERATE_INSTALL)

if TYPE_CHECKING:
    from .case import ParityCase


class Strategy:
    """How a run is parallelised. ``single`` is the reference: one process, one device, whole batch."""

    name = "single"

    def __init__(self, device: str | torch.device | None = None):
        self.device = torch.device(device) if device is not None else _default_device()

    @property
    def world_size(self) -> int:
        return 1

    @property
    def rank(self) -> int:
        return 0

    @property
    def devices(self) -> int:
        """How many devices the run spans (the record's ``world_size``)."""
        return self.world_size

    def build(self, case: "ParityCase") -> nn.Module:
        """The ReFT model to train (a strategy that loads its base model a special way overrides this)."""
        return case.build()

    def place(self, model: nn.Module) -> nn.Module:
        """The built model on this strategy's device (a model split over devices stays where it is)."""
        return model.to(self.device)

    def reset_peak_memory(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak_memory(self) -> int:
        """Bytes of CUDA memory allocated at most since ``reset_peak_memory`` (0 off CUDA)."""
        return torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else 0

    def wrap(self, model: nn.Module) -> nn.Module:
        return model

    def prepare(self, model: nn.Module, optimizer: torch.optim.Optimizer, case: "ParityCase"):
        """The callable to train and the optimizer to step (an engine may replace both)."""
        return self.wrap(model), optimizer

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def micro_step(self, optimizer) -> None:
        """After the backward of a micro-batch that is not the step's last (an engine counts them)."""

    def step(self, optimizer, model: nn.Module) -> None:
        """The optimizer step, then ``model.zero_grad()`` on the model trained, as HF Trainer clears."""
        optimizer.step()
        model.zero_grad()

    def shard(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        size = batch["input_ids"].shape[0]
        if size % self.world_size:
            raise ValueError(f"batch_size {size} does not split evenly over {self.world_size} ranks")
        share = size // self.world_size
        start = self.rank * share
        sharded = {
            "input_ids": batch["input_ids"][start : start + share],
            "attention_mask": batch["attention_mask"][start : start + share],
            "labels": batch["labels"][start : start + share],
            "locations": batch["locations"][:, start : start + share],
        }
        if "heads" in batch:
            sharded["heads"] = batch["heads"][:, start : start + share]
        return sharded

    def mean(self, value: torch.Tensor) -> float:
        return value.item()


class DDP(Strategy):
    """``torch.nn.parallel.DistributedDataParallel`` over the initialised default process group."""

    name = "ddp"

    def __init__(self, device: str | torch.device | None = None):
        if not dist.is_initialized():
            raise RuntimeError("strategy 'ddp' needs an initialised torch.distributed process group")
        super().__init__(device)

    @property
    def world_size(self) -> int:
        return dist.get_world_size()

    @property
    def rank(self) -> int:
        return dist.get_rank()

    def wrap(self, model: nn.Module) -> nn.Module:
        device_ids = [self.device] if self.device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(model, device_ids=device_ids)

    def mean(self, value: torch.Tensor) -> float:
        value = value.detach().clone()
        dist.all_reduce(value)
        return value.item() / self.world_size


class FSDP2(DDP):
    """``fully_shard`` on every decoder layer and on the whole model (``pyvene_dist.fully_shard.fully_shard_model``).
    A model folder of safetensors is loaded sharded (``pyvene_dist.loading.sharded``): on the meta device, each rank
    reading its shards when ``fully_shard`` has run."""

    name = "fsdp2"

    def build(self, case):
        if not reads_in_parts(case, quantized=("4bit",)):
            return case.build()
        with sharded():
            return case.build()

    def place(self, model):
        load = report(model)
        return model if load is not None and load.pending else super().place(model)  # fully_shard places it

    def prepare(self, model, optimizer, case):
        # fully_shard replaces the base model's parameters with sharded ones (a trainable head's too): the
        # optimizer is made again over them, with the same settings.
        wrapped = self.wrap(model)
        return wrapped, torch.optim.AdamW(param_groups(model, case.weight_decay), lr=case.lr)  # as train() makes it

    def wrap(self, model: nn.Module) -> nn.Module:
        return fully_shard_model(model)


class FSDP1(DDP):
    """``FullyShardedDataParallel`` (FSDP1) with one unit per decoder layer; needs one GPU per rank."""

    name = "fsdp1"

    def wrap(self, model: nn.Module) -> nn.Module:
        names = layer_classes(model)
        classes = {type(module) for module in model.modules() if type(module).__name__ in names}
        return FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy(classes), device_id=self.device)


class DeepSpeed(DDP):
    """``deepspeed.initialize`` with ZeRO ``stage``; ``offload`` ("cpu", or True, or "nvme") moves the optimizer
    state and, at stage 3, the parameters to host memory or to swap files under ``nvme_path`` (a fresh
    temporary folder per process when None; NVMe needs DeepSpeed's async_io op, hence libaio).

    Every parameter is partitioned (``stage3_param_persistence_threshold: 0``), the interventions too.
    ``zero`` entries are merged into ``zero_optimization`` (memory knobs such as
    ``stage3_max_live_parameters``; a section such as ``offload_param`` is merged key by key).
    Gradients and weights are read whole by ``intervention_grads``/``intervention_weights``.
    """

    def __init__(self, stage: int, offload: bool | str = False, device: str | torch.device | None = None,
                 zero: dict | None = None, nvme_path: str | None = None):
        super().__init__(device)
        offload = "cpu" if offload is True else offload or None
        if offload not in (None, "cpu", "nvme"):
            raise ValueError(f"offload must be 'cpu', 'nvme', True or False, got {offload!r}")
        self.stage, self.offload, self.zero, self.nvme_path = stage, offload, dict(zero or {}), nvme_path
        self.name = f"zero{stage}" + {None: "", "cpu": "-offload", "nvme": "-nvme"}[offload]
        self.engine = None

    def build(self, case):
        """A model folder of safetensors under ZeRO-3 is built partitioned (transformers' ``zero.Init``, as under
        HF Trainer), each rank copying its partitions from the files (``pyvene_dist.loading``)."""
        if self.stage != 3 or self.offload == "nvme" or not reads_in_parts(case):
            return case.build()
        config = self.engine_config(case)
        # from_pretrained builds under zero.Init while it lives (transformers' integrations: imported on first use)
        held = transformers.integrations.HfDeepSpeedConfig(config)
        try:
            return case.build()
        finally:
            del held
            transformers.integrations.unset_hf_deepspeed_config()

    def config(self, batch_size: int, accumulation: int = 1) -> dict:
        zero: dict = {"stage": self.stage}
        if self.stage == 3:
            zero["stage3_param_persistence_threshold"] = 0
        if self.offload == "cpu":
            zero["offload_optimizer"] = {"device": "cpu"}
            if self.stage == 3:
                zero["offload_param"] = {"device": "cpu"}
        elif self.offload == "nvme":
            if self.nvme_path is None:
                self.nvme_path = tempfile.mkdtemp(prefix="pyvene-dist-nvme-")
            swap = {"device": "nvme", "nvme_path": self.nvme_path}
            zero["offload_optimizer"] = dict(swap)
            if self.stage == 3:
                # Every gathered parameter holds a swap buffer, as large as the largest partition, until it is
                # released. DeepSpeed's defaults keep parameters the backward will use again (reuse distance
                # and live parameters 1e9 elements), and a frozen model's backward then runs out of buffers
                # ("Not enough buffers 0 for swapping 1"); release them at once instead. Prefetching
                # asserts on a buffer already assigned. Larger models set sizes through ``zero``.
                zero["offload_param"] = {**swap, "buffer_count": 16, "buffer_size": 2**22}
                zero.update(stage3_prefetch_bucket_size=0, stage3_max_reuse_distance=0,
                            stage3_max_live_parameters=10**6)
        for key, value in self.zero.items():  # a section given in part keeps the rest (nvme_path, say)
            both = isinstance(value, dict) and isinstance(zero.get(key), dict)
            zero[key] = {**zero[key], **value} if both else value
        return {
            "train_micro_batch_size_per_gpu": batch_size // self.world_size,
            "gradient_accumulation_steps": accumulation,
            "zero_optimization": zero,
            "zero_allow_untested_optimizer": True,
            "zero_force_ds_cpu_optimizer": False,  # the same torch AdamW as the reference
        }

    def engine_config(self, case, model: nn.Module | None = None) -> dict:
        config = self.config(case.batch_size, case.accumulation)
        if case.torch_dtype == torch.bfloat16:
            config["bf16"] = {"enabled": True}  # DeepSpeed's bf16: bf16 weights, fp32 master copies to step
        if self.stage == 3 and model is not None and self.offload != "nvme":
            config["zero_optimization"] = {**_live_layers(model), **config["zero_optimization"]}
        return config

    def prepare(self, model, optimizer, case):
        config = self.engine_config(case, model)
        if self.offload == "nvme" and self.stage == 3:
            # What the engine would do, but with the dtype read from the config: the engine passes the model's
            # dtype, which Init's `dtype or float16 if fp16 else bfloat16 ...` drops on an accelerator without
            # float16 (the CPU one), so fp32 weights came back from their swap files as bf16.
            deepspeed.zero.Init(module=model, config_dict_or_path=config)
        self.engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        return self.engine, optimizer

    def backward(self, loss):
        self.engine.backward(loss, scale_wrt_gas=False)  # the loss is normalised by the step's labels already

    def micro_step(self, optimizer):
        self.engine.step()  # not a boundary: the engine counts the micro-batch and keeps the gradients

    def step(self, optimizer, model):
        self.engine.step()  # the boundary: the optimizer steps and the engine clears every gradient


class DataParallel(Strategy):
    """``torch.nn.DataParallel`` over every visible GPU, in one process: it splits the whole batch itself."""

    name = "dataparallel"

    def __init__(self, device: str | torch.device | None = None):
        super().__init__(device or "cuda:0")

    @property
    def devices(self) -> int:
        return torch.cuda.device_count()

    def wrap(self, model: nn.Module) -> nn.Module:
        return nn.DataParallel(model)


class Accelerate(DDP):
    """accelerate's ``Accelerator`` over the initialised process group: ``prepare(model, optimizer)`` (DDP
    across processes) and ``accelerator.backward``; each rank trains its share of the batch, as under DDP.
    (``hf.train_with_accelerate`` is the other way round, a user's script: accelerate's data loader shards.)"""

    name = "accelerate"

    def __init__(self, device: str | torch.device | None = None, accelerator=None):
        super().__init__(device)
        self.accelerator = accelerator

    def prepare(self, model, optimizer, case):
        self.accelerator = self.accelerator or accelerate.Accelerator(cpu=self.device.type == "cpu")
        return self.accelerator.prepare(model, optimizer)

    def backward(self, loss):
        self.accelerator.backward(loss)


class DeviceMap(Strategy):
    """One process, the base model's decoder layers split over ``devices`` (default: every visible GPU;
    ``["cpu", "cpu"]`` tries it without GPUs) by ``accelerate.dispatch_model``, as ``from_pretrained(...,
    device_map=...)`` splits a model (``split_map``); whole batches. The peak is the largest GPU's."""

    name = "device_map"

    def __init__(self, device: str | torch.device | None = None, devices=None):
        self.split = list(devices) if devices is not None else list(range(torch.cuda.device_count()))
        if not self.split:
            raise ValueError("strategy 'device_map' needs devices to split over: found no GPU; pass devices=")
        first = self.split[0]
        super().__init__(device or (torch.device("cuda", first) if isinstance(first, int) else torch.device(first)))

    @property
    def devices(self) -> int:
        return len(self.split)

    def build(self, case):
        base = case.base_model()
        return case.reft_model(accelerate.dispatch_model(base, split_map(base, self.split), main_device=self.device))

    def place(self, model):
        return model  # each layer is on its device already

    def _gpus(self) -> list[int]:
        return sorted({device for device in self.split if isinstance(device, int)})

    def reset_peak_memory(self) -> None:
        for gpu in self._gpus():
            torch.cuda.reset_peak_memory_stats(gpu)

    def peak_memory(self) -> int:
        return max((torch.cuda.max_memory_allocated(gpu) for gpu in self._gpus()), default=0)

def split_map(model: nn.Module, devices: Sequence[str | int]) -> dict[str, str | int]:
    """A ``device_map`` putting the decoder layers on ``devices`` in contiguous, even groups (the first
    layers on ``devices[0]``) and every other module (embeddings, norm, head) on ``devices[0]``."""
    classes = layer_classes(model)
    layers = [name for name, module in model.named_modules() if type(module).__name__ in classes]
    if len(layers) < len(devices):
        raise ValueError(f"{type(model).__name__} has {len(layers)} decoder layers ({sorted(classes)}), "
                         f"too few to split over {len(devices)} devices")
    owner = {name: devices[index * len(devices) // len(layers)] for index, name in enumerate(layers)}
    device_map: dict[str, str | int] = {}

    def place(prefix: str, module: nn.Module) -> None:
        if prefix in owner:
            device_map[prefix] = owner[prefix]
        elif prefix and not any(name.startswith(prefix + ".") for name in owner):
            device_map[prefix] = devices[0]
        else:
            for name, child in module.named_children():
                place(f"{prefix}.{name}" if prefix else name, child)

    place("", model)
    return device_map

def _live_layers(model: nn.Module) -> dict:
    """ZeRO-3's memory knobs for about two decoder layers gathered at once, as docs/configs/deepspeed-zero3.json bounds
    them for its models: DeepSpeed's defaults (10**9 elements live, reused within 10**9) keep every gathered
    parameter of a model under 4 GB of float32 until the step ends, the whole base on every rank."""
    classes = layer_classes(model)
    layers = [module for module in model.modules() if type(module).__name__ in classes]
    sizes = [sum(getattr(p, "ds_numel", None) or p.numel() for p in layer.parameters()) for layer in layers]
    if not sizes:
        return {}
    return {"stage3_max_live_parameters": 2 * max(sizes), "stage3_max_reuse_distance": 0,
            "stage3_prefetch_bucket_size": max(sizes)}


def reads_in_parts(case, quantized: tuple[str, ...] = ()) -> bool:
    """Whether ``case`` loads a model folder of safetensors that a sharded load reads in parts: plain, or quantized
    as ``quantized`` names (FSDP2 reads a 4-bit base in parts; ZeRO-3 quantizes it whole on every rank)."""
    folder = getattr(case, "model", None)
    return (getattr(case, "local", False) and getattr(case, "quantize", None) in (None, *quantized)
            and has_safetensors(folder))


def _default_device() -> torch.device:
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")
