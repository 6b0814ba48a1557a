"""The optional packages, named at the top of the modules that use them and imported at their first use.

pyreft is optional (installed apart, with ``--no-deps``: ``REFT_INSTALL``), and a user who calls
``pyvene_dist.patch()`` before importing it has its trainers patched as it is imported (the fixes of pyreft's
trainers wait for its import): a module of this package that imported it at its top would import it before the
user chose to. deepspeed, bitsandbytes, accelerate and lm-eval are extras, and transformers' trainer costs
seconds to import, which ``import pyvene_dist`` must not. A module says what it needs in its first lines::

    zero_utils = OnFirstUse("deepspeed.utils", DEEPSPEED_INSTALL)

and ``zero_utils.safe_get_full_grad`` imports ``deepspeed.utils`` when it is first read: where the package is
missing, that read raises ``ImportError`` naming the module and how to install it.
"""

from __future__ import annotations

import importlib
import types

#: How to install pyreft: its runtime needs from the extra, then pyreft alone (its own requirements pin
#: transformers 4.45.1 and pull in jupyter and wandb, none of which it imports).
REFT_INSTALL = 'pip install "pyvene_dist[reft]" && pip install --no-deps pyreft==0.1.0'
DEEPSPEED_INSTALL = 'pip install "pyvene_dist[deepspeed]"'
ACCELERATE_INSTALL = 'pip install "pyvene_dist[accelerate]"'
QUANTIZE_INSTALL = 'pip install "pyvene_dist[quantize]"'
EVAL_INSTALL = 'pip install "pyvene_dist[eval]"'


class OnFirstUse:
    """A module imported when one of its attributes is first read, and read afresh from ``sys.modules`` at every
    read after (so a test's ``mock.patch`` of the module's attribute is seen). ``install`` says how to get it."""

    def __init__(self, name: str, install: str) -> None:
        self._name = name
        self._install = install

    def module(self) -> types.ModuleType:
        try:
            return importlib.import_module(self._name)
        except ImportError as exc:
            raise ImportError(f"{self._name} is needed here and is not installed: {self._install}") from exc

    def __getattr__(self, attribute: str):
        return getattr(self.module(), attribute)

    def __repr__(self) -> str:
        return f"<{self._name}, imported on first use>"


#: pyreft's trainers and HF's, for the fixes of their methods: those fixes wait for the modules' import (by the user,
#: or by pyreft), and read them here when a patched method runs, never importing them first.
pyreft_trainers = OnFirstUse("pyreft.reft_trainer", REFT_INSTALL)
hf_trainer = OnFirstUse("transformers.trainer", "pip install transformers")


def import_pyreft(needed_by: str = "pyvene_dist.testing builds ReFT models") -> types.ModuleType:
    """The ``pyreft`` module, imported now; ``ImportError`` saying ``needed_by`` and ``REFT_INSTALL`` without it."""
    try:
        return importlib.import_module("pyreft")
    except ImportError as exc:
        raise ImportError(f"{needed_by} with pyreft, which is not installed: {REFT_INSTALL}") from exc
