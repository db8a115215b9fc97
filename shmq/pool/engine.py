"""The parent side of a process pool: tasks in, results out, and what a dead worker held.

Both faces (:class:`shmq.ProcessPoolExecutor`, :class:`shmq.Pool`) hand
their tasks to an :class:`Engine`; a task's *sink* (a future, a job) gets
its outcome.  The engine owns:

* the workers (a :class:`shmq.workers.Crew`, driven by the *supervisor*
  thread, which also reads a dead worker's row and restarts it);
* the request ring and the result queue (two anonymous :class:`shmq.Queue`
  files in ``/dev/shm``, removed at close, by their creator's resource
  tracker if it is killed, else by ``shmq gc`` and the next pool's start);
* the board (a memfd: nothing to clean up), one row per worker slot;
* the *collector* thread, which feeds the ring from the tasks submitted
  (a window of them, so that tasks not sent yet can still be cancelled),
  handles replies and events in the order they arrive, and puts back what
  a dead worker held.

**A killed worker costs one retry, not the pool.** The supervisor reads a
dead worker's row (:func:`shmq.workers.holdings.reclaim`) and sends the
collector a ``DIED`` event through the result queue, after every reply the
worker sent before it died.  The task that was running is *charged* the
death (the frame, if it died decoding or answering); every other task it
held goes back to the front of the queue uncharged, each in a frame of its
own.  A task charged ``max_attempts`` deaths fails alone with
:class:`shmq.WorkerCrashed`.  A frame lost between a worker's take and its
row's update is found by the platform's :class:`~shmq.workers.Lookout`
(twice found nowhere, 0.25 s apart) and sent again uncharged.
"""

from __future__ import annotations

import logging
import multiprocessing
import signal
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from .._layout import W_PUT_BYTES
from ..errors import Empty, Full, ShmqError, TooLarge
from ..queue import GROUP, Queue
from ..rpc.requests import send, taken_up_to
from ..spool import Spool
from ..workers import Board, Crew, Lookout, WakePipe, exit_text, held_ranges, reclaim
from . import lifetime
from .wire import DIED, INIT_FAILED, OK, STOP, UNDECODABLE, WAKE, remote, traceback_text, unpack_values
from .worker import LAYOUT, R_STARTS, ROW_WORDS, BoardFd, Config, worker_main

__all__ = ["Engine", "Task"]

log = logging.getLogger("shmq.pool")

#: How often the collector looks for frames lost between a take and a row update.
RECHECK_S = 0.25
#: How long an idle collector waits for a reply or a wake-up before it looks at the
#: pool's state again: a wake-up whose put failed (out of memory or descriptors) costs
#: at most this, never a shutdown that waits forever.
IDLE_RECHECK_S = 1.0
#: Tasks in flight per worker: as many as it runs in about this long (at least 2).
WINDOW_S = 0.005
#: Tasks per frame: as many as a worker runs in about this long, 1 to BUNDLE_MAX.
BUNDLE_S = 0.001
BUNDLE_MAX = 64
#: Bytes in the request ring per worker (sent, not answered) past which no more frames
#: are sent: large arguments (numpy arrays) go a few at a time, as a worker can take
#: them, instead of all at once into a ring that must grow (fresh pages) to hold them.
WINDOW_BYTES = 16 << 20
#: The request ring, and the workers' replies, wrap early with up to this many byte
#: windows unread behind them (``Ring.wrap_lag``): their pages are reused lap after lap
#: while large arguments and results stream.
WRAP_LAG_WINDOWS = 1
#: The request ring and the result queue start this large.  A growable ring grows and
#: gives back segments of about its start size (at most 4 MiB) and keeps four of them
#: when it wraps early: with 1 MiB, frames of a few MiB (numpy arrays) made most laps
#: allocate fresh pages (about a fifth more page faults and CPU for 8 MiB arrays).
RING_START = "4MiB"
#: Frames of tasks this large or larger are put one by one (a worker can start on the
#: first while the next is written); smaller ones in one batch.
SOLO_BYTES = 256 << 10
#: Workers asked to stop (a STOP frame each) exit within this, or are killed.
STOP_GRACE_S = 5.0

#: Process-directed signals a pool's threads block, so that the kernel hands them to
#: a thread that does not (the main one, where Python runs their handlers): a SIGINT
#: taken by a pool thread only sets Python's flag, and a main thread asleep in
#: ``Future.result()`` or ``AsyncResult.get()`` would sleep on through its Ctrl-C.
ROUTED_SIGNALS = frozenset(getattr(signal, n) for n in
                           ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGALRM")
                           if hasattr(signal, n))
#: A worker that could not be started is tried again after this.
RESTART_RETRY_S = 1.0
#: A pool whose workers of one slot die this many times in a row before they start
#: (their start method's bootstrap, the rings' opening: a main module that exits or
#: fails when a spawned child imports it) is broken, as a failing initializer breaks
#: it, rather than restarted forever with every call waiting.
UNSTARTED_MAX = 3
_LOOKOUT = Lookout(strikes=2, again=2)


class Task:
    """One submitted call: its outcome goes to ``sink`` (a future, a job) at ``index``, once
    (the engine's ``deliver``)."""

    __slots__ = ("call", "sink", "index", "codes", "done", "solo", "started")

    def __init__(self, call: tuple[Any, tuple[Any, ...], dict[str, Any]], sink: Any, index: int = 0) -> None:
        self.call: tuple[Any, tuple[Any, ...], dict[str, Any]] | None = call
        self.sink = sink
        self.index = index
        self.codes: list[int] | None = None  # exit codes of the workers that died running it
        self.done = False
        self.solo = False  # sent again after a loss: in a frame of its own
        self.started = False  # admitted into the window: its sink was told (a future runs)


class _Frame:
    """Tasks sent together: ``seq`` in the ring, wire ids ``first`` onwards."""

    __slots__ = ("seq", "first", "tasks", "strikes", "done", "nbytes")
    attempt = 1  # for the Lookout: a frame is sent again as new frames, never twice

    def __init__(self, first: int, tasks: list[Task]) -> None:
        self.seq, self.first, self.tasks, self.strikes, self.done = -1, first, tasks, 0, False
        self.nbytes = 0  # its share of the ring bytes its put took


def broken_pool(text: str, cause: BaseException | None = None) -> BaseException:
    from concurrent.futures.process import BrokenProcessPool

    exc = BrokenProcessPool(text)
    exc.__cause__ = cause
    return exc


class Engine:
    """Workers, the ring, the result queue and the two threads of one pool.

    ``face``: :data:`~.wire.EXECUTOR` or :data:`~.wire.POOL` (how errors look).
    ``start(sink) -> bool``: a task leaves the queue for the window (False: it was
    cancelled, drop it; None: sinks that cannot be cancelled); ``deliver(sink, index,
    ok, value)``: its outcome.
    ``at_exit``: what the interpreter's exit does with a pool still open:
    ``"finish"`` (the submitted work first, as the stdlib's executor) or
    ``"terminate"`` (as ``multiprocessing.Pool``).
    """

    def __init__(self, workers: int, ctx: Any, initializer: Any, initargs: tuple[Any, ...],
                 max_tasks: int | None, max_attempts: int, face: str, at_exit: str,
                 start: Callable[[Any], bool] | None, deliver: Callable[[Any, int, bool, Any], None]) -> None:
        self.workers = workers
        self._start, self._deliver = start, deliver
        self.max_attempts = max_attempts
        self.max_tasks = max_tasks
        self.face = face
        self.at_exit = at_exit
        self.ctx = ctx
        self._requests = Queue(capacity=RING_START)  # ours: removed at close (and if we die, see the docstring)
        self._results = Queue(capacity=RING_START)
        self._ring = Spool.open(self._requests.path)  # puts that tell their seqs
        # Our lead over the workers is bounded (the byte window), and a put that finds the
        # ring full is sent again after replies (_send_each): the ring may wrap early with
        # the workers behind, and reuse its pages, instead of climbing into fresh ones.
        # The same for the workers' replies, which wait for our collector if they must.
        wrap_lag = WRAP_LAG_WINDOWS * workers * WINDOW_BYTES
        self._ring.core.wrap_lag = wrap_lag
        # The collector waits for replies beside the callers' threads: a spin would hold
        # the GIL they need to submit (sched_yield on a busy machine: for a time slice).
        self._results._park_at_once()
        self._board = Board.anonymous(LAYOUT, workers, ROW_WORDS)
        assert self._board.fd is not None  # an anonymous board keeps its memfd
        cfg = Config(self._requests.path, self._results.path, BoardFd(self._board.fd), face, initializer,
                     tuple(initargs), max_tasks, wrap_lag)
        # made before our threads: under fork its zygote is forked here, single-threaded
        self._crew = Crew(ctx, worker_main, (cfg,), name="shmq-pool", death_signal=signal.SIGKILL)
        self._lock = threading.Lock()  # the window's state, the collector's
        # The callers' side: submit() appends to the inbox under the gate, never under
        # _lock, which the collector takes all the time (a caller blocked on it waited
        # for the GIL after it too: a third of a burst of trivial submits went so).
        # Lock order: _lock, then _gate (close and terminate take them one after the other).
        self._gate = threading.Lock()
        self._inbox: deque[Task] = deque()
        # submitted, not sent: the first _ready of them admitted (started), the rest waiting
        self._pending: deque[Task] = deque()
        self._ready = 0
        self._admitted = 0  # tasks started and not done: what the window counts
        self._frames: dict[int, _Frame] = {}  # seq -> frame in the ring or a worker's hands
        self._next_wire = 0
        self._unfinished = 0  # tasks submitted and not done
        self._per_task: float | None = None  # seconds a task takes in a worker, smoothed
        self._task_bytes: float | None = None  # ring bytes a task took in the last put
        self._inflight_bytes = 0  # ring bytes of the frames in self._frames
        self._idle = False  # the collector waits on the result queue
        self._woken = False
        self.closing = False  # no new tasks
        self.broken: BaseException | None = None
        self._terminate = False
        self._next_look = 0.0
        self._wake = WakePipe()  # the supervisor's wait; never written once _cleanup closed it
        self._stop_workers = False
        self.finished = threading.Event()  # workers reaped, files removed
        self._supervisor = threading.Thread(target=self._supervise, name="shmq-pool-supervisor",
                                            daemon=True)
        self._collector = threading.Thread(target=self._collect, name="shmq-pool-results",
                                           daemon=True)
        lifetime.watch(self)
        self._supervisor.start()
        self._collector.start()

    # -- the callers' side ----------------------------------------------------------------

    def submit(self, tasks: list[Task]) -> None:
        """Queue ``tasks`` (the caller checked the pool is open, under :meth:`lock`); the
        collector admits them into the window."""
        self._inbox.extend(tasks)
        # after the append: the collector sets _idle, then looks at the inbox (one of
        # the two sees the other's write, under the GIL)
        if self._idle and not self._woken:
            self._ring_bell()

    @property
    def lock(self) -> threading.Lock:
        """Held by a face while it checks the pool is open and calls :meth:`submit`."""
        return self._gate

    def _take_inbox(self) -> None:
        """Move the submitted tasks to the pending queue (``_lock`` held)."""
        # one popleft at a time, never extend-then-clear: submit() appends without
        # _lock, and a task appended between the two would be cleared unseen
        inbox, pending = self._inbox, self._pending
        n = 0
        while inbox:
            pending.append(inbox.popleft())
            n += 1
        self._unfinished += n

    def close(self, cancel: bool = False) -> list[Task]:
        """No new tasks; with ``cancel``, take back those not sent yet (returned).  The
        workers stop once the rest is done."""
        with self._gate:
            self.closing = True
        with self._lock:
            self._take_inbox()
            taken = []
            if cancel:  # those not admitted yet (an admitted one is running for its caller)
                # Admit first what the window holds, as the stdlib's call queue does: a
                # burst submitted just before (still in the inbox, which the collector
                # had not taken yet) must not be cancelled whole.
                if self.broken is None:
                    self._admit()
                while len(self._pending) > self._ready:
                    taken.append(self._pending.pop())
                taken.reverse()
                self._unfinished -= len(taken)
            self._poke()
        return taken

    def terminate(self) -> None:
        """Stop now: workers killed, tasks not done abandoned (their sinks get nothing)."""
        with self._gate:
            self.closing = True
        with self._lock:
            self._terminate = True
            self._poke()
        self._wake_supervisor()

    def join(self, timeout: float | None = None) -> bool:
        """Wait until the workers are reaped, the files removed and the pool's threads
        gone (a fork right after a shutdown must not copy a thread still on its way
        out); False if ``timeout`` passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self.finished.wait(timeout):
            return False
        for t in (self._supervisor, self._collector):  # each has only to return now
            if t is not threading.current_thread():
                t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in (self._supervisor, self._collector)
                       if t is not threading.current_thread())

    def _poke(self) -> None:
        # lock held
        if not self._woken:
            self._ring_bell()

    def _ring_bell(self) -> None:
        """Wake the collector: a WAKE through the result queue.  A put that fails is
        nobody's error to raise (the queue closed at the end, or the host out of memory
        or descriptors): the collector, which waits at most :data:`IDLE_RECHECK_S`,
        finds the submitted tasks or the shutdown by itself."""
        self._woken = True
        try:
            self._results.put((WAKE,))
        except (ValueError, ShmqError, OSError) as exc:
            log.debug("could not wake the pool's result thread: %s", exc)

    def _wake_supervisor(self) -> None:
        # also after _cleanup (a Pool collected long after its join terminates its engine
        # again): WakePipe writes nothing then
        self._wake.wake()

    # -- the supervisor thread --------------------------------------------------------------

    def _supervise(self) -> None:
        """Start the workers, restart the dead (after telling the collector what they held;
        a slot whose workers die :data:`UNSTARTED_MAX` times in a row before they start
        breaks the pool instead), stop them at the end, then remove the files."""
        crew, due = self._crew, list(range(self.workers))
        launched: dict[int, int] = {}  # slot -> its row's R_STARTS when its worker was made
        unstarted = dict.fromkeys(due, 0)  # slot -> its workers that died unstarted, in a row
        signal.pthread_sigmask(signal.SIG_BLOCK, ROUTED_SIGNALS)
        try:
            while not (self._stop_workers or self._terminate):
                for slot in list(due):
                    launched[slot] = self._board.row(slot).get(R_STARTS)
                    try:
                        # a process made now inherits this thread's mask (spawn and the
                        # fork server through exec too): made with the signals open
                        signal.pthread_sigmask(signal.SIG_UNBLOCK, ROUTED_SIGNALS)
                        try:
                            crew.start(slot)
                        finally:
                            signal.pthread_sigmask(signal.SIG_BLOCK, ROUTED_SIGNALS)
                        due.remove(slot)
                    except (OSError, ShmqError) as exc:
                        log.error("could not start pool worker %d (again in %g s): %s", slot,
                                  RESTART_RETRY_S, exc)
                dead, ready = crew.wait(RESTART_RETRY_S if due else None, [self._wake])
                if ready:
                    self._wake.drain()
                for w in dead:
                    row = self._board.row(w.key)
                    started = row.get(R_STARTS) != launched.get(w.key)
                    unstarted[w.key] = 0 if started else unstarted[w.key] + 1
                    held = reclaim(row)  # its single writer is gone
                    self._results.put((DIED, w.key, w.pid, w.exitcode, None if held is None else tuple(held)))
                    if unstarted[w.key] >= UNSTARTED_MAX and not (self._stop_workers or self._terminate):
                        with self._lock:
                            self._break(broken_pool(
                                f"pool worker {w.key}'s processes died before they started "
                                f"{unstarted[w.key]} times in a row (the last: {exit_text(w.exitcode)}, "
                                f"pid {w.pid}); under spawn and forkserver a worker imports the "
                                "main module: make the pool under `if __name__ == '__main__':`, "
                                "and check that what the calls need imports in a fresh interpreter"))
                    if not (self.broken or self._stop_workers or self._terminate):
                        due.append(w.key)
        except BaseException:  # noqa: BLE001
            log.exception("pool supervisor failed")
            with self._lock:
                self._break(broken_pool("the pool's supervisor thread failed"))
        finally:
            try:
                crew.stop(0.0 if self._terminate else STOP_GRACE_S, ask=lambda w: None)
            finally:
                crew.close()
                self._collector.join()
                self._cleanup()

    def _cleanup(self) -> None:
        for q in (self._requests, self._results):
            q.close()
        self._ring.close()
        self._board.close()
        self._wake.close()
        lifetime.forget(self)
        self.finished.set()

    # -- the collector thread ----------------------------------------------------------------

    def _collect(self) -> None:
        signal.pthread_sigmask(signal.SIG_BLOCK, ROUTED_SIGNALS)  # (see ROUTED_SIGNALS)
        try:
            while True:
                self._feed()
                with self._lock:
                    if self._terminate or (self.closing and not self._unfinished and not self._inbox):
                        break
                    # Idle only if nothing can be sent now: tasks that failed to pickle
                    # in _feed made room in the window, and a submit that landed after
                    # _feed looked saw the collector busy and rang no bell.  A full byte
                    # window waits for the replies that empty it.
                    self._take_inbox()
                    self._admit()
                    idle = not self._ready or self.broken is not None or self._bytes_full()
                    self._woken = False
                    self._idle = idle
                    if self._inbox:  # submitted meanwhile (see submit)
                        self._idle = False
                timeout = RECHECK_S if self._frames else IDLE_RECHECK_S
                try:
                    items = self._results.get_many(256, timeout=timeout if self._idle else 0)
                except Empty:
                    items = []
                finally:
                    self._idle = False
                for item in items:
                    self._handle(item)
                if self._frames and time.monotonic() >= self._next_look:
                    self._look()
        except BaseException as exc:  # noqa: BLE001  (the pool is broken; nobody hangs)
            log.exception("pool result thread failed")
            with self._lock:
                self._break(broken_pool(f"the pool's result thread failed: {exc!r}", exc))
        finally:
            if not self._terminate:
                try:  # each worker takes one and exits
                    send(self._ring, [STOP] * self.workers, 0)
                except (ShmqError, OSError, ValueError):
                    pass
            self._stop_workers = True
            self._wake_supervisor()

    def _admit(self) -> None:
        """Start waiting tasks while the window has room (lock held): from then on they run
        for their callers (a future cannot be cancelled any more), in the order submitted."""
        per = self._per_task
        ahead = 2 if per is None else max(2, int(WINDOW_S / max(per, 1e-7)))
        room = self.workers * ahead - self._admitted
        pending = self._pending
        if self._start is None:  # sinks that cannot be cancelled: admitting is counting
            n = max(0, min(room, len(pending) - self._ready))
            self._ready += n
            self._admitted += n
            return
        while room > 0 and self._ready < len(pending):
            t = pending[self._ready]
            if t.started or self._start(t.sink):
                t.started = True
                self._ready += 1
                self._admitted += 1
                room -= 1
            else:  # a future cancelled while it waited
                del pending[self._ready]
                t.done = True
                self._unfinished -= 1

    def _bundle(self) -> int:
        if self.max_tasks:
            return 1  # a worker counts frames against max_tasks_per_child: one task each
        per = self._per_task
        return 1 if per is None else max(1, min(BUNDLE_MAX, int(BUNDLE_S / max(per, 1e-7))))

    def _feed(self) -> bool:
        """Send the admitted tasks; False if none went, or if the byte window filled
        (the rest wait for replies: the caller may block on them)."""
        with self._lock:
            self._take_inbox()
            self._admit()
            n = self._ready
            if n <= 0 or self.broken is not None:
                return False
            batch = [self._pending.popleft() for _ in range(n)]
            self._ready = 0
        i = 0
        while i < len(batch):
            if self._bytes_full():  # the rest when room frees
                self._again(batch[i:], solo=False)
                return False
            if i == 0 and len(batch) > 1:  # alone: how big these tasks are is known once put
                frames = self._frames_of(batch[:1], 1)
            elif self._big():  # one task a frame, one frame a put: workers start at once
                frames = self._frames_of(batch[i:i + 1], 1)
            else:  # small ones: bundled, in one put
                frames = self._frames_of(batch[i:], self._bundle())
            self._send(frames)
            i += sum(len(f.tasks) for f in frames)
        return i > 0

    def _bytes_full(self) -> bool:
        """The frames in flight hold the byte window: more waits for their replies."""
        return bool(self._frames) and self._inflight_bytes >= self.workers * WINDOW_BYTES

    def _big(self) -> bool:
        """The last tasks put took :data:`SOLO_BYTES` or more of the ring each."""
        return self._task_bytes is not None and self._task_bytes >= SOLO_BYTES

    def _frames_of(self, batch: list[Task], k: int) -> list[_Frame]:
        """``batch`` in frames of up to ``k`` tasks (a task sent again after a loss alone)."""
        frames, i = [], 0
        while i < len(batch):
            if batch[i].solo:
                tasks = [batch[i]]
            else:
                j = i + 1
                while j < len(batch) and j - i < k and not batch[j].solo:
                    j += 1
                tasks = batch[i:j]
            frames.append(_Frame(self._next_wire, tasks))
            self._next_wire += len(tasks)
            i += len(tasks)
        return frames

    def _send(self, frames: list[_Frame]) -> None:
        """Put frames into the ring; one whose pickling fails is split, and a task that
        cannot be pickled fails alone, as the stdlib's do (the error itself)."""
        # The payload bytes put, not the positions passed: a growable ring's early wrap
        # skips to the next lap, and that gap is nobody's backlog.  Exact: ours is the
        # only writer (workers put STOPs only at the end).
        ctl = self._ring.ring.ctl
        before = ctl[W_PUT_BYTES]
        try:
            seqs = send(self._ring, [(f.first, [t.call for t in f.tasks]) for f in frames], 0)
        except (Full, TooLarge, Empty, ShmqError, OSError) as exc:
            if len(frames) > 1 or isinstance(exc, Full):
                return self._send_each(frames, exc)
            return self._fail_frame(frames[0], exc)
        except BaseException as exc:  # noqa: BLE001  (pickling runs the user's code)
            if len(frames) > 1 or len(frames[0].tasks) > 1:
                return self._send_each(frames, exc)
            return self._fail_frame(frames[0], exc)
        used = ctl[W_PUT_BYTES] - before
        ntasks = sum(len(f.tasks) for f in frames)
        self._task_bytes = used / ntasks
        for f, seq in zip(frames, seqs):
            f.seq = seq
            f.nbytes = used * len(f.tasks) // ntasks
            self._inflight_bytes += f.nbytes
            self._frames[seq] = f

    def _send_each(self, frames: list[_Frame], exc: BaseException) -> None:
        if isinstance(exc, Full):  # the ring is at its ceiling: later, in order
            self._again([t for f in frames for t in f.tasks], solo=False)
            return
        for f in frames:
            if len(f.tasks) == 1:
                self._send([f])
            else:
                self._send([_Frame(f.first + i, [t]) for i, t in enumerate(f.tasks)])

    def _fail_frame(self, frame: _Frame, exc: BaseException) -> None:
        for t in frame.tasks:
            if not t.done:
                self._finish(t, False, remote(exc, traceback_text(exc), self.face)
                             if self.face == "executor" else exc)

    def _finish(self, t: Task, ok: bool, value: Any) -> None:
        t.done = True
        t.call = None  # its function and arguments are not ours to keep
        with self._lock:
            self._unfinished -= 1
            self._admitted -= 1
        self._deliver(t.sink, t.index, ok, value)

    def _handle(self, item: tuple[Any, ...]) -> None:
        kind = item[0]
        if type(kind) is int:
            self._reply(*item)
        elif kind == DIED:
            self._died(*item[1:])
        elif kind == UNDECODABLE:
            self._undecodable(*item[1:])
        elif kind == INIT_FAILED:
            with self._lock:
                self._break(broken_pool(f"a worker's initializer raised (pid {item[2]}):\n{item[3]}"))
        # WAKE: the loop feeds next

    def _done_frame(self, seq: int) -> _Frame | None:
        frame = self._frames.pop(seq, None)
        if frame is not None:
            self._inflight_bytes -= frame.nbytes
        if frame is None or frame.done:
            return None  # a frame sent again meanwhile, answered twice
        frame.done = True
        return frame

    def _reply(self, seq: int, statuses: bytes, blob: bytes, bufs: list[Any], run_ns: int) -> None:
        frame = self._done_frame(seq)
        if frame is None:
            return
        try:
            values = unpack_values(blob, bufs)
        except BaseException as exc:  # noqa: BLE001  (the user's unpickling code, even SystemExit)
            if len(frame.tasks) > 1:  # which one? each again, alone: only it fails
                self._again(frame.tasks, solo=True)
            else:
                self._fail_frame(frame, broken_pool(
                    f"the task's result could not be unpickled: {type(exc).__name__}: {exc}", exc))
            return
        tasks = frame.tasks
        per = run_ns / 1e9 / len(tasks)
        self._per_task = per if self._per_task is None else 0.8 * self._per_task + 0.2 * per
        face, deliver, done = self.face, self._deliver, 0
        for t, st, v in zip(tasks, statuses, values):
            if t.done:
                continue
            t.done, t.call = True, None
            done += 1
            if st == OK:
                deliver(t.sink, t.index, True, v)
            else:
                deliver(t.sink, t.index, False, remote(v[0], v[1], face))
        with self._lock:  # once a frame, not once a task
            self._unfinished -= done
            self._admitted -= done

    def _undecodable(self, seq: int, exc: Any, tb: str) -> None:
        frame = self._done_frame(seq)
        if frame is None:
            return
        if len(frame.tasks) > 1:
            self._again(frame.tasks, solo=True)
            return
        err = broken_pool(f"the task's arguments could not be unpickled in its worker: {exc}")
        self._fail_frame(frame, remote(err, tb, self.face))  # the worker's traceback as its cause

    def _again(self, tasks: list[Task], solo: bool) -> None:
        """Send ``tasks`` again before anything else, each in a frame of its own."""
        again = [t for t in tasks if not t.done]
        for t in again:
            t.solo = t.solo or solo
        with self._lock:  # admitted already: at the head, before anything waiting
            self._pending.extendleft(reversed(again))
            self._ready += len(again)

    def _died(self, slot: int, pid: int, code: int | None, held: tuple[int, ...] | None) -> None:
        """A worker died: charge the task it was running, send the rest of its hands again."""
        if held is None:
            return  # nothing in hand (a frame taken but not yet shown: the Lookout's)
        n, lo, hi, frame_seq, running = held[:5]
        found = _LOOKOUT.finder(taken_up_to(self._ring, GROUP) or 0, held_ranges(self._board.w))
        lost = [f for seq, f in self._frames.items() if lo <= seq < hi and not found(seq)]
        charged = []
        running_frame = self._frames.get(frame_seq)
        if running_frame is not None:
            if running >= 0 and running_frame.first <= running < running_frame.first + len(running_frame.tasks):
                charged = [running_frame.tasks[running - running_frame.first]]
            else:  # it died decoding or answering the frame: each of its tasks
                charged = list(running_frame.tasks)
        why = exit_text(code)
        for t in charged:
            if t.done:
                continue
            t.codes = (t.codes or []) + [-1 if code is None else code]
            if len(t.codes) >= self.max_attempts:
                self._finish(t, False, _crashed(t, why, self.max_attempts))
        for f in lost:
            self._done_frame(f.seq)
            self._again(f.tasks, solo=True)
        log.warning("pool worker %d (pid %d) died (%s) holding %d task(s); restarted",
                    slot, pid, why, sum(len(f.tasks) for f in lost))

    def _look(self) -> None:
        """Frames neither queued, nor in a live worker's hands, nor answered, twice in a
        row: lost between a take and a row update.  Sent again, uncharged."""
        self._next_look = time.monotonic() + RECHECK_S
        found = _LOOKOUT.finder(taken_up_to(self._ring, GROUP) or 0, held_ranges(self._board.w))
        try:  # replies after the position and the rows: a frame answered meanwhile is answered
            for item in self._results.get_many(256, block=False):
                self._handle(item)
        except Empty:
            pass
        for f in _LOOKOUT.lost(list(self._frames.values()), found):
            if self._done_frame(f.seq) is not None:
                self._again(f.tasks, solo=True)

    def _break(self, exc: BaseException) -> None:
        """The pool is broken (lock held): every task not done fails with ``exc``; no new
        ones are taken."""
        if self.broken is not None:
            return
        with self._gate:  # no submit from now on: what is in the inbox fails too
            self.broken = exc
            self.closing = True
        self._take_inbox()
        tasks = list(self._pending)
        self._pending.clear()
        self._ready = self._admitted = 0
        for f in self._frames.values():
            tasks += f.tasks
        self._frames.clear()
        self._inflight_bytes = 0
        self._lock.release()
        try:
            for t in tasks:
                if not t.done:
                    t.done = True
                    self._deliver(t.sink, t.index, False, exc)
        finally:
            self._lock.acquire()
        self._unfinished = 0
        self._poke()


def _crashed(t: Task, why: str, max_attempts: int) -> BaseException:
    from ..errors import WorkerCrashed

    codes = tuple(t.codes or ())
    how = {exit_text(c) for c in codes}
    text = (f"the worker running this task died on each of its {len(codes)} attempts "
            f"({', '.join(sorted(how))}); not retried (max_attempts={max_attempts})")
    return WorkerCrashed(text, codes)


def context(ctx: Any) -> Any:
    """A multiprocessing context from a context, a start method name, or None (the default)."""
    if ctx is None or isinstance(ctx, str):
        return multiprocessing.get_context(ctx)
    return ctx
