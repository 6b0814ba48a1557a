"""``intervention[0]`` is the intervention, so the examples' ``v[0].eval()`` runs on pyvene 0.1.8.

Before 0.1.8 pyvene kept ``model.interventions`` as a dict of ``(intervention, hook)`` pairs, and
pyreft's examples and original code still switch the interventions to evaluation with::

    for k, v in reft_model.interventions.items():
        _ = v[0].eval()

(``examples/loreft/train.py``, ``examples/reward/train.py``, ``original_code/``, the PEFT notebook, and
pyreft's own ``ReftTrainerForSequenceClassification.evaluate``, which ``fixes.pyreft_trainer`` replaces). On
0.1.8 ``interventions`` is an ``nn.ModuleDict`` of the interventions themselves, and the examples stop
after training with ``TypeError: 'LoreftIntervention' object is not subscriptable``.

The fix gives pyvene's ``Intervention``, the base of every pyvene and pyreft intervention, a
``__getitem__``: index 0 is the intervention itself; any other index raises ``IndexError`` saying that
the hook of the old pair lives in ``model.intervention_hooks[key]``.

What ``__getitem__`` does to iteration: a class with ``__getitem__`` and no ``__iter__`` is iterable by
Python's sequence protocol (``iter()`` asks for items 0, 1, ... until ``IndexError``). An intervention,
which an ``nn.Module`` was not, now iterates as a one-item sequence holding itself: ``list(v) == [v]``,
``v in v`` is True, ``(intervention,) = v`` unpacks, and ``intervention, hook = v`` fails with "not
enough values to unpack" instead of ``TypeError``. It has no ``len()``, and it is still no
``collections.abc.Iterable`` or ``Sequence`` (those look for ``__iter__``), so code that tells modules
from containers by ``isinstance`` sees no change. Defining ``__iter__ = None`` would keep iteration
refused, but then ``for`` over the old pairs (``for intervention in v``) would fail where it ran before.
Only ``Intervention`` changes; ``nn.Module`` and a user's own intervention module not derived from it
are left as they are.
"""

from __future__ import annotations

from pyvene.models.interventions import Intervention

from .._records import Fix, Site


def first_of_the_old_pair(self, index):
    if index == 0:
        return self
    raise IndexError(
        f"{type(self).__name__}[{index!r}]: model.interventions holds the interventions themselves since pyvene "
        "0.1.8, not (intervention, hook) pairs; [0] is the intervention, its hook is model.intervention_hooks[key]"
    )


FIX = Fix(
    __name__,
    sites=(Site((Intervention, "__getitem__"), first_of_the_old_pair, kind="add"),),
    upstream=("pyvene",),
)
