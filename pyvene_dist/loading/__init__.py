"""Sharded loading: every rank reads and keeps its own share of a model's weights, from ``from_pretrained`` to the
first step, so that a model no one process could hold can be loaded at all.

Under ``pyvene_dist.patch()`` this happens by itself, through the user's unchanged script:

- **FSDP2** (accelerate's plugin, HF Trainer's ``--fsdp``) with ``cpu_ram_efficient_loading`` on: ``from_pretrained``
  builds the model on the meta device on every rank, rank 0 too, and each rank reads its rows of each weight from
  the memory-mapped safetensors when ``fully_shard`` has sharded the model; FSDP2 without it is refused by
  ``from_pretrained``, naming the flag (``docs/loading.md``).
- **ZeRO-3** (HF Trainer's ``--deepspeed`` with a stage-3 config, ``TrainingArguments`` made before
  ``from_pretrained``): ``zero.Init`` partitions the model as transformers builds it, and each rank copies its
  partition of each weight from the files, where transformers read every file on rank 0 and gathered each weight.
- **FSDP2 by hand**: ``with pyvene_dist.loading.sharded(): from_pretrained(...)``, then ``fully_shard``.

``PYVENE_DIST_SHARDED_LOADING=0`` (or ``patch(sharded_loading=False)``) turns it off: transformers loads as it does.
"""

from .._registry import MODELS
from .checkpoint_files import CheckpointFiles, has_safetensors
from .fill import ShardedLoadingError, local_bytes, whole_bytes
from .record import ShardedLoad, sharded

__all__ = ("CheckpointFiles", "ShardedLoad", "ShardedLoadingError", "has_safetensors", "local_bytes", "report",
           "sharded", "whole_bytes")


def report(model) -> ShardedLoad | None:
    """The sharded load of ``model`` or of the first module inside it loaded so (None where there is none):
    ``how``, ``filled`` (tensors, elements and bytes this rank holds) and ``bytes_read`` (what it read)."""
    for module in model.modules():
        found = MODELS.get(module, ShardedLoad)
        if found is not None:
            return found
    return None
