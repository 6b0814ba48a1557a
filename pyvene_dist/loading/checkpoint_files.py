"""A model folder's safetensors files, memory-mapped: each tensor's shape and dtype from the files' headers, and
reads of one part of a tensor -- a block of its rows and columns, or a range of its flattened elements -- that touch
that part's bytes and no others.

    files = CheckpointFiles.in_folder("path/to/model")          # model.safetensors, or the index of its shards
    files.block("model.layers.0.mlp.up_proj.weight", (1024, 0), (1024, 4096))   # rows 1024..2047
    files.elements("model.norm.weight", 0, 512)                 # a ZeRO-3 partition: a flat range
    files.bytes_read                                            # what this process read, counted from the tensors

safetensors lays each tensor out row-major and contiguous, so a block of whole rows (FSDP2's shard of dimension 0)
and a flat range (a ZeRO-3 partition) are each one run of bytes in the file: a rank reads its share of the model
and the operating system maps in the pages of that share. Every read is counted, so that a test can say what a
rank read without judging its memory."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Final, Iterable, Sequence

import torch
from safetensors import safe_open

#: The safetensors header's dtype names.
DTYPES: Final = {
    "F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
#: A model folder's weights in safetensors: one file, or the index of several.
SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"


def has_safetensors(folder: str | Path) -> bool:
    """Whether a model folder holds its weights as safetensors (``model.safetensors`` or their index)."""
    folder = Path(folder)
    return (folder / INDEX).is_file() or (folder / SINGLE).is_file()


class CheckpointFiles:
    """The tensors of ``files`` (safetensors), read in parts. Each file is opened (memory-mapped) on first use and
    kept open until ``close()``; ``bytes_read`` counts the bytes of every tensor a read returned."""

    def __init__(self, files: Iterable[str | Path]):
        self.files = tuple(str(file) for file in files)
        if not self.files:
            raise ValueError("CheckpointFiles: files=(): expected at least one .safetensors file")
        not_safetensors = [file for file in self.files if not file.endswith(".safetensors")]
        if not_safetensors:
            raise ValueError(f"CheckpointFiles: {not_safetensors[0]} is not a .safetensors file; only safetensors "
                             "can be read in parts")
        self._handles: dict[str, object] = {}
        self._where: dict[str, str] = {}
        for file in self.files:
            for name in self._handle(file).keys():
                self._where[name] = file
        self.bytes_read = 0

    @classmethod
    def in_folder(cls, folder: str | Path) -> "CheckpointFiles | None":
        """The safetensors weights of a model folder (``model.safetensors`` or its index); None where it has none."""
        folder = Path(folder)
        if not has_safetensors(folder):
            return None
        if (folder / INDEX).is_file():
            index = json.loads((folder / INDEX).read_text())
            return cls(folder / name for name in dict.fromkeys(index["weight_map"].values()))
        return cls([folder / SINGLE])

    def _handle(self, file: str):
        if file not in self._handles:
            self._handles[file] = safe_open(file, framework="pt", device="cpu", backend="pread")
        return self._handles[file]

    def _slice(self, name: str):
        if name not in self._where:
            raise KeyError(f"{name!r} is not in {', '.join(self.files)}")
        return self._handle(self._where[name]).get_slice(name)

    def __contains__(self, name: object) -> bool:
        return name in self._where

    def names(self) -> list[str]:
        return list(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def dtype(self, name: str) -> torch.dtype:
        found = self._slice(name).get_dtype()
        if found not in DTYPES:
            raise TypeError(f"{name!r} is stored as {found}, which pyvene_dist cannot read in parts; known: "
                            f"{', '.join(DTYPES)}")
        return DTYPES[found]

    def block(self, name: str, offsets: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
        """The block of tensor ``name`` starting at ``offsets`` of ``sizes`` (one of each per dimension)."""
        shape = self.shape(name)
        if len(offsets) != len(shape) or len(sizes) != len(shape) or any(
                offset < 0 or size < 0 or offset + size > whole for offset, size, whole in zip(offsets, sizes, shape)):
            raise ValueError(f"{name!r} of shape {shape}: no block at offsets {tuple(offsets)} of sizes {tuple(sizes)}")
        if not shape:
            return self._count(self._handle(self._where[name]).get_tensor(name))
        return self._count(self._slice(name)[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))])

    def elements(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Elements ``start`` to ``stop`` of tensor ``name`` flattened (row-major), one dimension: the whole rows
        that hold them are read, at most two rows more than the range."""
        shape = self.shape(name)
        total = math.prod(shape)
        if not 0 <= start <= stop <= total:
            raise ValueError(f"{name!r} has {total} elements: no range {start}..{stop}")
        if start == stop:  # a rank past the end of a small tensor (ZeRO-3 pads the last partitions)
            return torch.empty(0, dtype=self.dtype(name))
        if not shape:
            return self.block(name, (), ()).reshape(1)[start:stop]
        row = total // shape[0]
        first, last = start // row, -(-stop // row)
        rows = self._slice(name)[first:last].reshape(-1)
        self.bytes_read += rows.numel() * rows.element_size()
        return rows[start - first * row: stop - first * row]

    def _count(self, tensor: torch.Tensor) -> torch.Tensor:
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor

    def close(self) -> None:
        """Unmap every file (a read after this opens it again)."""
        handles, self._handles = self._handles, {}
        for handle in handles.values():
            handle.__exit__(None, None, None)

    def __repr__(self) -> str:
        return f"CheckpointFiles({len(self.files)} files, {len(self._where)} tensors, {self.bytes_read} bytes read)"
