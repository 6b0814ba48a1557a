"""Public test helpers: the parity harness and the multi-process launcher behind the pytest plugin.

Use them to test your own interventions::

    from pyvene_dist.testing import ParityCase, train, assert_parity

The harness in parts: ``case`` (what to train, ``Record``, ``Tolerance``), ``runners`` and
``mesh_runners`` (the strategies), ``requirements`` (what each needs of the machine), ``strategies``
(``STRATEGIES``), ``training`` (``train``) and ``comparison`` (``assert_parity``).
"""

from .._moved_modules import old_names_folder
from .case import DEEPSPEED_BF16, TOLERANCES, ParityCase, Record, Tolerance, tolerance
from .comparison import Differences, assert_parity, differences, intervention_grads, intervention_weights
from .launch import WorldOutcome, spawn
from .strategies import STRATEGIES
from .runners import Strategy
from .training import train

__path__.append(old_names_folder(__file__))  # the harness's old module names, last (``_moved_modules``)

__all__ = (
    "DEEPSPEED_BF16",
    "STRATEGIES",
    "TOLERANCES",
    "Differences",
    "ParityCase",
    "Record",
    "Strategy",
    "Tolerance",
    "WorldOutcome",
    "assert_parity",
    "differences",
    "intervention_grads",
    "intervention_weights",
    "spawn",
    "tolerance",
    "train",
)
