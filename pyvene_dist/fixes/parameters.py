"""Let wrappers see the whole model: ``BaseModel.named_parameters`` behaves like ``nn.Module``'s again.

pyvene 0.1.8 overrides ``named_parameters(recurse=True)`` to return a list of the trainable parameters
only, named without their ``interventions.`` prefix. ``nn.Module.parameters()`` calls it, so every
wrapper sees a model without its frozen base. What users see today:

- ``nn.DataParallel``: ``KeyError: Parameter containing: ...`` in ``torch/nn/parallel/replicate.py``;
- HF Trainer with ``fsdp=``: ``TypeError: BaseModel.named_parameters() got an unexpected keyword
  argument 'remove_duplicate'``;
- DeepSpeed ZeRO-3: runs, but partitions none of the base model's parameters.

The fix restores ``nn.Module``'s generator, signature (``prefix``, ``recurse``, ``remove_duplicate``) and
standard names (``model.…``, ``interventions.<key>.…``). Optimizers still get only what trains: HF
Trainer keeps parameters with ``requires_grad``, and ``get_trainable_parameters`` is unchanged.
"""

from __future__ import annotations

from pyvene.models.intervenable_base import BaseModel

from .._records import Fix, Site
from ..mechanisms.module_methods import nn_module_method

#: The wrapper of ``BaseModel.named_parameters``.
_wrap_named_parameters = nn_module_method("named_parameters")
FIX = Fix(
    __name__,
    sites=(Site((BaseModel, "named_parameters"), _wrap_named_parameters, kind="replace"),),
    upstream=("pyvene",),
)

