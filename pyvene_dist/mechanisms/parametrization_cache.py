"""``torch.nn.utils.parametrize.cached()`` entered and left under a lock.

PyTorch keeps that cache in module globals (a counter of open contexts and one dict), and applications run off the
main thread too (checkpointed recomputation runs on the autograd engine's device thread, a server's threads), so
entering and leaving is serialised. ``fixes.parametrizations`` enters it around each intervention's application,
the fast path and ``serving`` around a whole forward.
"""

from __future__ import annotations

import contextlib
import threading

from torch.nn.utils import parametrize

_lock = threading.Lock()


@contextlib.contextmanager
def cached_parametrizations():
    """``torch.nn.utils.parametrize.cached()``, entered and left under the lock (``fixes.fast_path`` enters
    it once around a whole forward)."""
    context = parametrize.cached()
    with _lock:
        context.__enter__()
    try:
        yield
    finally:
        with _lock:
            context.__exit__(None, None, None)
