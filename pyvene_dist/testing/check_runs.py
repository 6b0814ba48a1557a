"""What ``pyvene-dist check`` trains beyond the built-in models: a local model of the user's (a directory
with ``config.json``, weights optional, or a config ``.json`` file). Training is ``parity.train``'s,
under any strategy of the registry (``device_map`` splits the base model's layers with
``parity.split_map``).

    case = CheckCase(model="path/to/model", layers=representation_layers(model_config("path/to/model")))
    reference = train(case, "single")
    split = train(case, DeviceMap(devices=[0, 1]))  # one process, decoder layers over cuda:0 and cuda:1
    assert_parity(reference, split, case.tolerance)
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
import transformers
from torch import nn

from . import models
from .case import ParityCase

#: Files whose presence means a local model directory holds weights (else it is built from its config).
WEIGHT_FILES = (
    "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json",
)


def model_config(path: str | Path):
    """The HF config of a local model; ``ValueError`` naming the path and what was expected otherwise."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"{path}: no such file or directory")
    if path.is_dir() and not (path / "config.json").is_file():
        raise ValueError(f"{path} is a directory without config.json")
    if path.is_file() and path.suffix != ".json":
        raise ValueError(f"{path} is neither a directory with config.json nor a config .json file")
    try:
        config = transformers.AutoConfig.from_pretrained(str(path))
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
    loaded when the directory has them, else drawn from ``seed``. Dropout is switched off. The interventions
    train alone, as pyreft trains them by default: tensor parallel shards the head, and a user's model may
    tie it (the test suite's default case trains a head beside them)."""

    trainable_head: bool = False

    @property
    def local(self) -> bool:
        return self.model not in models.BASE_MODELS

    def base_model(self) -> nn.Module:
        if not self.local:
            return super().base_model()
        config = model_config(self.model)
        if has_weights(self.model):  # in the case's dtype as it loads: a ZeRO-3 partition is not cast after
            model = transformers.AutoModelForCausalLM.from_pretrained(self.model, config=config, dtype=self.torch_dtype)
        else:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(self.seed)
                model = transformers.AutoModelForCausalLM.from_config(config)
        return model.to(self.torch_dtype)
