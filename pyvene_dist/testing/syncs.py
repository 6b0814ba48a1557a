"""Where a step makes the host wait for the GPU: CUDA's sync debug mode, with each sync's Python stack."""

from __future__ import annotations

import os
import traceback
import warnings
from typing import Callable

import torch


def host_device_syncs(step: Callable[[], object]) -> list[traceback.StackSummary]:
    """Run ``step`` once (after the GPU has drained) and return the stack of every synchronising CUDA
    call it made, innermost frame last. CUDA's detection is a prototype: it can miss some."""
    syncs = []

    def keep(message, *_, **__):
        if "synchronizing CUDA operation" not in str(message):
            return  # another warning raised during the step (a deprecation, say)
        syncs.append(traceback.StackSummary.from_list(
            [frame for frame in traceback.extract_stack()[:-1] if not frame.filename.endswith("warnings.py")]
        ))

    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = keep
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return syncs


def innermost_outside_torch(stack: traceback.StackSummary) -> traceback.FrameSummary:
    """The frame that called into torch: whose code asked for the sync. torch's frames are those under its
    package folder (a path merely containing "torch", such as an environment's, is not torch)."""
    folder = os.path.dirname(torch.__file__) + os.sep
    return next(frame for frame in reversed(stack) if not os.path.abspath(frame.filename).startswith(folder))
