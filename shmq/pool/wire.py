"""What travels between a process pool's parent and its workers.

* **Tasks** go through the pool's request ring (an anonymous
  :class:`shmq.Queue`'s spool, taken by the workers as its group), one
  *frame* per bundle of consecutive tasks: ``(first task id, [(fn, args,
  kwargs), ...])``, pickled with protocol 5 (numpy and Arrow buffers written
  straight into the ring, :func:`shmq.rpc.requests.send`).  A frame of
  :data:`STOP` tells the worker that takes it to exit.
* **Replies** go through the pool's result queue (another anonymous
  :class:`shmq.Queue`), one per frame: ``(seq, statuses, blob, buffers,
  run_ns)``: the frame's seq in the ring (which tasks it held is the
  parent's to know), one status byte per task, the tasks' values pickled
  together into ``blob`` with their out-of-band ``buffers`` beside it (so
  that the reply itself always unpickles: only ``blob`` runs code of the
  user's, and a value that cannot be unpickled costs its frame, never the
  result queue), and the time the worker took to run them.  A value is the
  task's result (:data:`OK`) or ``(exception, formatted traceback)``
  (:data:`ERR`).
* **Events** in the same queue are tuples whose first item is a str:
  :data:`DIED` (the parent's supervisor: a worker died, and what its row
  held), :data:`INIT_FAILED` (a worker's initializer raised),
  :data:`UNDECODABLE` (a worker could not unpickle a frame), :data:`WAKE`.
"""

from __future__ import annotations

import pickle
import traceback
from typing import Any

__all__ = ["OK", "ERR", "STOP", "DIED", "INIT_FAILED", "UNDECODABLE", "WAKE", "pack_values",
           "unpack_values", "remote", "traceback_text", "EXECUTOR", "POOL"]

OK, ERR = 0, 1
STOP = None
DIED, INIT_FAILED, UNDECODABLE, WAKE = "died", "init-failed", "undecodable", "wake"
#: The two faces of a pool, whose workers report errors the way their stdlib twins do.
EXECUTOR, POOL = "executor", "pool"


def traceback_text(exc: BaseException) -> str:
    """The stdlib pools' remote traceback text of ``exc`` (what ``__cause__`` shows)."""
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return '\n"""\n%s"""' % tb


def remote(exc: BaseException, tb: str, face: str) -> BaseException:
    """``exc`` as the caller gets it: its traceback in the worker chained as its
    ``__cause__``, the stdlib's way (``concurrent.futures.process._RemoteTraceback``,
    ``multiprocessing.pool.RemoteTraceback``), so that ``traceback.format_exception``
    shows the worker's frames."""
    if tb:
        if face == EXECUTOR:
            from concurrent.futures import process

            exc.__cause__ = process._RemoteTraceback(tb)  # type: ignore[arg-type]  # a str, really
        else:
            from multiprocessing import pool

            exc.__cause__ = pool.RemoteTraceback(tb)  # type: ignore[attr-defined]  # (not in typeshed)
    return exc


def pack_values(statuses: bytearray, values: list[Any], face: str) -> tuple[bytes, list[Any]]:
    """``values`` pickled together (protocol 5, out-of-band buffers beside), for a reply.

    A value that cannot be pickled (or whose pickling raises anything, even
    ``SystemExit``) is replaced by the error, as the stdlib's workers send it:
    the pickling error with its traceback (the executor), or
    ``multiprocessing.pool.MaybeEncodingError`` (``Pool``); its status becomes
    :data:`ERR`.
    """
    bufs: list[Any] = []
    try:
        return pickle.dumps(values, 5, buffer_callback=bufs.append), bufs
    except BaseException:  # noqa: BLE001  (which one? each alone, below)
        pass
    fixed = []
    for i, v in enumerate(values):
        try:
            pickle.dumps(v, 5, buffer_callback=lambda b: None)
            fixed.append(v)
        except BaseException as exc:  # noqa: BLE001  (reported to the task's caller)
            was, statuses[i] = statuses[i], ERR
            if face == POOL:
                from multiprocessing import pool

                fixed.append((pool.MaybeEncodingError(exc, v[0] if was == ERR else v), ""))  # type: ignore[attr-defined]
            else:
                fixed.append((_plain(exc), traceback_text(exc)))
    bufs = []
    return pickle.dumps(fixed, 5, buffer_callback=bufs.append), bufs


def _plain(exc: BaseException) -> BaseException:
    """``exc`` if it pickles, else a ``pickle.PicklingError`` saying what it was."""
    try:
        pickle.dumps(exc)
        return exc
    except BaseException:  # noqa: BLE001
        return pickle.PicklingError(f"{type(exc).__qualname__}: {exc}")


def unpack_values(blob: bytes, buffers: list[Any]) -> list[Any]:
    """The values of a reply (runs the user's unpickling code: may raise anything)."""
    return pickle.loads(blob, buffers=buffers)
