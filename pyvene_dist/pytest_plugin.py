"""pytest plugin: run a test body in every rank of a process group, at each world size asked for.

    @pytest.mark.world_size(1, 2)
    def test_ddp_matches_one_process(tmp_path):
        ...  # runs twice: in 1 forked process, then in 2; torch.distributed is initialised

    @pytest.mark.gpus(2)
    def test_data_parallel(): ...  # skipped, saying so, on a machine with fewer than 2 GPUs

    @pytest.mark.ranks(2)
    def test_under_torchrun(): ...  # starts 2 ranks itself: skipped on a machine with 1 GPU (gloo on CPU runs)

Marker ``world_size(*sizes, backend=None, timeout=None, grace=20, fresh=False)``. The backend is
``--world-backend`` (``auto``: nccl on a machine with GPUs, gloo on one without); a size that needs more GPUs
than the machine has is skipped with the number it needs. ``timeout`` (default ``--world-timeout``, 300 s)
bounds the test's run: past it, every live rank's stack is printed and the test fails. When one rank fails or
skips, the others get ``grace`` seconds to report before they count as stuck in a collective it will never
join (their stacks are printed).

The ranks of a world stay up for the next test of the same size and backend (``testing.worlds``: their
start-up is paid once per session), and put back between tests what a test may
leave (environment, working directory, ``pyvene_dist.patch()``, accelerate's state). A failed test ends
its world. ``fresh=True``, or ``--fresh-worlds`` for every test, runs the test in processes of its own.
Fixture values are computed in the parent and pickled to each rank (``tmp_path`` works); one that
cannot be pickled (``capsys``, ``request``, a lambda in ``parametrize``) fails the test with one line
naming it.

Loaded through the ``pytest11`` entry point as ``pyvene_dist``; ``-p pyvene_dist.pytest_plugin`` and
``pytest_plugins = ["pyvene_dist.pytest_plugin"]`` load the same module once. Importing it imports
nothing but pytest.
"""

from __future__ import annotations

import atexit
import gc
import inspect
import pickle
import sys
import tempfile

import pytest

WORLD_SIZE_ARG = "world_size"
#: The names pytest may register this module under: the entry point's and the module's own.
NAMES = ("pyvene_dist", __name__)
#: Seconds the other ranks get to report once one failed or skipped (the marker's ``grace``), as ``spawn``'s default.
GRACE = 20.0


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    """Called as this module is registered: block its other name, so that pytest, meeting the module
    again under that name (``-p`` is read before entry points, conftest ``pytest_plugins`` after), skips
    it instead of stopping with "Plugin already registered under a different name"."""
    registered = pluginmanager.get_name(sys.modules[__name__])
    for name in NAMES:
        if name != registered and pluginmanager.get_plugin(name) is None:
            pluginmanager.set_blocked(name)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("pyvene_dist", "multi-process tests (pyvene_dist)")
    group.addoption(
        "--world-backend",
        choices=("auto", "gloo", "nccl"),
        default="auto",
        help="process-group backend for @pytest.mark.world_size tests (default: auto)",
    )
    group.addoption(
        "--fresh-worlds",
        action="store_true",
        help="start new processes for every @pytest.mark.world_size test instead of reusing a world's",
    )
    group.addoption(
        "--world-timeout",
        type=float,
        default=300.0,
        help="seconds a @pytest.mark.world_size test may run before every rank's stack is dumped (default: 300)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "world_size(*sizes, backend=None, timeout=None, grace=20, fresh=False): run the test body in a process "
        "group of each size (grace: seconds the other ranks get to report once one failed or skipped; fresh: in "
        "processes of its own, not a world kept from earlier tests)",
    )
    config.addinivalue_line("markers", "gpus(n): skip unless the machine has at least n CUDA GPUs")
    config.addinivalue_line(
        "markers",
        "ranks(n): the test starts n ranks itself (a launcher), and with GPUs rank r takes cuda:r: skip on a machine "
        "with some GPUs but fewer than n (without GPUs the ranks run on the CPU)",
    )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    marker = metafunc.definition.get_closest_marker(WORLD_SIZE_ARG)
    if marker is None:
        return
    sizes = marker.args
    if not sizes or not all(isinstance(size, int) and size >= 1 for size in sizes):
        raise pytest.UsageError(
            f"{metafunc.definition.nodeid}: world_size needs one or more positive integers, got {sizes!r}"
        )
    if WORLD_SIZE_ARG not in metafunc.fixturenames:
        metafunc.fixturenames.append(WORLD_SIZE_ARG)
    metafunc.parametrize(WORLD_SIZE_ARG, sizes, ids=[f"world{size}" for size in sizes])


def pytest_runtest_setup(item: pytest.Item) -> None:
    marker = item.get_closest_marker("gpus")
    if marker is not None:
        needed = marker.args[0]
        found = _gpu_count()
        if found < needed:
            pytest.skip(f"needs {needed} GPUs, found {found}")
    marker = item.get_closest_marker("ranks")
    if marker is not None:
        needed, found = marker.args[0], _gpu_count()
        if 0 < found < needed:
            pytest.skip(f"needs {needed} GPUs for its {needed} ranks (or none, on CPU), found {found}")


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function):
    marker = pyfuncitem.get_closest_marker(WORLD_SIZE_ARG)
    if marker is None:
        return None
    world_size = pyfuncitem.callspec.params[WORLD_SIZE_ARG]
    backend = _backend(pyfuncitem.config, marker, world_size)
    timeout = marker.kwargs.get("timeout") or pyfuncitem.config.getoption("--world-timeout")
    grace = marker.kwargs.get("grace", GRACE)
    declared = inspect.signature(pyfuncitem.obj).parameters
    kwargs = {name: value for name, value in pyfuncitem.funcargs.items() if name in declared}
    _check_picklable(pyfuncitem, kwargs)
    if marker.kwargs.get("fresh") or pyfuncitem.config.getoption("--fresh-worlds"):
        # The harness's modules here and below, not at the top: loading the plugin imports nothing but pytest.
        from pyvene_dist.testing.launch import spawn

        with tempfile.TemporaryDirectory(prefix="pyvene-dist-world") as workdir:
            outcome = spawn(
                pyfuncitem.obj, world_size=world_size, backend=backend, timeout=timeout, grace=grace, workdir=workdir,
                kwargs=kwargs,
            )
    else:
        world = _worlds(pyfuncitem.config).get(world_size, backend)
        outcome = world.run(pyfuncitem.obj, timeout=timeout, grace=grace, kwargs=kwargs)
    if outcome.failed:
        pytest.fail(outcome.report(), pytrace=False)
    if outcome.skipped:
        reasons = sorted({f"{r.detail}" for r in outcome.skipped})
        pytest.skip("; ".join(reasons))
    return True


def _worlds(config: pytest.Config):
    """The session's worlds, made on first use and ended with the session."""
    worlds = getattr(config, "_pyvene_dist_worlds", None)
    if worlds is None:
        from pyvene_dist.testing.worlds import Worlds

        worlds = config._pyvene_dist_worlds = Worlds()
        # This process has imported torch and what the tests need: at its exit, leave those objects out of the
        # interpreter's collections, which walk every one (1.7 s of a 2-core machine for torch, transformers and
        # pyvene; 0.2 s frozen). At exit, not at the session's end: a session run inside another (pytester) ends
        # before its process does.
        atexit.register(gc.freeze)
    return worlds


def pytest_unconfigure(config: pytest.Config) -> None:
    worlds = getattr(config, "_pyvene_dist_worlds", None)
    if worlds is not None:
        worlds.close()


def _check_picklable(item: pytest.Function, kwargs: dict) -> None:
    """Each rank gets the test's arguments pickled: say which one cannot be, in one line."""
    parameters = item.callspec.params
    for name, value in kwargs.items():
        error = _pickling_error(value)
        if error is not None:
            kind = "parameter" if name in parameters and name != WORLD_SIZE_ARG else "fixture"
            pytest.fail(
                f"{item.nodeid}: {kind} {name!r} ({type(value).__name__}) cannot be sent to the ranks, which "
                f"get their arguments pickled: {error}. Pass picklable values (module-level functions, "
                "not lambdas), or make the object inside the test body.",
                pytrace=False,
            )


def _pickling_error(value) -> str | None:
    try:
        pickle.dumps(value)
    except Exception as error:  # noqa: BLE001 -- pickling raises many kinds (TypeError, PicklingError, ...)
        return f"{type(error).__name__}: {error}"
    return None


def _backend(config: pytest.Config, marker: pytest.Mark, world_size: int) -> str:
    backend = marker.kwargs.get("backend") or config.getoption("--world-backend")
    found = _gpu_count()
    if backend == "auto":  # with some GPUs, ranks run on them (DeepSpeed and FSDP place rank r on cuda:r)
        backend = "nccl" if found else "gloo"
    if backend == "nccl" and found < world_size:
        pytest.skip(f"needs {world_size} GPUs for nccl, found {found}")
    return backend


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0
