"""A process pool's worker: take frames of tasks from the request ring, run them, reply.

Its board row (:mod:`shmq.workers.holdings`) shows, before it acts on
anything, the frames in its hands, the frame it is decoding, running or
answering, and the task running now: what its parent charges a death to.
A worker replies to a frame before it drops it from its row, so that a
frame is always queued, in a live worker's hands, or answered.
"""

from __future__ import annotations

import logging
import os
import time
import traceback
from multiprocessing import reduction
from typing import Any, NamedTuple

from .. import codec as _codec
from ..errors import Empty
from ..queue import GROUP
from ..rpc.requests import decode, send
from ..spool import Spool
from ..workers import Board, Hands, Layout
from ..workers.board import ROW_COMMON
from ..workers.holdings import R_RUNNING, working_on
from .wire import ERR, EXECUTOR, INIT_FAILED, STOP, UNDECODABLE, pack_values, traceback_text

__all__ = ["Config", "BoardFd", "worker_main", "LAYOUT", "R_STARTS"]

#: A pool's board: a memfd, one row per worker slot (rows are assigned, never claimed).
LAYOUT = Layout("pool", 16, what="pool board")
#: Row words after the platform's: tasks run, frames taken, workers of the slot that
#: started (opened the rings and ran the initializer: the parent tells from it a worker
#: that died before it started).
R_TASKS, R_FRAMES, R_STARTS = ROW_COMMON, ROW_COMMON + 1, ROW_COMMON + 2
ROW_WORDS = ROW_COMMON + 8
#: A worker takes as many frames at once as it runs in about this long ...
BATCH_S = 0.001
#: ... and at most this many.
TAKE_MAX = 16
#: An idle worker looks at its parent this often (its death signal is the real guard).
IDLE_S = 1.0

#: The stdlib's executor logs a failing initializer here, and so does ours (the same
#: records: code that captures them keeps working).
EXECUTOR_LOG = logging.getLogger("concurrent.futures")
POOL_LOG = logging.getLogger("shmq.pool")


class BoardFd:
    """The pool board's descriptor, for a worker: inherited under ``fork``, passed by
    ``multiprocessing`` (duplicated into the child) under ``spawn`` and ``forkserver``."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_fd, (reduction.DupFd(self.fd),))


def _rebuild_fd(dup: Any) -> BoardFd:
    return BoardFd(dup.detach())


class Config(NamedTuple):
    """What every worker of a pool gets (pickled to it, or inherited)."""

    ring: str  # the request ring's path
    results: str  # the result queue's path (written as a spool: see _reply)
    board: BoardFd
    face: str  # wire.EXECUTOR or wire.POOL: how errors are reported
    initializer: Any
    initargs: tuple[Any, ...]
    max_tasks: int | None  # frames a worker runs before it exits (None: no limit)
    #: The result queue may wrap early with this many bytes unread by the parent behind it
    #: (``Ring.wrap_lag``): a reply that meets them waits for the parent, which always reads.
    wrap_lag: int = 0


def worker_main(cfg: Config, slot: int) -> None:
    """A worker process of a pool (its crew armed the parent-death signal): attach,
    initialize, serve frames until a :data:`~.wire.STOP` frame or ``max_tasks``."""
    parent = os.getppid()
    board = Board.attach_fd(cfg.board.fd, LAYOUT)
    row = board.row(slot)
    row.clear_holding()
    row.hold()
    spool = Spool.open(cfg.ring)
    _codec.require_trust(spool, False)  # tasks are pickles: only from our own, private ring
    reader = spool.reader(GROUP, group=True)
    # Replies are put as encoded frames (shmq.rpc.requests.send): a Queue's own put
    # takes ~10 ms for an 8 MiB numpy array where put_many of its encoding takes 0.5.
    results = Spool.open(cfg.results)
    _codec.require_trust(results, False)
    results.core.wrap_lag = cfg.wrap_lag
    if cfg.initializer is not None:
        try:
            cfg.initializer(*cfg.initargs)
        except BaseException:  # noqa: BLE001  (the pool is told; it breaks, as the stdlib's does)
            (EXECUTOR_LOG if cfg.face == EXECUTOR else POOL_LOG).critical(
                "Exception in initializer:", exc_info=True)
            send(results, [(INIT_FAILED, slot, os.getpid(), traceback.format_exc())], None)
            return
    row.add(R_STARTS)
    try:
        _serve(cfg, row, reader, results, parent)
    finally:
        row.clear_holder()


def _serve(cfg, row, reader, results, parent):
    """Take frames, run their tasks, reply; until told to stop."""
    hands = Hands(row)
    w, rb = row.w, row.base + R_RUNNING
    face = cfg.face
    per_frame = BATCH_S  # seconds per frame, smoothed: how many to take at once
    done = 0
    while True:
        n = max(1, min(TAKE_MAX, int(BATCH_S / per_frame)))
        if cfg.max_tasks:
            n = min(n, cfg.max_tasks - done)
        try:
            frames = reader.get_many(n, True, IDLE_S)
        except Empty:
            if os.getppid() != parent:
                return
            continue
        t0 = time.perf_counter()
        hands.took([f.seq for f in frames])  # published at once: the parent must see them
        replies: list[Any] = []
        stops = 0
        for f in frames:
            seq = f.seq
            working_on(row, seq, None)  # a death now is charged to the whole frame
            try:
                t = decode(f)
            except BaseException as exc:  # noqa: BLE001  (even SystemExit: reported)
                replies.append((UNDECODABLE, seq, _picklable(exc), traceback_text(exc)))
                continue
            if t is STOP:
                stops += 1
                continue
            first, calls = t
            statuses = bytearray(len(calls))
            values: list[Any] = []
            t1 = time.perf_counter_ns()
            for i, (fn, args, kwargs) in enumerate(calls):
                w[rb] = first + i + 1  # this task is running: a death now is charged to it
                try:
                    values.append(fn(*args, **kwargs))
                except BaseException as exc:  # noqa: BLE001  (the caller gets it, as the stdlib's)
                    statuses[i] = ERR
                    values.append((exc, traceback_text(exc)))
                    del exc
            run_ns = time.perf_counter_ns() - t1
            w[rb] = 0
            blob, bufs = pack_values(statuses, values, face)
            replies.append((seq, bytes(statuses), blob, bufs, run_ns))
            t = calls = values = fn = args = kwargs = None  # nothing of a task outlives it here
            row.add(R_TASKS, len(statuses))
        working_on(row, -1, None)
        if replies:
            send(results, replies, None)
        replies = []
        if stops > 1:  # one each: the rest go back for the other workers
            send(reader.spool, [STOP] * (stops - 1), None)
        for f in frames:  # replied: now they leave our row
            hands.answered(f.seq)
        hands.publish()
        row.add(R_FRAMES, len(frames))
        done += len(frames)
        per_frame = 0.8 * per_frame + 0.2 * max(1e-7, (time.perf_counter() - t0) / len(frames))
        frames = []
        if stops or (cfg.max_tasks and done >= cfg.max_tasks):
            return


def _picklable(exc: BaseException) -> BaseException | str:
    """``exc``, or its text if it does not pickle (an event must always reach the parent)."""
    import pickle

    try:
        pickle.dumps(exc)
        return exc
    except Exception:  # noqa: BLE001
        return f"{type(exc).__qualname__}: {exc}"
