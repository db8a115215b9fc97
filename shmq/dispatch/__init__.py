"""shmq.Dispatcher: message handlers in supervised worker processes.

Layout on disk, for a dispatcher on ``PATH`` (docs/dispatcher.md has the
semantics and the trade-offs):

* ``PATH.<type>`` is each type's work queue.  ``Dispatcher.publish`` and
  ``ctx.publish`` put a registered type's message straight there; its
  worker processes (``parallelism``) lease from it themselves: no
  head-of-line blocking between types, one lease table per type, handler
  failures dead-lettered in ``PATH.<type>.dead``;
* ``PATH`` is the *ingress* work queue, for producers that do not hold the
  Dispatcher (a plain ``WorkQueue.put(..., headers={"type": ...})``) and for
  unregistered types: a *router* thread moves each ingress message to its
  type's queue; a type with no handler is nacked with ``NoHandler`` until
  the ingress queue dead-letters it (``PATH.dead``);
* ``PATH.dispatch`` is a small memory-mapped *board*: the supervisor's
  identity and per-type targets, and one row per worker slot with counters,
  the message in progress and a ring of recent latencies.  ``status`` and
  ``metrics`` read it from any process;
* a running supervisor listens on an abstract Unix socket named after the
  path's hash (no file): ``python -m shmq.dispatch scale PATH TYPE N`` and
  ``stop PATH`` talk to it.

The package, bottom up (each module imports only those above it):

* :mod:`.registry`: handler/worker specs, validation, errors, queue attach;
* :mod:`.board`: the board's format, ``status``, ``format_status``;
* :mod:`.worker`: the worker process (``Context``, watchdog, settle);
* :mod:`.control`: the control socket, ``scale``/``stop`` clients, the CLI;
* :mod:`.routing`: the router thread (ingress -> type queues);
* :mod:`.supervisor`: worker processes, replacement, backstop, releases;
* :mod:`.dispatcher`: the ``Dispatcher`` class (registration, publishing,
  lifecycle).

This module only re-exports.
"""

from .board import board_path, format_status, status
from .control import main, scale, stop
from .dispatcher import Dispatcher
from .registry import (
    BACKSTOP_MARGIN_S, IDLE_WAKE_S, ROUTER_LEASE_S, SUPERVISOR_TICK_S, HandlerTimeout, NoHandler,
    WorkerDied,
)
from .worker import LOG_FORMAT, Context

metrics = Dispatcher.metrics

__all__ = ["Dispatcher", "Context", "HandlerTimeout", "NoHandler", "WorkerDied", "main",
           "status", "scale", "stop", "metrics", "format_status", "board_path", "LOG_FORMAT",
           "IDLE_WAKE_S", "SUPERVISOR_TICK_S", "BACKSTOP_MARGIN_S", "ROUTER_LEASE_S"]
