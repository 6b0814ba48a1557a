"""The parity harness over a quantized base: ``QuantizedCase`` loads the case's model through
``from_pretrained(quantization_config=BitsAndBytesConfig(...))``, as a user's script does, so that every
strategy of the registry trains LoReFT over the same 4-bit or 8-bit weights as the one-process reference.

    case = QuantizedCase(quantize="4bit")                    # nf4, its storage in the case's dtype
    assert_parity(train(case, "single"), train(case, "fsdp2"), case.tolerance)
"""

from __future__ import annotations

import contextlib
import dataclasses
import tempfile
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file
from torch import nn

from .._optional import DEEPSPEED_INSTALL, OnFirstUse
from .check_runs import CheckCase, has_weights

deepspeed = OnFirstUse("deepspeed", DEEPSPEED_INSTALL)  # optional: the deepspeed extra, where it partitioned a model

#: What ``quantize`` may name: bitsandbytes' 4-bit (nf4) and 8-bit (LLM.int8) linear layers.
QUANTIZE = ("4bit", "8bit")


def bits_and_bytes_config(quantize: str, dtype: torch.dtype, storage: torch.dtype | None = None):
    """The ``BitsAndBytesConfig`` a user passes for ``quantize``: nf4 computing in ``dtype`` with its packed
    storage in ``dtype`` too (FSDP and ZeRO-3 then shard the 4-bit weights as any tensor of the model's
    dtype, as FSDP-QLoRA does), or LLM.int8."""
    if quantize == "4bit":
        return transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                               bnb_4bit_compute_dtype=dtype, bnb_4bit_quant_storage=storage or dtype)
    if quantize == "8bit":
        return transformers.BitsAndBytesConfig(load_in_8bit=True)
    raise ValueError(f"quantize {quantize!r} is not one of {', '.join(QUANTIZE)}")


@dataclasses.dataclass(frozen=True)
class QuantizedCase(CheckCase):
    """A ``CheckCase`` whose base model is loaded quantized: a built-in model is saved to a folder first (its
    weights drawn from ``seed``), a local folder is loaded as it is. The head stays trainable only where it is
    not quantized (bitsandbytes leaves ``lm_head`` in the model's dtype)."""

    quantize: str = "4bit"
    storage: str | None = None  # 4-bit: the dtype bitsandbytes packs into; None: the case's dtype

    def base_model(self) -> nn.Module:
        if self.quantize not in QUANTIZE:
            raise ValueError(f"quantize {self.quantize!r} is not one of {', '.join(QUANTIZE)}")
        config = bits_and_bytes_config(self.quantize, self.torch_dtype,
                                       getattr(torch, self.storage) if self.storage else None)
        if self.local and has_weights(self.model):
            return transformers.AutoModelForCausalLM.from_pretrained(self.model, quantization_config=config,
                                                                     dtype=self.torch_dtype)
        with tempfile.TemporaryDirectory(prefix="pyvene-dist-quantized") as folder:
            _save(self.plain_base(), Path(folder))
            return transformers.AutoModelForCausalLM.from_pretrained(folder, quantization_config=config,
                                                                     dtype=self.torch_dtype)

    def plain_base(self) -> nn.Module:
        """The base model before quantization (the weights ``base_model`` quantizes)."""
        return CheckCase.base_model(self)


def _save(model: nn.Module, folder: Path) -> None:
    """``model``'s config and weights as ``from_pretrained`` reads them, written by this process alone (HF's
    ``save_pretrained`` writes on rank 0 only in a process group, and one rank may build alone: a reference);
    a model that HF's ZeRO-3 config built partitioned is gathered first."""
    partitioned = [p for p in model.parameters() if hasattr(p, "ds_id")]  # built under HF's ZeRO-3 config
    if partitioned:
        gathered = deepspeed.zero.GatheredParameters(partitioned)
    else:
        gathered = contextlib.nullcontext()
    with gathered:
        state = {name: tensor.detach().clone().contiguous() for name, tensor in model.state_dict().items()}
    model.config.to_json_file(folder / "config.json")
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
