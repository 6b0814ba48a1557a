"""One checkpoint folder per session, and one world per strategy, made the first time a test asks for it."""

import pytest

import suite


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    return suite.make_checkpoint(tmp_path_factory.mktemp("workloads") / "checkpoint")


@pytest.fixture(scope="session")
def worlds(checkpoint):
    """``worlds(strategy)``: every case's ``suite.Run`` (or traceback) from ``strategy``'s one world."""
    made = {}

    def get(strategy):
        if strategy not in made:
            made[strategy] = suite.world(checkpoint, strategy, suite.cases_for(strategy))
        return made[strategy]

    return get
