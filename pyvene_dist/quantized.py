"""Quantized base models (bitsandbytes' 4-bit and 8-bit layers) under the parallel strategies: which ones can
shard them, and the refusal, before anything is sharded, of one that cannot.

Measured on CPU (bitsandbytes 0.50.2, torch 2.13, 2 gloo ranks; tests/strategies/test_quantized.py): LoReFT over
a 4-bit base (nf4, its storage uint8 or the model's float dtype) trains with the results of one process under
DDP, FSDP2 and ZeRO-3; over an 8-bit base (LLM.int8) under DDP and ZeRO-3. FSDP cannot shard an 8-bit base:
its unsharded weight comes back as a plain ``Parameter`` without the ``Int8Params`` statistics that
``Linear8bitLt.forward`` reads (``AttributeError: 'Parameter' object has no attribute 'CB'`` at the first
forward). bitsandbytes' 4-bit layer survives it: ``Linear4bit`` keeps its quantization state on the module and
puts it back on the weight FSDP hands it (``fix_4bit_weight_quant_state_from_module``).

``pyvene_dist.patch()`` refuses 8-bit under FSDP (FSDP2's ``fully_shard`` and FSDP1's wrapper, where the fsdp
fix applies) with ``UnshardableQuantization``, naming the combination and what does work.
"""

from __future__ import annotations

from torch import nn

#: bitsandbytes' layers that FSDP cannot shard, by class name (bitsandbytes is not imported to find them).
UNSHARDABLE_BY_FSDP = ("Linear8bitLt",)


class UnshardableQuantization(ValueError):
    """A strategy was asked to shard a quantized layer it cannot."""


def refuse_unshardable(modules, strategy: str) -> None:
    """Raise ``UnshardableQuantization`` when ``modules`` hold a layer ``strategy`` (an FSDP) cannot shard."""
    for module in modules:
        found = [name for name, layer in module.named_modules() if type(layer).__name__ in UNSHARDABLE_BY_FSDP]
        if found:
            raise UnshardableQuantization(
                f"{strategy} cannot shard a base model quantized to 8 bits (bitsandbytes' Linear8bitLt: {len(found)} "
                f"layers, the first {found[0]!r}): FSDP gives each layer back a plain Parameter without the int8 "
                "statistics it computes with. Load the base in 4 bits (BitsAndBytesConfig(load_in_4bit=True, "
                "bnb_4bit_quant_storage=torch.bfloat16)) to shard it with FSDP, or keep 8 bits and train under DDP "
                "or DeepSpeed ZeRO-3 (docs/quantized.md)")
