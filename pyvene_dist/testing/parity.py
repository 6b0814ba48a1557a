"""The parity harness: train the same ReFT model on the same data with the same seed on one device and
under a parallel strategy, then compare per-step losses, intervention gradients and final weights.

    case = ParityCase()                                   # tiny Llama, LoReFT at two layers, 3 steps
    candidate = train(case, "ddp")                        # inside an initialised process group
    reference = train(case, "single")                     # one device, the whole batch
    assert_parity(reference, candidate, case.tolerance)   # says which tensor differs, where, by how much

The default case trains on data like users': examples of different lengths padded on one side, labels
on each example's answer only (so examples, and ranks, hold different numbers of labels), ``accumulation``
micro-batches per optimizer step, and a trainable head beside the interventions (``lm_head``, or a
classifier's ``score``), cleared with ``model.zero_grad()`` after each step as HF Trainer clears it.

The comparison stays exact up to float rounding because the loop normalises as HF Trainer does with
``num_items_in_batch``: every micro-batch's loss is the *sum* of its tokens' cross-entropies divided by
the number of labels of the whole optimizer step (every rank's, every micro-batch's; each rank knows it,
as it holds the global batch), times the data-parallel world size that DDP, FSDP and ZeRO divide the
summed gradients by. The gradients summed over micro-batches and ranks are then those of the step's
token mean, on one device as on many; the recorded loss is that mean (summed over ranks).
Every rank gets an equal, contiguous share of each global micro-batch.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import tempfile
from typing import Any, Callable, Sequence

import torch
from torch import nn

from . import models

Tensors = dict[str, torch.Tensor]


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """Elementwise ``|actual - expected| <= atol + rtol * |expected|`` with ``atol = rtol * max|expected|``.

    Scaling ``atol`` with the tensor's largest element keeps "relative 1e-5" meaningful for the
    elements of a gradient that are near zero, where a pure relative test compares rounding noise.
    """

    rtol: float
    why: str = ""
    #: Adam's learning rate, for runs whose two sides round differently (DeepSpeed's bf16 against plain bf16):
    #: a final weight may then also be off by 2 x lr for each step in which the reference's gradient of
    #: that element was within ``rtol`` of its tensor's largest (see ``_sign_noise_allowance``).
    adam_lr: float = 0.0


TOLERANCES = {
    torch.float32: Tolerance(1e-5, "fp32: the guide's bound; measured differences are ~1e-7"),
    # bf16 keeps 8 significant bits: one rounding step is 2**-8 = 3.9e-3 relative. A different
    # reduction order (two shards summed, then averaged) can move a value by a couple of steps.
    torch.bfloat16: Tolerance(
        4 * 2**-8, "bf16: 4 ulps of an 8-bit significand (3 roundings of half an ulp, plus cancellation); measured 1.4"
    ),
}
#: DeepSpeed's bf16 mode is not plain bf16: the engine casts LoReFT's rotation (pyreft keeps it in float32) to
#: bf16, accumulates the micro-batches' gradients in bf16 (``grad_accum_dtype`` defaults to the model's) and
#: steps float32 master copies of the trainable weights, the head's too. Each side rounds differently, within
#: the bf16 bound of 4 ulps of the same arithmetic, so they agree within 8. Measured on CPU, 2 ranks, the
#: default case in bf16 at lr 1e-3 (lengths 8 to 16, 2 micro-batches a step, lm_head trained; one run each)
#: against one plain bf16 device, ZeRO-2 / ZeRO-3 (offload gives ZeRO-3's floats): loss 1.1e-4 / 1.0e-4 to
#: 1.2e-4, gradients 1.3e-2 / 1.7e-2 to 1.8e-2 (step 0: 9.6e-3 / 8.3e-3), weights 2.6e-2 at one lm_head element
#: Adam stepped the other way (below), 6.5e-3 elsewhere. Against one device with DeepSpeed's own arithmetic
#: (bf16 weights, float32 master copies) ZeRO-2's first loss is the same float and its first gradients are
#: within 7e-3.
#: The lr: Adam steps every element by about lr whatever its gradient's size, so an element whose gradient is
#: within rounding of zero is stepped either way, and the next steps' gradients then differ by what that
#: move makes, not by rounding. At the default lr 1e-2 ZeRO-2's step-1 gradients differ by 4.4e-2 (3 of the
#: rotation's 128 elements stepped the other way at step 0), against the one device with DeepSpeed's
#: arithmetic too, and plain bf16 is itself 5.4e-2 (gradients) and 0.21 (weights) from float32 there; at
#: lr 1e-3 the same step's difference is 5e-3. bf16 comparisons therefore train at lr 1e-3, as DDP's and
#: FSDP's do, and a final weight may be ``adam_lr`` x 2 off per step in which its reference gradient was
#: within the noise (``_sign_noise_allowance``): the lm_head element above had a first gradient of 3.3e-5 of
#: its tensor's largest, minus in one process, plus under ZeRO, and ends 2.0e-3 = 2 x lr off.
#: What the bound cannot tell apart: with this data a mean of per-rank means moves the gradients by 0.5e-2 to
#: 1.2e-2, within bf16's own rounding; the float32 comparisons at the same stages (1e-5) are what check the
#: normalisation. A missed micro-batch (0.44 to 0.89), a loss divided by the accumulation twice (0.5) or a
#: mean of micro-batch means (5.4e-2 on lm_head) fails here at step 0.
DEEPSPEED_BF16 = Tolerance(
    8 * 2**-8, "DeepSpeed bf16 (bf16 rotation, bf16 gradient accumulation, fp32 master weights) against plain "
    "bf16: 8 ulps, each side rounding within bf16's 4; measured 4.5 (gradients, CPU, lr 1e-3)"
)


def tolerance(case: "ParityCase", strategy: str) -> Tolerance:
    """The bound for ``strategy`` against one plain device: the dtype's, or DeepSpeed's bf16 one."""
    if case.torch_dtype == torch.bfloat16 and strategy.startswith("zero"):
        return DEEPSPEED_BF16
    return case.tolerance


@dataclasses.dataclass(frozen=True)
class ParityCase:
    """What to train. Every field takes part in the result; the defaults run in seconds on a CPU."""

    model: str = "llama"
    attention: str = "eager"  # transformers' attn_implementation (models.ATTENTIONS)
    hidden_size: int | None = None  # None: the model builder's own (32 and 2 for the tiny models)
    num_layers: int | None = None
    intervention: str = "LoreftIntervention"
    layers: tuple[int, ...] = (0, 1)
    component: str = "block_output"
    rank: int = 4
    positions: int = 2
    steps: int = 3
    batch_size: int = 8
    seq_len: int = 16  # the padded length; each example has between half of it and all of it
    padding: str = "right"  # the side examples are padded on
    accumulation: int = 2  # micro-batches per optimizer step (of batch_size examples each)
    trainable_head: bool = True  # lm_head (a classifier's score) trains beside the interventions, unless tied
    dtype: str = "float32"
    lr: float = 1e-2
    weight_decay: float = 0.01
    seed: int = 0
    checkpointing: str | None = None  # None, "reentrant" or "non-reentrant" activation checkpointing

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def tolerance(self) -> Tolerance:
        return TOLERANCES[self.torch_dtype]

    def build(self):
        return self.reft_model(self.base_model())

    def base_model(self) -> nn.Module:
        """The base model alone, its weights drawn from ``seed``."""
        if self.model not in models.BASE_MODELS:
            raise ValueError(f"model {self.model!r} is not one of {sorted(models.BASE_MODELS)}")
        shape = {"layers": self.num_layers, "hidden": self.hidden_size}
        return models.BASE_MODELS[self.model](
            seed=self.seed, dtype=self.torch_dtype, attention=self.attention,
            **{k: v for k, v in shape.items() if v is not None}
        )

    def reft_model(self, base: nn.Module) -> nn.Module:
        """``base`` with the case's interventions, checkpointed when the case says so."""
        model = models.reft_model(
            base,
            layers=self.layers,
            component=self.component,
            rank=self.rank,
            intervention=self.intervention,
            dtype=self.torch_dtype,
            seed=self.seed + 1,
        )
        if self.checkpointing is not None:
            if self.checkpointing not in ("reentrant", "non-reentrant"):
                raise ValueError(f"checkpointing {self.checkpointing!r} is not None, 'reentrant' or 'non-reentrant'")
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": self.checkpointing == "reentrant"}
            )
        if self.trainable_head:  # here, so that every strategy's build (device_map's too) trains it
            head = getattr(model.model, "score", None) if self.model in models.CLASSIFIERS \
                else model.model.get_output_embeddings()
            # GPT-2's lm_head is its input embedding: training it is training the embedding, not a head
            if head.weight is not model.model.get_input_embeddings().weight:
                head.requires_grad_(True)
        return model

    def batches(self, steps: int | None = None) -> list[dict[str, torch.Tensor]]:
        """Global micro-batches, ``accumulation`` per step: token ids, attention mask, labels, and
        pyreft-layout locations ``[interventions, batch, positions]`` within each example's tokens.

        Example lengths are drawn between ``seq_len // 2`` and ``seq_len``, padded with token 0 on ``padding``'s
        side. A language model's labels are the tokens of each example's second half (-100 elsewhere: the
        prompt and the padding); a classifier's are class ids.
        """
        steps = self.steps if steps is None else steps
        if self.padding not in ("left", "right"):
            raise ValueError(f"padding must be 'left' or 'right', got {self.padding!r}")
        if self.accumulation < 1:
            raise ValueError(f"accumulation must be 1 or more, got {self.accumulation}")
        generator = torch.Generator().manual_seed(self.seed + 2)
        count = steps * self.accumulation
        shape = (count, self.batch_size, self.seq_len)
        input_ids = torch.randint(1, models.VOCAB_SIZE, shape, generator=generator)
        lengths = torch.randint(max(1, self.seq_len // 2), self.seq_len + 1, shape[:2], generator=generator)
        locations = (torch.rand((count, len(self.layers), self.batch_size, self.positions), generator=generator)
                     * lengths[:, None, :, None]).long()  # a position within each example's own tokens
        column = torch.arange(self.seq_len)
        if self.padding == "left":
            offset = self.seq_len - lengths
            attention_mask = (column >= offset[..., None]).long()
            locations = locations + offset[:, None, :, None]
        else:
            offset = torch.zeros_like(lengths)
            attention_mask = (column < lengths[..., None]).long()
        input_ids = input_ids * attention_mask  # padding is token 0
        if self.model in models.CLASSIFIERS:
            labels = torch.randint(models.NUM_LABELS, (count, self.batch_size), generator=generator)
        else:
            answer = column >= (offset + lengths - lengths // 2)[..., None]
            labels = torch.where(answer & attention_mask.bool(), input_ids, -100)
        batches = [
            {"input_ids": input_ids[i], "attention_mask": attention_mask[i], "labels": labels[i],
             "locations": locations[i]}
            for i in range(count)
        ]
        if self.component.startswith("head_"):  # unit "h.pos": which head, then which positions
            heads = torch.randint(models.TINY_KV_HEADS, (count, len(self.layers), self.batch_size, 1),
                                  generator=generator)
            for i, batch in enumerate(batches):
                batch["heads"] = heads[i]
        return batches

    def steps_of(self, batches: list[dict[str, torch.Tensor]]) -> list[list[dict[str, torch.Tensor]]]:
        """``batches`` grouped into optimizer steps of ``accumulation`` micro-batches."""
        return [batches[i : i + self.accumulation] for i in range(0, len(batches), self.accumulation)]

    def labels_in(self, micro_batches: list[dict[str, torch.Tensor]]) -> int:
        """How many labels the loss of ``micro_batches`` averages over (HF's ``num_items_in_batch``)."""
        if self.model in models.CLASSIFIERS:
            return sum(batch["labels"].numel() for batch in micro_batches)
        return sum(int((batch["labels"][:, 1:] != -100).sum()) for batch in micro_batches)


@dataclasses.dataclass
class Record:
    """What one run produced: the global loss and the gradients of every step, final weights (of the
    interventions and of every trainable base-model parameter, such as a trainable head)."""

    strategy: str
    world_size: int
    losses: list[float]
    grads: list[Tensors]
    weights: Tensors
    peak_memory_bytes: int = 0
    parameter_bytes: int = 0  # what rank 0 holds of the model's parameters after wrapping (its shards)
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)


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
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("strategy 'ddp' needs an initialised torch.distributed process group")
        super().__init__(device)

    @property
    def world_size(self) -> int:
        import torch.distributed as dist

        return dist.get_world_size()

    @property
    def rank(self) -> int:
        import torch.distributed as dist

        return dist.get_rank()

    def wrap(self, model: nn.Module) -> nn.Module:
        device_ids = [self.device] if self.device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(model, device_ids=device_ids)

    def mean(self, value: torch.Tensor) -> float:
        import torch.distributed as dist

        value = value.detach().clone()
        dist.all_reduce(value)
        return value.item() / self.world_size


class FSDP2(DDP):
    """``fully_shard`` on every decoder layer and on the whole model (``pyvene_dist.fsdp.fully_shard_model``)."""

    name = "fsdp2"

    def prepare(self, model, optimizer, case):
        # fully_shard replaces the base model's parameters with sharded ones (a trainable head's too): the
        # optimizer is made again over them, with the same settings.
        from ..optim import param_groups

        wrapped = self.wrap(model)
        return wrapped, torch.optim.AdamW(param_groups(model, case.weight_decay), lr=case.lr)  # as train() makes it

    def wrap(self, model: nn.Module) -> nn.Module:
        from ..fsdp import fully_shard_model

        return fully_shard_model(model)


class FSDP1(DDP):
    """``FullyShardedDataParallel`` (FSDP1) with one unit per decoder layer; needs one GPU per rank."""

    name = "fsdp1"

    def wrap(self, model: nn.Module) -> nn.Module:
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        from ..fsdp import layer_classes

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

    def prepare(self, model, optimizer, case):
        import deepspeed

        config = self.config(case.batch_size, case.accumulation)
        if case.torch_dtype == torch.bfloat16:
            config["bf16"] = {"enabled": True}  # DeepSpeed's bf16: bf16 weights, fp32 master copies to step
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
        from accelerate import Accelerator

        self.accelerator = self.accelerator or Accelerator(cpu=self.device.type == "cpu")
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
        from accelerate import dispatch_model

        base = case.base_model()
        return case.reft_model(dispatch_model(base, split_map(base, self.split), main_device=self.device))

    def place(self, model):
        return model  # each layer is on its device already

    def _gpus(self) -> list[int]:
        return sorted({device for device in self.split if isinstance(device, int)})

    def reset_peak_memory(self) -> None:
        for gpu in self._gpus():
            torch.cuda.reset_peak_memory_stats(gpu)

    def peak_memory(self) -> int:
        return max((torch.cuda.max_memory_allocated(gpu) for gpu in self._gpus()), default=0)


class TensorParallel(DDP):
    """Tensor parallel over every rank: the base model loaded with ``from_pretrained(tp_plan="auto")`` on a
    1-D mesh (``by_hand``: torch's ``parallelize_module`` with the model's ``base_model_tp_plan``). Every
    rank sees the whole batch; the interventions are whole on every rank."""

    name = "tp"
    #: The mesh dimensions, outermost first; the last is ``tp``, the others split the data.
    dims: tuple[str, ...] = ("tp",)

    def __init__(self, device: str | torch.device | None = None, *, by_hand: bool = False, shape=None):
        super().__init__(device)
        from torch.distributed.device_mesh import init_device_mesh

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
        import torch.distributed as dist

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
        import torch.distributed as dist

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
        from ..fsdp import fully_shard_model

        return fully_shard_model(model, mesh=self.mesh["dp_shard"])


class HSDP(TensorParallel):
    """FSDP2 replicated over ``dp_replicate`` and sharded over ``dp_shard`` (a 2-D mesh, no tensor parallel)."""

    name = "hsdp"
    dims = ("dp_replicate", "dp_shard")

    def __init__(self, device=None):
        super().__init__(device, shape=(self._world_size() // 2, 2))

    def wrap(self, model):
        from ..fsdp import fully_shard_model

        return fully_shard_model(model, mesh=self.mesh)


def parallelize_by_hand(base: nn.Module, tp_mesh) -> nn.Module:
    """torch's ``parallelize_module`` over ``tp_mesh``, with the styles the model's ``base_model_tp_plan`` names
    (``colwise``, ``rowwise``): what a user who does not load through ``from_pretrained`` writes."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan = getattr(base.config, "base_model_tp_plan", None) or {}
    prefix = base.base_model_prefix
    unknown = sorted({style for style in plan.values() if style not in styles})
    if not plan or unknown:
        raise ValueError(f"{type(base).__name__}'s base_model_tp_plan {plan!r} has no plan of only {sorted(styles)}")
    parallelize_module(base, tp_mesh, {f"{prefix}.{name}": styles[style]() for name, style in plan.items()})
    return base


def split_map(model: nn.Module, devices: Sequence[str | int]) -> dict[str, str | int]:
    """A ``device_map`` putting the decoder layers on ``devices`` in contiguous, even groups (the first
    layers on ``devices[0]``) and every other module (embeddings, norm, head) on ``devices[0]``."""
    from ..fsdp import layer_classes

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


#: Given a world size and the machine's GPU count: None when the machine can run it, else why not.
Requirement = Callable[[int, int], "str | None"]


def _any(world_size: int, gpus: int) -> str | None:
    return None  # world sizes are checked against the machine by the caller (pyvene-dist check's validate)


def _gpu_per_rank(world_size: int, gpus: int) -> str | None:
    return None if gpus >= world_size else f"needs {world_size} GPUs, found {gpus}"


def _two_gpus(world_size: int, gpus: int) -> str | None:
    return None if gpus >= 2 else f"needs 2 GPUs, found {gpus}"


def _two_dimensional(world_size: int, gpus: int) -> str | None:
    if world_size >= 4 and world_size % 2 == 0:
        return None
    return f"needs a 2-D mesh (data x 2): an even world size of 4 or more, got {world_size}"


def _installed(package: str, then: Requirement = _any) -> Requirement:
    def needs(world_size: int, gpus: int) -> str | None:
        import importlib.util

        return f"{package} not installed" if importlib.util.find_spec(package) is None else then(world_size, gpus)

    return needs


@dataclasses.dataclass(frozen=True)
class Registered:
    """One strategy of the registry: how to make it (``STRATEGIES[name](device)``), what a machine needs to
    run it, and whether one process runs it over every visible device (listed once, not per world size)."""

    make: Callable[..., Strategy]
    needs: Requirement = _any
    one_process: bool = False

    def __call__(self, *args, **kwargs) -> Strategy:
        return self.make(*args, **kwargs)

    def unavailable(self, world_size: int, gpus: int) -> str | None:
        return self.needs(world_size, gpus)


def _zero(stage: int, **options) -> Callable[..., Strategy]:
    return lambda device=None: DeepSpeed(stage, device=device, **options)


#: Every strategy the harness trains, ``pyvene-dist check`` runs (``check.CHECKED``) and benchmarks use.
STRATEGIES: dict[str, Registered] = {
    "single": Registered(Strategy),
    "ddp": Registered(DDP),
    "fsdp2": Registered(FSDP2),
    "fsdp1": Registered(FSDP1, _gpu_per_rank),
    "zero1": Registered(_zero(1), _installed("deepspeed")),
    "zero2": Registered(_zero(2), _installed("deepspeed")),
    "zero3": Registered(_zero(3), _installed("deepspeed")),
    "zero2-offload": Registered(_zero(2, offload=True), _installed("deepspeed")),
    # Host-memory offload is what a GPU run is after; on a CPU-only machine it is ZeRO-3 again.
    "zero3-offload": Registered(_zero(3, offload=True), _installed("deepspeed", _gpu_per_rank)),
    "zero3-nvme": Registered(_zero(3, offload="nvme"), _installed("deepspeed")),
    "accelerate": Registered(Accelerate, _installed("accelerate")),
    "dataparallel": Registered(DataParallel, _two_gpus, one_process=True),
    "device_map": Registered(DeviceMap, _installed("accelerate", _two_gpus), one_process=True),
    "tp": Registered(TensorParallel),  # over every rank; the world size must divide the key/value heads
    "tp-by-hand": Registered(lambda device=None: TensorParallel(device, by_hand=True)),
    "tp-fsdp2": Registered(TensorParallelFSDP2, _two_dimensional),
    "hsdp": Registered(HSDP, _two_dimensional),
}


def train(case: ParityCase, strategy: str | Strategy = "single") -> Record:
    """Train ``case`` under ``strategy`` and record every step. Deterministic for a given case."""
    if isinstance(strategy, str):
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy {strategy!r} is not one of {sorted(STRATEGIES)}")
        strategy = STRATEGIES[strategy]()
    model = strategy.place(strategy.build(case))
    model.train()
    from ..optim import param_groups

    optimizer = torch.optim.AdamW(param_groups(model, case.weight_decay), lr=case.lr)
    wrapped, optimizer = strategy.prepare(model, optimizer, case)
    held = parameter_bytes(model)
    strategy.reset_peak_memory()
    losses, grads = [], []
    classifier = case.model in models.CLASSIFIERS
    for micro_batches in case.steps_of(case.batches()):
        labels = case.labels_in(micro_batches)
        step_loss = torch.zeros((), dtype=torch.float64, device=strategy.device)
        for index, batch in enumerate(micro_batches):
            loss = _loss(wrapped, strategy.shard(batch), strategy.device, classifier=classifier) / labels
            strategy.backward(loss * strategy.world_size)  # DDP, FSDP and ZeRO average over the ranks
            step_loss += loss.detach().double()
            if index < len(micro_batches) - 1:
                strategy.micro_step(optimizer)
        losses.append(strategy.mean(step_loss) * strategy.world_size)
        grads.append(intervention_grads(model))
        strategy.step(optimizer, wrapped)
    weights = intervention_weights(model)
    peak = strategy.peak_memory()
    return Record(strategy.name, strategy.devices, losses, grads, weights, peak, held)


def parameter_bytes(model: nn.Module) -> int:
    """Bytes of parameters this process holds: a sharded parameter counts its local shard only."""
    total = 0
    for parameter in model.parameters():
        if hasattr(parameter, "ds_tensor"):  # DeepSpeed ZeRO-3: this rank's partition
            local = parameter.ds_tensor
        else:
            local = parameter.to_local() if hasattr(parameter, "to_local") else parameter
        total += local.numel() * local.element_size()
    return total


def _loss(model: nn.Module, shard: dict[str, torch.Tensor], device: torch.device, *,
          classifier: bool = False) -> torch.Tensor:
    """The sum of the cross-entropies of ``shard``'s labels (a language model's shifted by one position, as
    HF's loss shifts them), in float32."""
    locations = shard["locations"].tolist()
    if "heads" in shard:
        locations = [(heads, positions) for heads, positions in zip(shard["heads"].tolist(), locations)]
    base = {"input_ids": shard["input_ids"].to(device)}
    if "attention_mask" in shard:
        base["attention_mask"] = shard["attention_mask"].to(device)
    _, counterfactual = model(base, unit_locations={"sources->base": (None, locations)})
    logits, labels = counterfactual.logits.float(), shard["labels"].to(device)
    if not classifier:
        logits, labels = logits[:, :-1], labels[:, 1:]
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                       ignore_index=-100, reduction="sum")


def _trained(model: nn.Module):
    """The interventions' parameters, and the base model's trainable ones (``model.<name>``)."""
    yield from model.interventions.named_parameters()
    yield from ((f"model.{name}", p) for name, p in model.model.named_parameters() if p.requires_grad)


def intervention_grads(model: nn.Module) -> Tensors:
    """CPU copies of the trained parameters' gradients (see ``_trained``), whole also when DeepSpeed ZeRO,
    FSDP or tensor parallelism holds them split (reading those is a collective: every rank calls this
    at the same point)."""
    grads = {}
    for name, parameter in _trained(model):
        if parameter.requires_grad:
            grad = parameter.grad
            if grad is None and "deepspeed" in sys.modules:
                from deepspeed.utils import safe_get_full_grad

                grad = safe_get_full_grad(parameter)
            if grad is None:
                raise AssertionError(f"trained parameter {name} received no gradient")
            grads[name] = _whole(grad).detach().float().cpu().clone()
    return grads


def intervention_weights(model: nn.Module) -> Tensors:
    """CPU copies of the trained parameters, whole also under DeepSpeed ZeRO, FSDP or tensor parallelism
    (a collective, as above)."""
    weights = {}
    for name, parameter in _trained(model):
        if hasattr(parameter, "ds_id") or hasattr(parameter, "_hp_mapping"):
            from deepspeed.utils import safe_get_full_fp32_param

            parameter = safe_get_full_fp32_param(parameter)
        weights[name] = _whole(parameter).detach().float().cpu().clone()
    return weights


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor  # a DTensor: every shard


def _default_device() -> torch.device:
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


@dataclasses.dataclass(frozen=True)
class Differences:
    """The largest disagreement of each kind between two records (relative to the reference's scale)."""

    loss: float
    grad: float
    weight: float


def differences(reference: Record, candidate: Record) -> Differences:
    _check_same_shape(reference, candidate)
    loss = max((abs(a - b) for a, b in zip(reference.losses, candidate.losses)), default=0.0)
    grad = max((_relative(r, c) for rs, cs in zip(reference.grads, candidate.grads) for r, c in _pairs(rs, cs)),
               default=0.0)
    weight = max((_relative(r, c) for r, c in _pairs(reference.weights, candidate.weights)), default=0.0)
    return Differences(loss, grad, weight)


def assert_parity(reference: Record, candidate: Record, tolerance: Tolerance, *, grads: bool = True) -> None:
    """Fail with the first tensor (step, name) outside ``tolerance``, where, and by how much.

    ``grads=False`` compares losses and weights only, for runs that cannot record gradients (HF Trainer
    with DeepSpeed); a record without gradients is otherwise an error, never a silent pass.
    """
    _check_same_shape(reference, candidate)
    if grads and len(candidate.grads) != len(candidate.losses):
        raise AssertionError(f"{candidate.strategy} recorded gradients for {len(candidate.grads)} of "
                             f"{len(candidate.losses)} steps; pass grads=False to compare losses and weights only")
    label = f"{candidate.strategy} (world size {candidate.world_size}) vs {reference.strategy}"
    _assert_close(
        torch.tensor(candidate.losses, dtype=torch.float64),
        torch.tensor(reference.losses, dtype=torch.float64),
        tolerance,
        f"{label}: per-step loss {candidate.losses} vs {reference.losses}",
    )
    for step, (expected, actual) in enumerate(zip(reference.grads, candidate.grads) if grads else ()):
        for name, (e, a) in _named_pairs(expected, actual):
            _assert_close(a, e, tolerance, f"{label}: step {step}, gradient of {name}")
    for name, (e, a) in _named_pairs(reference.weights, candidate.weights):
        if tolerance.adam_lr:
            allowed = _sign_noise_allowance(reference, name, tolerance) + tolerance.rtol * (e.abs().max() + e.abs())
            a = torch.where((a - e).abs() <= allowed, e, a)
        _assert_close(a, e, tolerance, f"{label}: final weight {name}")


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, tolerance: Tolerance, what: str) -> None:
    scale = expected.abs().max().item() if expected.numel() else 0.0
    torch.testing.assert_close(
        actual,
        expected,
        rtol=tolerance.rtol,
        atol=tolerance.rtol * scale,
        msg=lambda detail: f"{what} differs ({tolerance.why}):\n{detail}",
    )


def _sign_noise_allowance(reference: Record, name: str, tolerance: Tolerance) -> torch.Tensor:
    """2 x lr for each step in which the reference's gradient of an element was within the bound's noise
    (``rtol`` of the tensor's largest): Adam's step is lr x sign(gradient) at first, about lr later, so the
    other side's rounding may have stepped such an element the other way."""
    if not reference.grads:
        raise AssertionError(f"{reference.strategy} recorded no gradients: Tolerance.adam_lr needs the reference's")
    noise = [(grads[name].abs() <= tolerance.rtol * grads[name].abs().max()).float() for grads in reference.grads]
    return 2 * tolerance.adam_lr * torch.stack(noise).sum(0)


def _relative(expected: torch.Tensor, actual: torch.Tensor) -> float:
    scale = expected.abs().max().item()
    difference = (actual - expected).abs().max().item()
    return difference / scale if scale else difference


def _check_same_shape(reference: Record, candidate: Record) -> None:
    if len(reference.losses) != len(candidate.losses):
        raise AssertionError(f"{len(candidate.losses)} steps recorded, expected {len(reference.losses)}")
    if set(reference.weights) != set(candidate.weights):
        raise AssertionError(
            f"intervention parameters differ: {sorted(set(reference.weights) ^ set(candidate.weights))}"
        )
    if any(math.isnan(loss) for loss in candidate.losses):
        raise AssertionError(f"{candidate.strategy}: NaN loss {candidate.losses}")


def _named_pairs(expected: Tensors, actual: Tensors):
    if set(expected) != set(actual):
        raise AssertionError(f"parameters differ: {sorted(set(expected) ^ set(actual))}")
    return ((name, (expected[name], actual[name])) for name in sorted(expected))


def _pairs(expected: Tensors, actual: Tensors) -> list[tuple[Any, Any]]:
    return [pair for _, pair in _named_pairs(expected, actual)]
