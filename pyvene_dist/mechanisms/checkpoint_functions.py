"""Which layers of a model recompute their forward in backward, and whether such a forward runs here now.

``checkpoint_functions(model)`` finds where each checkpointing layer keeps its checkpoint function (the gradient
checkpointing fix swaps them for the length of a training forward; the fast path asks whether there are any).
``APPLYING`` is the forward whose interventions apply now in this thread (set by ``fixes.gradient_checkpointing``);
``in_checkpointed_forward()`` reads it for the code that must save the same tensors in a forward and its
recomputation (``fixes.orthogonal`` stays eager there). Without that fix nothing sets it: never inside one.
"""

from __future__ import annotations

import contextvars
from typing import Any

#: The forward whose interventions apply now in this thread: the one running, or the one whose
#: checkpointed layer backward is recomputing. None outside both, where every kept hook is inert.
APPLYING: contextvars.ContextVar[Any] = contextvars.ContextVar("pyvene_dist_applying", default=None)


def in_checkpointed_forward() -> bool:
    """Whether a checkpointing model's training forward, or a recomputation of one, is running here.

    What runs inside must save the same tensors both times; ``orthogonal`` stays eager there, since a
    rotation captured between the forward and its recomputation would save fewer (torch's
    ``CheckpointError``: "A different number of tensors was saved", seen on an H200).
    """
    return APPLYING.get() is not None


def checkpoint_functions(model) -> list[tuple[object, str]]:
    """Where the layers of ``model`` that recompute their forward during backward keep their checkpoint
    function: ``(module, "_gradient_checkpointing_func")`` for a transformers module with
    ``gradient_checkpointing`` set, ``(module, "checkpoint_fn")`` for torch's ``CheckpointWrapper``.

    A module flagged as checkpointing that keeps no such function (transformers' checkpointing format
    before 4.35, which calls ``torch.utils.checkpoint`` itself) raises: its recomputation could not be
    told apart from another forward's.

    It runs at every training forward, over every module: an explicit stack over ``_modules`` and the
    instance's own ``__dict__`` cost a fifth of ``model.modules()`` (a generator per level of nesting)
    with ``getattr`` (``nn.Module.__getattr__``'s search for each module lacking the attribute)."""
    found = []
    stack = [model]
    while stack:
        module = stack.pop()
        if module is None:  # a child slot registered empty
            continue
        own = module.__dict__
        flag = own.get("gradient_checkpointing", _UNSET)
        if flag is _UNSET:
            flag = getattr(type(module), "gradient_checkpointing", False)
        if type(module).__name__ == "CheckpointWrapper" and "checkpoint_fn" in own:
            found.append((module, "checkpoint_fn"))
        elif flag is True:
            if "_gradient_checkpointing_func" not in own:
                raise RuntimeError(
                    f"pyvene_dist: a {type(module).__name__} has gradient_checkpointing on but no "
                    "_gradient_checkpointing_func (transformers' format before 4.35, which calls "
                    "torch.utils.checkpoint itself): backward's recomputation of its layers cannot be matched "
                    "to the pyvene forward that ran them, so interventions would be silently wrong. Enable "
                    "checkpointing with gradient_checkpointing_enable() of a current transformers, wrap the "
                    "layers with torch's checkpoint_wrapper, or turn checkpointing off."
                )
            found.append((module, "_gradient_checkpointing_func"))
        stack.extend(module._modules.values())
    return found


_UNSET = object()
