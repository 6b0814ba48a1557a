"""What the checkpoints fixes write and read: the files' names, the one reader (``read_saved``) that names an
unreadable file, and the CPU copies every file holds.

A load of a folder with an empty or corrupt file (``intkey_*.bin``, ``pytorch_model.bin``, the states file)
failed with a bare ``EOFError``, or with torch's advice to retry with ``weights_only=False``, which would run
whatever code the file holds. Every file is read with ``weights_only=True``, and one that cannot be read raises
``UnreadableCheckpointError``, naming the file, what it holds and what to do.
"""

from __future__ import annotations

import os
import pickle

import torch
from torch import nn

#: Written by ``save_intervention`` beside pyreft's files: the exact state of every intervention.
STATES_FILE = "intervention_states.bin"
#: The same, written by ``save`` beside pyvene's files (not a ``.bin``: pyvene's own tests count those).
SAVED_STATES_FILE = "intervention_states.pt"
#: pyvene's file of the base model's trainable weights (``include_model``), each whole.
MODEL_FILE = "pytorch_model.bin"
#: The folder of a ``ReftTrainer`` checkpoint that holds the interventions.
INTERVENTIONS_DIR = "intervenable_model"


class UnreadableCheckpointError(ValueError):
    """A saved file that ``torch.load(..., weights_only=True)`` cannot read."""


def read_saved(path: str, map_location="cpu") -> dict:
    """``torch.load(path, weights_only=True)``, or an ``UnreadableCheckpointError`` naming ``path``, what it holds
    and what to do: never torch's advice to load it with ``weights_only=False``, which runs the file's own code."""
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except FileNotFoundError:
        raise
    except (EOFError, RuntimeError, ValueError, OSError, pickle.UnpicklingError) as error:
        size = os.path.getsize(path)
        if size == 0:
            found = "it is empty (0 bytes)"
        elif isinstance(error, EOFError):
            found = f"it is cut short ({size} bytes)"
        else:
            found = f"its {size} bytes are not a state dict torch.save wrote"
        raise UnreadableCheckpointError(
            f"{path} cannot be read: {found} ({type(error).__name__}); expected a state dict that ReftModel.save or "
            "save_intervention wrote, read with weights_only=True. Save the interventions again (or copy the "
            "folder again, if a transfer cut it short)") from None


def check_readable(directory: str) -> None:
    """Read the files pyvene's ``load`` reads with a bare ``torch.load`` (the ``intkey_*.bin``) before it does: an
    unreadable one is named here. The states file and the base model's file are read once, later, through
    ``read_saved``, which names them the same way (and before the user's model is touched)."""
    for name in sorted(name for name in os.listdir(directory) if name.startswith("intkey_") and name.endswith(".bin")):
        read_saved(os.path.join(directory, name))


def device_of(module: nn.Module) -> torch.device:
    for tensor in (*module.parameters(), *module.buffers()):
        return tensor.device
    return torch.device("cpu")


def cpu_copies(state: dict) -> dict:
    """``state`` with each tensor a CPU copy: what every saved file holds, wherever the weights were (pyvene's
    ``load`` passes no ``map_location``, so CUDA tensors in a file fail on a machine without a GPU)."""
    return {key: value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value
            for key, value in state.items()}
