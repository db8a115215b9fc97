"""What a call and its reply look like on the way, shared by the service and the client.

A request is a frame of the service's request ring holding the tuple
``(call id, reply queue path, caller identity word, deadline ns, attempt, request)``
(:mod:`shmq.rpc.requests`);
a reply is the tuple ``(call id, status, value)`` put into the caller's
reply queue, ``value`` being the reply (``OK``) or ``(type name, message,
traceback)`` (``ERR``).
"""

from __future__ import annotations

import traceback

__all__ = ["OK", "ERR", "NS", "REQUEST_CAPACITY", "MAX_ATTEMPTS", "label", "error_tuple"]

OK, ERR = 0, 1
NS = 1_000_000_000
#: Service defaults: the request ring (allocated in full, in /dev/shm) and how
#: many times a call may take its worker down before it is answered with an error.
REQUEST_CAPACITY = "16MiB"
MAX_ATTEMPTS = 10


def label(name, path):
    """``service 'name' (path)``, for messages."""
    return f"service {name!r}" + (f" ({path})" if str(name) != path else "")


def error_tuple(exc: BaseException):
    """``(type name, message, formatted traceback)`` of an exception: what travels."""
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return (type(exc).__qualname__, str(exc), tb)
