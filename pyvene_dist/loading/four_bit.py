"""A 4-bit base (bitsandbytes' ``Linear4bit``, its packed storage a float dtype as FSDP-QLoRA lays it out) loaded
sharded: each rank quantizes only the part of each weight it keeps.

bitsandbytes quantizes a weight flattened, in blocks of ``blocksize`` elements, each block scaled by its largest
magnitude (``absmax``), two 4-bit values to a byte, so ``storage.itemsize * 2`` values to one element of a float
``quant_storage``. FSDP2 shards the packed weight ``(numel / per, 1)`` by rows: a rank's rows are a run of the
weight's flattened elements. The rank reads that run widened to whole blocks, quantizes it (the same bytes and
scales as quantizing the whole weight: blocks are independent), keeps its rows of the packed result, and the ranks
exchange the scales of the blocks that start in their runs, so that every rank holds the whole quantization state,
which the layer keeps on itself and gives back to the weight FSDP hands it
(``fix_4bit_weight_quant_state_from_module``).
A nested (double) quantization of the scales is then made from the whole ``absmax`` on every rank alike.

Where the layout does not allow it (``uint8`` storage, which FSDP2 cannot shard; a weight whose size is not a
multiple of ``per``), ``quantized_weights`` says why and the base is loaded whole.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import nn

from .._optional import QUANTIZE_INSTALL, OnFirstUse
from .checkpoint_files import CheckpointFiles

# bitsandbytes: only where a model is quantized with it. Importing it registers torch.ops.bitsandbytes.
bitsandbytes = OnFirstUse("bitsandbytes", QUANTIZE_INSTALL)
bnb_functional = OnFirstUse("bitsandbytes.functional", QUANTIZE_INSTALL)

#: bitsandbytes' block size for the quantization state's own (nested) quantization.
NESTED_BLOCKSIZE = 256


@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """How a ``Linear4bit``'s weight is quantized: its shape and dtype before, and bitsandbytes' settings."""

    module: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    blocksize: int
    quant_type: str
    nested: bool
    storage: torch.dtype

    @property
    def per(self) -> int:
        """4-bit values in one element of the packed storage."""
        return self.storage.itemsize * 2


def quantized_weights(model: nn.Module, dtype: torch.dtype) -> tuple[dict[str, QuantizedWeight], str | None]:
    """Every ``Linear4bit`` weight of ``model`` (built on the meta device, its weights in their own shape) and how it
    is quantized: ``({weight name: QuantizedWeight}, None)``, or ``({}, why)`` where one cannot be read in parts."""
    found = {}
    for name, module in model.named_modules():
        if type(module).__name__ != "Linear4bit":
            continue
        weight = module.weight
        storage = getattr(module, "quant_storage", None) or weight.quant_storage
        if not storage.is_floating_point:
            return {}, (f"its 4-bit weights are packed in {storage} (FSDP2 shards a float quant_storage only: "
                        "BitsAndBytesConfig(bnb_4bit_quant_storage=torch.bfloat16))")
        record = QuantizedWeight(name, tuple(weight.shape), dtype, weight.blocksize or 64, weight.quant_type,
                                 bool(weight.compress_statistics), storage)
        if weight.numel() % record.per:
            return {}, f"{name}'s {weight.numel()} values do not fill whole {storage} elements of {record.per}"
        found[f"{name}.weight"] = record
    return found, None


def pack_on_meta(model: nn.Module, records: dict[str, QuantizedWeight]) -> None:
    """Give each of ``records``' layers a packed weight on the meta device, as quantization makes it, for FSDP2 to
    shard by rows."""
    for record in records.values():
        module = model.get_submodule(record.module)
        module.weight = bitsandbytes.nn.Params4bit(
            torch.empty((_numel(record.shape) // record.per, 1), dtype=record.storage, device="meta"),
            requires_grad=False, blocksize=record.blocksize, compress_statistics=record.nested,
            quant_type=record.quant_type, quant_storage=record.storage, module=module, bnb_quantized=True)


def quantize_local_part(files: CheckpointFiles, key: str, record: QuantizedWeight, first: int, rows: int,
                        device: torch.device):
    """Rows ``first`` to ``first + rows`` of the packed weight of checkpoint tensor ``key``, quantized on ``device``
    (where the rows are kept: a GPU quantizes in a blink what a CPU takes seconds for), and the scales of the blocks
    that start in them: ``(packed rows, absmax)``."""
    bitsandbytes.module()  # registers torch.ops.bitsandbytes
    total, size = _numel(record.shape), record.blocksize
    start, stop = first * record.per, min((first + rows) * record.per, total)
    low, high = start // size * size, min(-(-stop // size) * size, total)
    values = files.elements(key, low, high).to(device=device, dtype=record.dtype)
    packed, absmax = torch.ops.bitsandbytes.quantize_4bit.default(values, size, record.quant_type, record.storage)
    mine = packed.reshape(-1)[(start - low) // record.per:(stop - low) // record.per]
    blocks = slice(-(-start // size) - low // size, -(-stop // size) - low // size)
    return mine.reshape(-1, 1), absmax.reshape(-1)[blocks].float().cpu()


def exchange_scales(parts: dict[str, torch.Tensor], group=None) -> dict[str, torch.Tensor]:
    """Every rank's scales of each weight, put together in rank order (one exchange for all weights)."""
    if not (dist.is_available() and dist.is_initialized()):
        return parts
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, parts, group=group)
    return {key: torch.cat([theirs[key] for theirs in everyone]) for key in parts}


def quant_state(record: QuantizedWeight, absmax: torch.Tensor, device: torch.device):
    """bitsandbytes' ``QuantState`` of the whole weight from its whole ``absmax``, as ``quantize_4bit`` makes it."""
    QuantState = bnb_functional.QuantState
    absmax = absmax.to(device)
    code = bnb_functional.get_4bit_type(record.quant_type, device=device)
    if not record.nested:
        return QuantState(absmax=absmax, shape=torch.Size(record.shape), dtype=record.dtype,
                          blocksize=record.blocksize, code=code, quant_type=record.quant_type)
    offset = absmax.mean()
    nested, state2 = bnb_functional.quantize_blockwise(absmax - offset, blocksize=NESTED_BLOCKSIZE)
    return QuantState(absmax=nested, shape=torch.Size(record.shape), dtype=record.dtype, blocksize=record.blocksize,
                      code=code, quant_type=record.quant_type, offset=offset, state2=state2)


def _numel(shape: tuple[int, ...]) -> int:
    total = 1
    for size in shape:
        total *= size
    return total
