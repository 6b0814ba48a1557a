"""``model.zero_grad()`` clears every gradient of the model, the base model's trainable weights included.

pyvene 0.1.8 overrides ``zero_grad()`` to clear the interventions' gradients only. HF Trainer clears
gradients with ``model.zero_grad()`` after every optimizer step, so a base-model weight that trains
beside the interventions keeps summing its gradients from step to step in one process: the GLUE
classifier head of pyreft's ``examples/loreft/train.py --allow_cls_grad`` and the reward model's score
head of ``examples/reward/train.py``. No error: the head's gradient at step *k* is the sum of steps 1
to *k* (its norm grew 0.085, 0.184, 0.266, 0.350 over four steps of the reward example), and the run
trains a different model. Under DDP the wrapper's ``zero_grad`` (``nn.Module``'s) clears everything,
so one process and DDP disagreed.

The fix is ``nn.Module.zero_grad``, with its signature (``set_to_none=True``), on the whole model: the
wrapper, the base model and every intervention. pyvene's own ``set_zero_grad()`` is left as it is.
"""

from __future__ import annotations

from pyvene.models.intervenable_base import BaseModel

from .._records import Fix, Site
from ..mechanisms.module_methods import nn_module_method

#: The wrapper of ``BaseModel.zero_grad``.
_wrap_zero_grad = nn_module_method("zero_grad")
FIX = Fix(
    __name__,
    sites=(Site((BaseModel, "zero_grad"), _wrap_zero_grad, kind="replace"),),
    upstream=("pyvene",),
)

