"""What ``pyvene-dist check`` trains beyond ``parity.train``: a local model of the user's (a directory
with ``config.json``, weights optional, or a config ``.json`` file), the base model split over GPUs
with ``device_map``, and accelerate's ``Accelerator.prepare``.

    case = CheckCase(model="path/to/model", layers=representation_layers(model_config("path/to/model")))
    reference = train(case, "single")
    split = train_split(case, [0, 1])             # one process, decoder layers spread over cuda:0 and cuda:1
    assert_parity(reference, split, case.tolerance)
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Sequence

import torch
from torch import nn

from . import models
from .parity import ParityCase, Record, _loss, intervention_grads, intervention_weights

#: Files whose presence means a local model directory holds weights (else it is built from its config).
WEIGHT_FILES = (
    "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json",
)


def model_config(path: str | Path):
    """The HF config of a local model; ``ValueError`` naming the path and what was expected otherwise."""
    from transformers import AutoConfig

    path = Path(path)
    if not path.exists():
        raise ValueError(f"{path}: no such file or directory")
    if path.is_dir() and not (path / "config.json").is_file():
        raise ValueError(f"{path} is a directory without config.json")
    if path.is_file() and path.suffix != ".json":
        raise ValueError(f"{path} is neither a directory with config.json nor a config .json file")
    try:
        config = AutoConfig.from_pretrained(str(path))
    except (OSError, ValueError, KeyError) as error:
        raise ValueError(f"{path}: not a transformers config ({error})") from None
    for name, value in config.to_dict().items():
        # Dropout draws different masks on every rank: no strategy could match one device with it on.
        if isinstance(value, float) and ("dropout" in name or name.endswith("pdrop")):
            setattr(config, name, 0.0)
    config._attn_implementation = "eager"  # identical arithmetic on every backend and device
    return config


def has_weights(path: str | Path) -> bool:
    path = Path(path)
    return path.is_dir() and any((path / name).is_file() for name in WEIGHT_FILES)


def representation_layers(config) -> tuple[int, ...]:
    """The first and the last decoder layer (the only one, for a one-layer model)."""
    count = getattr(config, "num_hidden_layers", None)
    if not isinstance(count, int) or count < 1:
        raise ValueError(f"{type(config).__name__} has num_hidden_layers {count!r}; expected a positive integer")
    return (0,) if count == 1 else (0, count - 1)


@dataclasses.dataclass(frozen=True)
class CheckCase(ParityCase):
    """A ``ParityCase`` whose ``model`` may also be a local path (see ``model_config``): weights are
    loaded when the directory has them, else drawn from ``seed``. Dropout is switched off."""

    @property
    def local(self) -> bool:
        return self.model not in models.BASE_MODELS

    def base_model(self) -> nn.Module:
        if not self.local:
            return super().base_model()
        from transformers import AutoModelForCausalLM

        config = model_config(self.model)
        if has_weights(self.model):
            model = AutoModelForCausalLM.from_pretrained(self.model, config=config)
        else:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(self.seed)
                model = AutoModelForCausalLM.from_config(config)
        return model.to(self.torch_dtype)


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


def train_split(case: CheckCase, devices: Sequence[str | int]) -> Record:
    """Train ``case`` in this process with its base model's layers split over ``devices`` (GPU indices,
    or "cpu" to try it without GPUs) by ``accelerate.dispatch_model``, as ``from_pretrained(...,
    device_map=...)`` splits a model; whole batches. The peak is the largest GPU's."""
    from accelerate import dispatch_model

    from ..optim import param_groups

    main = torch.device("cuda", devices[0]) if isinstance(devices[0], int) else torch.device(devices[0])
    gpus = sorted({device for device in devices if isinstance(device, int)})
    base = case.base_model()
    base = dispatch_model(base, split_map(base, devices), main_device=main)
    model = case.reft_model(base)
    model.train()
    optimizer = torch.optim.AdamW(param_groups(model, case.weight_decay), lr=case.lr)
    for gpu in gpus:
        torch.cuda.reset_peak_memory_stats(gpu)
    losses, grads = [], []
    for batch in case.batches():
        loss = _loss(model, batch, main)
        loss.backward()
        losses.append(loss.item())
        grads.append(intervention_grads(model))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    peak = max((torch.cuda.max_memory_allocated(gpu) for gpu in gpus), default=0)
    return Record("device_map", len(devices), losses, grads, intervention_weights(model), peak)


def train_accelerate(case: ParityCase) -> Record:
    """``hf.train_with_accelerate`` inside an initialised process group (one rank per GPU, else CPU)."""
    from accelerate import Accelerator

    from .hf import train_with_accelerate

    return train_with_accelerate(case, Accelerator(cpu=not torch.cuda.is_available()))
