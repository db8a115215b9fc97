"""What a dispatcher knows about its handlers, and how it reaches their queues.

The bottom of ``shmq.dispatch``: the handler and worker specs (what travels
to a worker process), their validation, the dispatcher's errors, and
:func:`attach` / :func:`open_or_create` for the work queues.  No threads,
no processes, no board.
"""

from __future__ import annotations

import dataclasses
import pickle
import re

from ..errors import ShmqError
from ..workqueue import WorkQueue

#: An idle worker (or the router) returns from ``WorkQueue.get`` this often to
#: notice a stop request.  Dispatch itself never waits for it: a put wakes the
#: blocked ``get`` at once (the spool's doorbell).
IDLE_WAKE_S = 0.5
#: The supervisor re-reads the board this often while some handler has a
#: timeout (backstop kills), and never otherwise.
SUPERVISOR_TICK_S = 0.5
#: The supervisor SIGKILLs a worker whose handler is this long past its
#: timeout + cancel_grace (its own watchdog should have acted long before).
BACKSTOP_MARGIN_S = 1.0
#: The router holds an ingress message this long while forwarding it.
ROUTER_LEASE_S = 60.0
#: At most this many message types per dispatcher (one board word each).
MAX_TYPES = 64

EXIT_OK = 0
EXIT_STARTUP = 3  # the worker could not start (import error, factory raised, ...)
EXIT_TIMEOUT = 70  # the watchdog terminated a handler that ignored its cancellation

TYPE_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")

builtins_type = type


class HandlerTimeout(ShmqError, TimeoutError):
    """A handler ran past its ``timeout`` (recorded as the nack error)."""


class NoHandler(ShmqError):
    """An ingress message whose ``"type"`` header names no registered handler."""


class WorkerDied(ShmqError):
    """A worker process died while handling a message (recorded as the nack error)."""


@dataclasses.dataclass(frozen=True)
class HandlerSpec:
    """One registered handler (immutable; pickled to every worker of its type)."""

    type: str
    target: object  # a module-level function, or a class (the factory)
    is_class: bool
    scope: str  # "message" | "worker" (classes only)
    parallelism: int
    timeout: float | None
    max_attempts: int
    lease: float
    cancel_grace: float
    retry_delay: object  # float, or callable(attempt) -> float


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker process needs to start (pickled to it)."""

    handler: HandlerSpec
    queue_path: str
    ingress_path: str
    board_path: str
    row: int
    initializer: object
    log_level: object
    trusted: bool
    #: ``{type: max_attempts}`` of every registered type: ``ctx.publish`` puts
    #: a message of these types straight into ``PATH.<type>`` (no router hop)
    direct: dict = dataclasses.field(default_factory=dict)


def check_type(t):
    """Return ``t`` if it may name a message type (and so the queue ``PATH.<type>``).

    :raises ValueError: not a str of the allowed characters, or reserved.
    """
    if not isinstance(t, str) or not TYPE_RE.fullmatch(t):
        raise ValueError(f"message type must match {TYPE_RE.pattern!r} (it names the queue "
                         f"PATH.<type>), not {t!r}")
    if t.endswith(".dead") or t == "dead" or t == "dispatch" or t.startswith("dispatch."):
        raise ValueError(f"message type {t!r} is reserved (it would clash with PATH.dead or "
                         "PATH.dispatch)")
    return t


def qualname(obj):
    """``module:qualname`` of a handler, for messages and the board."""
    return f"{getattr(obj, '__module__', '?')}:{getattr(obj, '__qualname__', repr(obj))}"


def check_importable(obj, what):
    """Worker processes are spawned: handlers travel by reference (module + name).

    :raises TypeError: ``obj`` is a lambda, a local function, or does not pickle.
    """
    qn = getattr(obj, "__qualname__", "")
    if "<locals>" in qn or "<lambda>" in qn:
        raise TypeError(f"{what} {qualname(obj)} must be importable: define it at module level "
                        "(worker processes import it by name)")
    try:
        pickle.dumps(obj)
    except Exception as exc:
        raise TypeError(f"{what} {qualname(obj)} must be importable (module-level) so that "
                        f"worker processes can load it: {exc}") from None


def delay_for(spec, attempt):
    """Seconds before redelivering after failed ``attempt`` (``spec.retry_delay``)."""
    d = spec.retry_delay(attempt) if callable(spec.retry_delay) else spec.retry_delay
    return max(0.0, float(d or 0.0))


def positive(name, v, allow_none=False):
    """``float(v)`` if ``v`` is a positive number (or None when allowed).

    :raises ValueError: anything else (bools and NaN included).
    """
    if v is None and allow_none:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 or v != v:
        raise ValueError(f"{name} must be a positive number{' or None' if allow_none else ''}")
    return float(v)


def attach(path, trusted=False) -> WorkQueue:
    """Open an existing work queue cheaply.

    ``WorkQueue(path)`` on an existing queue still builds (and pre-faults) a
    temporary spool of the full ``capacity`` and ``dead_capacity`` before it
    finds the path taken (``Spool.create(exist_ok=True)``): 80 MiB and
    ~130 ms with the defaults.  The sizes only matter when creating, so pass
    tiny ones.  :raises FileNotFoundError: no queue at ``path``.
    """
    return WorkQueue.open(path, capacity=4096, dead_capacity=4096, leases=1, keys=1,
                          trusted=trusted)


def open_or_create(path, **opts) -> WorkQueue:
    """Attach to the work queue at ``path``, or create it with ``opts``."""
    try:
        return attach(path, opts.get("trusted", False))
    except FileNotFoundError:
        return WorkQueue(path, **opts)
