"""What a call and its reply look like on the way, shared by the service and the client.

A request is a frame of the service's request ring holding the tuple
``(call id, reply queue path, caller identity word, deadline ns, attempt, request)``
(:mod:`shmq.rpc.requests`); a *bundle*, several calls of one ``call_many`` in
one frame, is ``(first call id, reply queue path, caller identity word,
deadline ns, attempt, requests, len(requests))`` (ids ``first`` onwards).
A reply is the tuple ``(call id, status, value)`` put into the caller's
reply queue, ``value`` being the reply (``OK``) or ``(type name, message,
traceback)`` (``ERR``); a bundle's reply is ``(first call id, statuses,
values, service ns)``, ``statuses`` a bytes of one status per call and
``service ns`` the handler's time for the whole bundle.
"""

from __future__ import annotations

import traceback

__all__ = ["OK", "ERR", "NS", "REQUEST_CAPACITY", "MAX_ATTEMPTS", "BATCH_S", "BUNDLE_MAX",
           "label", "error_tuple"]

OK, ERR = 0, 1  # OK is 0: a bundle whose statuses are all zero bytes is all answered
NS = 1_000_000_000
#: Service defaults: the request ring (allocated in full, in /dev/shm) and how
#: many times a call may take its worker down before it is answered with an error.
REQUEST_CAPACITY = "16MiB"
MAX_ATTEMPTS = 10
#: What a worker takes at once, and a caller puts in one bundle: as many calls as
#: the handler answers in about this long (from measured service times), so that
#: a batch costs one take and one reply instead of one of each per call, without
#: holding calls another worker could be answering.
BATCH_S = 0.001
#: ... at most this many calls in a bundle ...
BUNDLE_MAX = 64
#: ... and at most this many in a worker's take: several bundles, when the handler
#: is fast (fewer takes and loop turns a bundle; measured in docs/service.md).
TAKE_MAX = 4 * BUNDLE_MAX


def label(name, path):
    """``service 'name' (path)``, for messages."""
    return f"service {name!r}" + (f" ({path})" if str(name) != path else "")


def error_tuple(exc: BaseException):
    """``(type name, message, formatted traceback)`` of an exception: what travels."""
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return (type(exc).__qualname__, str(exc), tb)
