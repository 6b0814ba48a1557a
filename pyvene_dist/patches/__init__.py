"""One module per failure mode. Each has ``SITES`` (the symbols it wraps) and ``patch(registry)``.

The order is the order ``patch()`` applies them; ``unpatch()`` restores in reverse.
"""

from __future__ import annotations

import importlib
from types import ModuleType

CONCERNS = (
    "representations",
    "parameters",
    "train_mode",
    "hooks",
    "checkpointing",
    "devices",
    "data_parallel",
    "device_map",
    "consistency",
    "fsdp",
    "deepspeed",
    "wrapper_attributes",
    "trainer",
    "checkpoints",
    "weight_decay",
)


def concerns() -> list[ModuleType]:
    return [importlib.import_module(f"{__name__}.{name}") for name in CONCERNS]
