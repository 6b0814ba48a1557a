"""pyreft's trainers take ``tokenizer=``, as pyreft's README and examples pass it, on transformers 5.

transformers 5 renamed ``Trainer.__init__``'s ``tokenizer`` keyword ``processing_class`` (4.46 to 4.x took both):
``TypeError: Trainer.__init__() got an unexpected keyword argument 'tokenizer'``. pyreft's trainers
(``ReftTrainer`` and its subclasses, not HF Trainer for anyone else) take ``tokenizer=`` as ``processing_class``
where ``Trainer`` lacks it.

pyreft is patched when (and if) it is imported.
"""

from __future__ import annotations

import inspect

from ..._optional import hf_trainer
from ..._records import Fix
from ...mechanisms.trainer_steps import BEFORE_INIT, step_sites


def _take_tokenizer_as_processing_class(trainer, kwargs: dict) -> None:
    """``kwargs``' ``tokenizer`` given as ``processing_class`` where ``Trainer.__init__`` has no ``tokenizer``."""
    if "tokenizer" not in kwargs or _trainer_takes_tokenizer():
        return
    if kwargs.get("processing_class") is not None:
        raise TypeError(f"{type(trainer).__name__}: pass tokenizer= or processing_class=, not both")
    kwargs["processing_class"] = kwargs.pop("tokenizer")


def _trainer_takes_tokenizer() -> bool:
    return "tokenizer" in inspect.signature(hf_trainer.Trainer.__init__).parameters


FIX = Fix(
    __name__,
    sites=step_sites(BEFORE_INIT, __name__, _take_tokenizer_as_processing_class),
    upstream=("pyreft",),
)
