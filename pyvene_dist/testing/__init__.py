"""Public test helpers: the parity harness and the multi-process launcher behind the pytest plugin.

Use them to test your own interventions::

    from pyvene_dist.testing import ParityCase, train, assert_parity
"""

from .launch import WorldOutcome, spawn
from .parity import (
    STRATEGIES,
    TOLERANCES,
    Differences,
    ParityCase,
    Record,
    Strategy,
    Tolerance,
    assert_parity,
    differences,
    train,
)

__all__ = [
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
    "spawn",
    "train",
]
