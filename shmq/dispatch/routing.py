"""The router: moves messages put on the ingress queue ``PATH`` to ``PATH.<type>``.

Only messages that did not go straight to their type's queue pass here: a
plain ``WorkQueue.put(..., headers={"type": ...})`` on the ingress queue
(a producer without the Dispatcher), and types with no registered handler.
Forwarding costs a second pickle, spool and lease (docs/dispatcher.md,
"Throughput"); ``Dispatcher.publish`` and ``ctx.publish`` skip it for
registered types.
"""

from __future__ import annotations

import logging
import threading

from ..errors import Empty, LeaseLost
from .board import H_ROUTED, H_UNROUTABLE
from .registry import IDLE_WAKE_S, ROUTER_LEASE_S, NoHandler, attach

_log = logging.getLogger("shmq.dispatch")


class Router(threading.Thread):
    """A thread of the supervising process: ingress -> type queues, until ``should_stop()``.

    Each forwarded message gets ``message_id`` (its ingress id) and
    ``correlation_id`` headers and its handler's ``max_attempts``; the
    ingress message is acked only after the forward succeeded (a crash in
    between forwards it twice: at least once).  A message whose type has no
    handler is nacked with :class:`NoHandler` until the ingress queue
    dead-letters it.
    """

    def __init__(self, path, specs, board_words, should_stop, *, unknown_type_delay=0.0,
                 trusted=False):
        super().__init__(name="shmq-dispatch-router", daemon=True)
        self.path = path
        self.specs = dict(specs)
        self.w = board_words
        self.should_stop = should_stop
        self.unknown_type_delay = unknown_type_delay
        self.trusted = trusted

    def run(self):
        ingress = attach(self.path, self.trusted)
        tqs = {t: attach(f"{self.path}.{t}", self.trusted) for t in self.specs}
        try:
            self.loop(ingress, tqs)
        finally:
            ingress.close()
            for q in tqs.values():
                q.close()

    def loop(self, ingress, tqs):
        warned = set()
        w, specs = self.w, self.specs
        while not self.should_stop():
            try:
                msg = ingress.get(timeout=IDLE_WAKE_S, lease=ROUTER_LEASE_S)
            except Empty:
                continue
            except Exception:
                _log.exception("router: could not take an ingress message (it comes back "
                               "after %s s)", ROUTER_LEASE_S)
                continue
            t = msg.headers.get("type")
            spec = specs.get(t) if isinstance(t, str) else None
            try:
                if spec is None:
                    wkey = t if isinstance(t, str) else repr(t)
                    if wkey not in warned and len(warned) < 1000:
                        warned.add(wkey)
                        _log.warning("no handler for message type %r: nacked until the "
                                     "ingress queue dead-letters it", t)
                    what = ("has no 'type' header" if t is None
                            else f"has type {t!r}, which has no registered handler")
                    msg.nack(delay=self.unknown_type_delay,
                             error=NoHandler(f"message {msg.id} {what} (registered: "
                                             f"{sorted(specs)})"))
                    w[H_UNROUTABLE] += 1
                    continue
                headers = dict(msg.headers)
                headers["message_id"] = msg.id
                headers.setdefault("correlation_id", msg.id)
                try:
                    tqs[t].put(msg.body, key=msg.key, headers=headers,
                               max_attempts=spec.max_attempts)
                except Exception as exc:
                    _log.error("router: could not forward message %d to %r: %s", msg.id, t, exc)
                    msg.nack(delay=1.0, error=exc)
                    continue
                msg.ack()
                w[H_ROUTED] += 1
            except LeaseLost:
                _log.warning("router: lease of ingress message %d lost (it is delivered "
                             "again: a duplicate may reach %r)", msg.id, t)
