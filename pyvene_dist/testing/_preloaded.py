"""Rank processes forked from a server that imported torch, transformers and pyvene once.

A spawned rank starts a new interpreter and imports what every rank imports: on a 2-core machine about
7 of the 8 seconds a world of 2 took to start, paid again by every ``spawn`` (each ``pyvene-dist check``
row, each fresh world of the tests). ``context()`` gives a multiprocessing context whose processes fork from
a server of this module's own (multiprocessing's forkserver is one per process and a user's program may use
it with other preloads), started with ``PRELOAD`` imported. Each rank is still a process of its own,
and nothing it does reaches the server or another rank; what the server holds is those modules as
importing them left them. A forked rank gets the parent's working directory and ``sys.path`` (as a spawned
one does) but the environment its server started with, and modules read some variables as they import.
So a server serves one environment and ``sys.path``: another (a test's ``monkeypatch.setenv``, a variable a
library sets for good) gets a server of its own, up to ``MAX_SERVERS``, and past them the context is
spawn's. A server lives until its parent exits (stopping one waits for every rank it forked).
``PYVENE_DIST_FORKSERVER=0`` always gives spawn's.

pytest names the running test in ``PYTEST_CURRENT_TEST``: that variable is left out of the key (``IGNORED``), else
every test that starts a world started a server of its own, and past ``MAX_SERVERS`` every rank was spawned. On a
machine with CUDA the context is spawn's: a process forked after CUDA was touched cannot use it, and on one H200 the
ranks forked from the first servers of a session failed to take their GPU ("Cannot re-initialize CUDA in forked
subprocess"), where spawned ranks took it.
"""

from __future__ import annotations

import io
import multiprocessing
import os
import sys
import threading
from multiprocessing import context as _context
from multiprocessing import forkserver, popen_forkserver, reduction, spawn, util

import torch

from .._options import switch

#: What the server imports once: what a rank imports before its first line (``_preload`` names them).
PRELOAD = ("pyvene_dist.testing._preload",)
VARIABLE = "PYVENE_DIST_FORKSERVER"

#: At most this many servers, one per environment and ``sys.path`` ranks were started under; past it, spawn.
MAX_SERVERS = 4
#: (environment, sys.path) -> its server.
_servers: dict[tuple, forkserver.ForkServer] = {}
_lock = threading.Lock()


#: Variables that change from test to test and that no rank reads: not part of a server's key.
IGNORED = frozenset({"PYTEST_CURRENT_TEST"})


def _now() -> tuple:
    return frozenset(item for item in os.environ.items() if item[0] not in IGNORED), tuple(sys.path)


def _cuda() -> bool:
    return torch.cuda.is_available()


class _Popen(popen_forkserver.Popen):
    def _launch(self, process_obj):  # popen_forkserver.Popen._launch, asking this module's server
        server = _servers[process_obj._preloaded_key]
        prep_data = spawn.get_preparation_data(process_obj._name)
        buf = io.BytesIO()
        _context.set_spawning_popen(self)
        try:
            reduction.dump(prep_data, buf)
            reduction.dump(process_obj, buf)
        finally:
            _context.set_spawning_popen(None)
        self.sentinel, w = server.connect_to_new_process(self._fds)
        _parent_w = os.dup(w)  # the child's sentinel of its parent, as the stdlib keeps it
        self.finalizer = util.Finalize(self, util.close_fds, (_parent_w, self.sentinel))
        with open(w, "wb", closefd=True) as f:
            f.write(buf.getbuffer())
        self.pid = forkserver.read_signed(self.sentinel)


class _Process(_context.ForkServerProcess):
    @staticmethod
    def _Popen(process_obj):
        return _Popen(process_obj)


class _Context(_context.ForkServerContext):
    """A forkserver context whose processes fork from the server of ``key``."""

    def __init__(self, key: tuple) -> None:
        super().__init__()
        self._key = key

    def Process(self, *args, **kwargs):  # noqa: N802 -- multiprocessing's name
        process = _Process(*args, **kwargs)
        process._preloaded_key = self._key  # pickled to the child with the process: a key, not the server
        return process


def context():
    """The context ranks start from: the preloaded server's for this environment and ``sys.path`` (started
    at its first use), else spawn's (always on a machine with CUDA)."""
    if "forkserver" not in multiprocessing.get_all_start_methods() or not switch(VARIABLE, True) or _cuda():
        return multiprocessing.get_context("spawn")
    key = _now()
    with _lock:
        if key not in _servers:
            if len(_servers) >= MAX_SERVERS:
                return multiprocessing.get_context("spawn")
            server = forkserver.ForkServer()
            server.set_forkserver_preload(list(PRELOAD))
            server.ensure_running()
            _servers[key] = server
    return _Context(key)
