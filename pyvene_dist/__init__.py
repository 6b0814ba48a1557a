"""Make pyvene and pyreft train and infer under DataParallel, DDP, FSDP, DeepSpeed and device_map.

    import pyvene_dist
    pyvene_dist.patch()        # before building models; stock pyvene/pyreft/HF Trainer code then works

Importing this package changes nothing: only ``patch()`` does, and ``unpatch()`` undoes it exactly.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

__version__ = "0.1.0"
__all__ = ["patch", "unpatch", "patched", "is_patched", "__version__"]


def patch(*, allow_unsupported: bool | None = None) -> None:
    """Apply every fix. A second call changes nothing.

    Raises ``UnsupportedVersionError`` when pyvene, pyreft or transformers is outside the releases the
    fixes were written for, unless ``allow_unsupported=True`` or ``PYVENE_DIST_ALLOW_UNSUPPORTED=1``.
    """
    from . import _versions
    from ._registry import REGISTRY
    from .patches import concerns

    if REGISTRY.active:
        return
    _versions.check(allow_unsupported)
    try:
        for concern in concerns():
            concern.patch(REGISTRY)
    except BaseException:
        REGISTRY.restore_all()
        raise
    REGISTRY.active = True


def unpatch() -> None:
    """Put back every object ``patch()`` replaced. Without a prior ``patch()`` it does nothing."""
    from ._registry import REGISTRY

    REGISTRY.restore_all()


def is_patched() -> bool:
    from ._registry import REGISTRY

    return REGISTRY.active


@contextlib.contextmanager
def patched(*, allow_unsupported: bool | None = None) -> Iterator[None]:
    """``with pyvene_dist.patched(): ...`` -- patched inside, as it was before outside."""
    already = is_patched()
    patch(allow_unsupported=allow_unsupported)
    try:
        yield
    finally:
        if not already:
            unpatch()
