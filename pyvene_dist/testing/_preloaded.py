"""Rank processes forked from a server that imported torch, transformers and pyvene once.

A spawned rank starts a new interpreter and imports what every rank imports: on a 2-core machine about
7 of the 8 seconds a world of 2 took to start, paid again by every ``spawn`` (each ``pyvene-dist check``
row, each fresh world of the tests). ``context()`` gives a multiprocessing context whose processes fork from
a server of this module's own (multiprocessing's forkserver is one per process and a user's program may use
it with other preloads), started once with ``PRELOAD`` imported. Each rank is still a process of its own,
and nothing it does reaches the server or another rank; what the server holds is those modules as
importing them left them. A forked rank gets the parent's working directory and ``sys.path`` (as a spawned
one does) but the environment the server started with, so where ``os.environ`` or ``sys.path`` is no longer
what they were at the server's start (a test's ``monkeypatch.setenv``; modules read some variables as they
import) the context is spawn's. ``PYVENE_DIST_FORKSERVER=0`` always gives spawn's.
"""

from __future__ import annotations

import io
import multiprocessing
import os
import sys
import threading
from multiprocessing import context as _context
from multiprocessing import forkserver, popen_forkserver, reduction, spawn, util

from .._options import switch

#: What the server imports once: what a rank imports before its first line (``_preload`` names them).
PRELOAD = ["pyvene_dist.testing._preload"]
VARIABLE = "PYVENE_DIST_FORKSERVER"

_server: forkserver.ForkServer | None = None
_started_under: tuple | None = None  # (environment, sys.path) the server was started with
_lock = threading.Lock()


def _now() -> tuple:
    return dict(os.environ), list(sys.path)


class _Popen(popen_forkserver.Popen):
    def _launch(self, process_obj):  # popen_forkserver.Popen._launch, asking this module's server
        prep_data = spawn.get_preparation_data(process_obj._name)
        buf = io.BytesIO()
        _context.set_spawning_popen(self)
        try:
            reduction.dump(prep_data, buf)
            reduction.dump(process_obj, buf)
        finally:
            _context.set_spawning_popen(None)
        self.sentinel, w = _server.connect_to_new_process(self._fds)
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
    Process = _Process


def context():
    """The context ranks start from: the preloaded server's where it may serve, else spawn's."""
    global _server, _started_under
    if "forkserver" not in multiprocessing.get_all_start_methods() or not switch(VARIABLE, True):
        return multiprocessing.get_context("spawn")
    with _lock:
        if _server is None:
            _server = forkserver.ForkServer()
            _server.set_forkserver_preload(PRELOAD)
            _server.ensure_running()
            _started_under = _now()
        elif _started_under != _now():
            return multiprocessing.get_context("spawn")
    return _Context()


def stop() -> None:
    """Stop the server (the next ``context()`` starts another under the environment of then)."""
    global _server, _started_under
    with _lock:
        if _server is not None:
            _server._stop()
        _server = _started_under = None
