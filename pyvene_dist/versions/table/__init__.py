"""The forms of the functions pyvene_dist's fixes depend on (``versions.forms``), one generated module per
distribution (``forms_pyreft.py``, ``forms_pyvene.py``, ``forms_torch.py``, ``forms_transformers.py``), which
``python -m pyvene_dist.fix_list --record`` writes (``forms.write``). ``KNOWN`` and ``FILES`` are their
tables together, the one table ``forms`` reads."""

from __future__ import annotations

import importlib
import pkgutil
from typing import Final


def _together(name: str) -> dict:
    """Table ``name`` of every module here, in one dict (the distributions' targets do not overlap)."""
    found: dict = {}
    for module in sorted(module.name for module in pkgutil.iter_modules(__path__) if module.name.startswith("forms_")):
        found.update(getattr(importlib.import_module(f"{__name__}.{module}"), name))
    return found


#: Target -> {source fingerprint: the releases it was seen and tested with}.
KNOWN: Final = _together("KNOWN")
#: Module -> {digest of a file recorded: {function: its fingerprint there}}: a file as recorded is not read.
FILES: Final = _together("FILES")
