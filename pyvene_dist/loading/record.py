"""What a sharded load keeps on the model it loads (``MODELS.of(model, ShardedLoad)``), and the switch that asks
for one by hand (``sharded()``).

A model loaded for FSDP2 stays on the meta device until ``fully_shard`` has sharded it: the state holds where its
weights are (``files``), which tensor of the files each of its tensors is (``names``), and, once filled, what this
rank read and holds. A model loaded under ZeRO-3 is filled as it is loaded; its state keeps the same record.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Iterator

from .checkpoint_files import CheckpointFiles
from .fill import Filled

#: Set by ``sharded()``: ``from_pretrained`` inside it loads for FSDP2 whatever the launch says.
ASKED: contextvars.ContextVar[bool] = contextvars.ContextVar("pyvene_dist_sharded_loading", default=False)


@contextlib.contextmanager
def sharded() -> Iterator[None]:
    """``from_pretrained`` inside this block builds the model on the meta device, every rank alike, and records its
    safetensors files; each rank reads its own shard when ``fully_shard`` has sharded the whole model (FSDP2 by
    hand). Needs ``pyvene_dist.patch()``; under a launcher's FSDP2 with ``cpu_ram_efficient_loading`` and under
    ZeRO-3 the same happens without it.

        with pyvene_dist.loading.sharded():
            model = AutoModelForCausalLM.from_pretrained(folder)
        reft_model = pyreft.get_reft_model(model, config)
        fully_shard_model(reft_model)          # each rank reads its shard here
    """
    token = ASKED.set(True)
    try:
        yield
    finally:
        ASKED.reset(token)


@dataclasses.dataclass(eq=False)
class ShardedLoad:
    """A model's sharded load: its files, the files' name of each of its tensors, how it is sharded (``"fsdp2"``:
    filled once ``fully_shard`` sharded it; ``"zero3"``: filled by ``from_pretrained``), and what was filled."""

    files: CheckpointFiles | None = None
    names: dict = dataclasses.field(default_factory=dict)
    how: str = ""
    filled: Filled | None = None
    #: The 4-bit weights, by name: how each is quantized (``loading.four_bit``).
    quantized: dict = dataclasses.field(default_factory=dict)
    #: Bytes this rank read from the files, counted from the tensors read (set when filled).
    bytes_read: int = 0

    @property
    def pending(self) -> bool:
        return self.files is not None and self.filled is None

    def close(self) -> None:
        if self.files is not None:
            self.files.close()
