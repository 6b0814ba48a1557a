"""The one registry of strategies: each name, how to make its runner, and what a machine needs to run it."""

from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import Any, Callable

from .requirements import (Requirement, any_machine, gpu_per_rank, installed, tp_plan_splits_the_vocabulary,
                           two_dimensional, two_gpus)
from .runners import DDP, FSDP1, FSDP2, Accelerate, DataParallel, DeepSpeed, DeviceMap, Strategy
from .mesh_runners import HSDP, TensorParallel, TensorParallelFSDP2


@dataclasses.dataclass(frozen=True)
class Registered:
    """One strategy of the registry: how to make it (``STRATEGIES[name](device)``), what a machine needs to
    run it, whether one process runs it over every visible device (listed once, not per world size), and
    the ``TrainingArguments`` that switch it on in HF Trainer, for the strategies the workload suite
    (tests/workloads) runs users' Trainer flows under (None: not run that way)."""

    make: Callable[..., Strategy]
    needs: Requirement = any_machine
    one_process: bool = False
    trainer_arguments: Callable[[], dict] | None = None

    def __call__(self, *args, **kwargs) -> Strategy:
        return self.make(*args, **kwargs)

    def unavailable(self, world_size: int, gpus: int) -> str | None:
        return self.needs(world_size, gpus)


def _zero(stage: int, **options) -> Callable[..., Strategy]:
    return lambda device=None: DeepSpeed(stage, device=device, **options)


def _no_arguments() -> dict:
    return {}  # the process group the launcher made is all HF Trainer needs (DDP), or none (one process)


def _fsdp2_arguments() -> dict:
    return {"fsdp": True, "fsdp_config": {"version": 2, "cpu_ram_efficient_loading": True}}  # each rank reads its share


def deepspeed_config(stage: str) -> dict:
    """An HF Trainer DeepSpeed config for ZeRO ``stage`` ("1", "2", "3", "3-offload"), sizes and bf16 left to "auto"."""
    level, _, offload = stage.partition("-")
    zero: dict[str, Any] = {"stage": int(level)}
    if level == "3":
        zero["stage3_param_persistence_threshold"] = 0  # partition everything, interventions included
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
        if level == "3":
            zero["offload_param"] = {"device": "cpu"}
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "bf16": {"enabled": "auto"},  # filled in by TrainingArguments, before from_pretrained runs zero.Init
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
    }


def _deepspeed_arguments(stage: str) -> Callable[[], dict]:
    def arguments() -> dict:
        return {"deepspeed": deepspeed_config(stage)}

    return arguments


#: Every strategy the harness trains, ``pyvene-dist check`` runs (``check.CHECKED``) and benchmarks use.
STRATEGIES: dict[str, Registered] = MappingProxyType({
    "single": Registered(Strategy, trainer_arguments=_no_arguments),
    "ddp": Registered(DDP, trainer_arguments=_no_arguments),
    "fsdp2": Registered(FSDP2, trainer_arguments=_fsdp2_arguments),
    "fsdp1": Registered(FSDP1, gpu_per_rank),
    "zero1": Registered(_zero(1), installed("deepspeed")),
    "zero2": Registered(_zero(2), installed("deepspeed"), trainer_arguments=_deepspeed_arguments("2")),
    "zero3": Registered(_zero(3), installed("deepspeed"), trainer_arguments=_deepspeed_arguments("3")),
    "zero2-offload": Registered(_zero(2, offload=True), installed("deepspeed")),
    # Host-memory offload is what a GPU run is after; on a CPU-only machine it is ZeRO-3 again.
    "zero3-offload": Registered(_zero(3, offload=True), installed("deepspeed", gpu_per_rank)),
    "zero3-nvme": Registered(_zero(3, offload="nvme"), installed("deepspeed")),
    "accelerate": Registered(Accelerate, installed("accelerate")),
    "dataparallel": Registered(DataParallel, two_gpus, one_process=True),
    "device_map": Registered(DeviceMap, installed("accelerate", two_gpus), one_process=True),
    # over every rank; the world size must divide the key/value heads (and, before transformers 5.21, the vocabulary)
    "tp": Registered(TensorParallel, tp_plan_splits_the_vocabulary),
    "tp-by-hand": Registered(lambda device=None: TensorParallel(device, by_hand=True)),
    "tp-fsdp2": Registered(TensorParallelFSDP2, two_dimensional),
    "hsdp": Registered(HSDP, two_dimensional),
})
