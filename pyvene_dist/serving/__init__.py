"""Serving ReFTs: several ReFTs on one base model, each request naming its own or none (docs/serving.md).

- ``MultiReftModel`` (``multi_reft``): the base and its ReFTs; ``generate`` of a padded batch whose rows each
  name a ReFT, and ``init_continuous_batching`` / ``generate_batch`` on transformers' continuous batching, each
  request naming its ReFT in ``add_request`` (``ReftBatchingManager``, ``batching``; how a step applies the ReFTs:
  ``continuous``). A request it refuses raises ``ReftRequestError``.
- ``build_app`` (``openai_api``): transformers' OpenAI-compatible server over a ``MultiReftModel``;
  ``pyvene-dist serve`` (``command``) starts it. It needs the serve extra (fastapi), which is imported when
  ``build_app`` is first read, never by importing this package.
"""

from .batching import ReftBatchingManager
from .continuous import ReftRequestError
from .multi_reft import ASSISTED, EAGER_CACHES, SETTINGS, Intervention, LoadedReft, MultiReftModel

__all__ = ("ASSISTED", "EAGER_CACHES", "SETTINGS", "Intervention", "LoadedReft", "MultiReftModel",
           "ReftBatchingManager", "ReftRequestError", "build_app")


def __getattr__(name: str):
    if name == "build_app":
        from .openai_api import build_app  # optional: the serve extra (fastapi)

        return build_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
