"""Long-lived worker processes: start, restart, the parent-death signal, grace, stop.

The one place in shmq that starts and supervises worker processes (a
service's ``serve``, a dispatcher's supervisor and the process pools all
hold a :class:`Crew`); what to run, when to restart and what a death means
stay with them.

* **Start.** ``fork``: workers are forked by a *zygote*, a single-threaded
  child the crew forks when it is made (from the thread that makes it),
  because forking a process that runs threads (a pool's, a supervisor's)
  can deadlock the child on a lock another thread held.  The zygote holds
  the owner's memory as it was then: every worker it forks starts from that
  image, whatever the owner has done since.  ``spawn`` and ``forkserver``:
  ``multiprocessing`` starts them directly (a fresh interpreter, or a fork
  of the fork server: no threads of ours either way).
* **The parent-death signal.** Each worker arms ``PR_SET_PDEATHSIG``
  (Linux): when its parent dies it gets ``death_signal``.  The parent is
  the thread that started it (the owner's supervising thread, which lives
  as long as its workers) or the zygote (which exits when the owner does:
  it sees its pipe's end, or its parent change, within a second).  The
  fork server outlives the owner for as long as one of its children runs
  (each holds its "alive" pipe), so its workers watch the owner itself
  instead (a thread waiting on a pidfd of it).  A worker whose owner died
  before any of this was armed exits at once.  So a SIGKILLed owner leaves
  no worker behind for longer than a second.
* **Ctrl-C.** Workers ignore SIGINT unless their target installs a handler:
  the terminal sends it to the whole process group, and the owner decides.
* **Stop.** :meth:`Crew.stop` asks every worker to stop (SIGTERM, or the
  owner's own way), waits up to a grace period, SIGKILLs the rest and
  reaps them.

Exit codes are ``multiprocessing``'s: negative for a signal.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import multiprocessing.connection as mpc
import multiprocessing.util
import os
import select
import signal
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from .._lock import holder_alive, holder_word
from ..errors import ShmqError

__all__ = ["Crew", "WakePipe", "Worker", "arm_parent_death", "exit_text"]

log = logging.getLogger("shmq.workers")

PR_SET_PDEATHSIG = 1
#: The zygote looks at its parent this often (a SIGKILLed owner cannot close its pipe
#: for it when another process inherited the pipe's end).
ZYGOTE_LOOK_S = 1.0
#: A worker start tries this many zygotes (each forked again after the last died).
ZYGOTE_TRIES = 3
#: A worker SIGKILLed at the end of a stop is reaped within this.
REAP_S = 10.0
#: The zygote answers a start within this (a fork takes milliseconds), or it is taken
#: for hung (stopped, stuck in a fork that never returns) and replaced.
ZYGOTE_ANSWER_S = 30.0


def arm_parent_death(sig: int) -> None:
    """Linux: have ``sig`` delivered to this process when its parent (thread) dies."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def exit_text(code: int | None) -> str:
    """``"signal SIGKILL (9)"``, ``"exit code 1"``: how a worker ended, for messages."""
    if code is None:
        return "an unknown cause"
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name} ({-code})"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def _run(target: Callable[..., Any], args: tuple[Any, ...], key: Any, extra: tuple[Any, ...],
         owner: int, death_signal: int, ignore_sigint: bool, parent: int | None) -> None:
    """A worker process's first steps, then ``target(*args, key, *extra)``.

    ``parent``: the pid that forked or spawned us (None: the fork server, which
    outlives the owner); if it or the owner died before the death signal was
    armed, nobody would ever send it: exit now.
    """
    arm_parent_death(death_signal)
    if ignore_sigint:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    if parent is None:  # the fork server: it lives as long as any of its children does
        _watch_owner(owner, death_signal)
    if (parent is not None and os.getppid() != parent) or not holder_alive(owner):
        os._exit(0)
    target(*args, key, *extra)


def _watch_owner(owner: int, sig: int) -> None:
    """A thread that sends us ``sig`` when the owner exits (a pidfd becomes readable
    then; without pidfds, a look every second).  For workers of the fork server,
    whose parent never dies first: every child it forks holds its "alive" pipe."""
    try:
        fd: int | None = os.pidfd_open(owner & 0xFFFFFFFF)
    except (OSError, AttributeError):
        fd = None

    def watch() -> None:
        if fd is not None:
            select.select([fd], [], [])
        else:
            while holder_alive(owner):
                time.sleep(1.0)
        os.kill(os.getpid(), sig)

    threading.Thread(target=watch, name="shmq-owner-watch", daemon=True).start()


class Worker:
    """One worker process of a :class:`Crew`: ``key`` (the owner's name for its slot),
    ``pid``, ``exitcode`` (None while it runs, negative for a signal), ``extra`` (what
    it was started with besides the crew's arguments), ``started`` (monotonic s)."""

    __slots__ = ("key", "extra", "pid", "proc", "exitcode", "started")

    def __init__(self, key: Any, extra: tuple[Any, ...], pid: int, proc: Any) -> None:
        self.key, self.extra, self.pid, self.proc = key, extra, pid, proc
        self.exitcode: int | None = None
        self.started = time.monotonic()

    def __repr__(self) -> str:
        state = "running" if self.exitcode is None else exit_text(self.exitcode)
        return f"<shmq worker {self.key!r} pid {self.pid} {state}>"


class Crew:
    """The worker processes of one owner, each running ``target(*args, key, *extra)``.

    ``ctx``: a ``multiprocessing`` context or start method name.  ``name``
    prefixes the processes' names.  ``death_signal``: what a worker gets when
    its owner dies (SIGTERM lets it finish what it holds; SIGKILL ends it at
    once).  ``daemon``: ``multiprocessing``'s flag (a daemonic worker cannot
    start processes of its own).  Under ``fork`` the zygote is forked here,
    from the calling thread: make the crew before starting threads.

    ``args`` travel with the process (inherited by the zygote under ``fork``,
    pickled for ``spawn``): descriptors go there.  :meth:`start`'s ``extra``
    arguments are pickled to the zygote under ``fork``, and a descriptor so
    pickled goes through ``multiprocessing``'s resource sharer (a thread here).

    One thread drives a crew (:meth:`start`, :meth:`wait`, :meth:`stop`);
    workers started by a thread that exits get their death signal with it
    (spawn), so that thread must outlive them.
    """

    def __init__(self, ctx: Any, target: Callable[..., Any], args: tuple[Any, ...] = (), *,
                 name: str, death_signal: int = signal.SIGTERM, daemon: bool = False,
                 ignore_sigint: bool = True) -> None:
        self.ctx: Any = multiprocessing.get_context(ctx) if ctx is None or isinstance(ctx, str) else ctx
        self.name = name
        self._m = _Members()
        self.live = self._m.live  # key -> Worker, while it runs
        self._run_args = (target, args, holder_word(), int(death_signal), ignore_sigint)
        self._daemon = daemon
        self._exited: list[Worker] = []  # reported by the zygote, not handed out yet
        if self.ctx.get_start_method() == "fork":
            self._m.zygote = _Zygote(self.ctx, self._run_args, name)
        # multiprocessing joins non-daemonic children at exit: ours are stopped before
        # (and if the crew is dropped unclosed); the callback holds no reference to it
        self._finalizer = multiprocessing.util.Finalize(self, self._m.close, exitpriority=100)

    def start(self, key: Any, *extra: Any) -> Worker:
        """Start a worker for ``key`` (an owner's slot: one live worker per key).

        :raises shmq.ShmqError: the zygote is gone (``fork``), or a worker runs for ``key``.
        :raises OSError: the process could not be started.
        """
        if key in self.live:
            raise ShmqError(f"{self.name}: a worker for {key!r} is running already")
        if self._m.zygote is not None:
            for _ in range(ZYGOTE_TRIES):
                try:
                    pid = self._m.zygote.start(key, extra, self._exited)
                    break
                except _ZygoteHung as exc:
                    # Killed and replaced: a late answer would name a worker nobody
                    # tracks.  Its workers die with it (their death signal).
                    self._exited += self._replace_zygote(kill=True)
                    raise ShmqError(f"{self.name}: {exc}; killed it and forked another "
                                    f"(worker {key!r} not started)") from None
                except _ZygoteLost:
                    self._exited += self._replace_zygote()
            else:
                raise ShmqError(f"{self.name}: the worker zygote died {ZYGOTE_TRIES} times in a "
                                "row while starting a worker")
            w = Worker(key, extra, pid, None)
            self._m.zygote.workers[pid] = w
        else:
            target, args, owner, sig, ignore = self._run_args
            parent = None if self.ctx.get_start_method() == "forkserver" else os.getpid()
            proc = self.ctx.Process(target=_run, args=(target, args, key, extra, owner, sig, ignore,
                                                       parent),
                                    name=f"{self.name}-{key}", daemon=self._daemon)
            proc.start()
            w = Worker(key, extra, proc.pid, proc)
        self.live[key] = w
        return w

    def restart(self, w: Worker) -> Worker:
        """Start a new worker for a dead one's key, with the same arguments."""
        return self.start(w.key, *w.extra)

    def wait(self, timeout: float | None = None, extra: Iterable[Any] = ()) -> tuple[list[Worker], list[Any]]:
        """Block until a worker exits or one of ``extra`` (anything
        ``multiprocessing.connection.wait`` takes) is ready, for at most ``timeout``
        seconds; return the workers that exited (reaped, with their ``exitcode``) and the
        ready objects of ``extra``."""
        extra = list(extra)
        exited, self._exited = self._exited, []
        if exited:
            timeout = 0
        objs: dict[Any, Worker | None] = dict.fromkeys(extra)
        for w in self.live.values():
            if w.proc is not None:
                objs[w.proc.sentinel] = w
        zygote = self._m.zygote
        if zygote is not None:
            objs[zygote.conn] = None
        ready = mpc.wait(list(objs), timeout)
        others: list[Any] = []
        for o in ready:
            one = objs[o]
            if one is not None:
                one.proc.join()
                one.exitcode = one.proc.exitcode
                one.proc.close()
                exited.append(one)
            elif zygote is not None and o is zygote.conn:
                exited += zygote.reports()
                if zygote.dead:
                    exited += self._replace_zygote()
            else:
                others.append(o)
        for w in exited:
            if self.live.get(w.key) is w:
                del self.live[w.key]
        return [w for w in exited if w.exitcode is not None], others

    def _replace_zygote(self, kill: bool = False) -> list[Worker]:
        """The zygote died (killed: by hand, the OOM killer), or is hung (``kill``: it is
        SIGKILLed first): its workers got their death signal with it, and are reported
        exited with it (their true end is their new parent's to see).  A new zygote is
        forked, from this thread: a fork of a process that may run threads now, the
        risk the zygote exists to avoid, taken only here."""
        old = self._m.zygote
        assert old is not None
        if kill:
            old.proc.kill()
            old.proc.join(REAP_S)
        log.error("%s: the worker zygote (pid %d) %s; forking another", self.name, old.proc.pid,
                  "did not answer" if kill else f"died ({exit_text(old.proc.exitcode)})")
        old.close()
        lost = list(old.workers.values())
        for w in lost:
            w.exitcode = -self._run_args[3]
        self._m.zygote = _Zygote(self.ctx, self._run_args, self.name)
        return lost

    def signal(self, w: Worker, sig: int) -> None:
        """Send ``sig`` to worker ``w`` if it has not been reaped (never to a recycled pid)."""
        if w.exitcode is not None:
            return
        if self._m.zygote is not None:
            self._m.zygote.signal(w, sig)
        elif w.proc is not None and w.proc.exitcode is None:
            try:
                os.kill(w.pid, sig)
            except ProcessLookupError:
                pass

    def stop(self, grace: float = 0.0, ask: Callable[[Worker], Any] | None = None) -> list[Worker]:
        """Ask every worker to stop (``ask(worker)``, default SIGTERM), wait up to ``grace``
        seconds for them to exit, SIGKILL the rest; return them all, reaped."""
        done: list[Worker] = []
        for w in list(self.live.values()):
            if ask is None:
                self.signal(w, signal.SIGTERM)
            else:
                ask(w)
        end = time.monotonic() + grace
        while self.live and time.monotonic() < end:
            done += self.wait(max(0.0, end - time.monotonic()))[0]
        return done + self.kill_all()

    def kill_all(self) -> list[Worker]:
        """SIGKILL every live worker and reap them (bounded: :data:`REAP_S`)."""
        done: list[Worker] = []
        for w in list(self.live.values()):
            self.signal(w, signal.SIGKILL)
        end = time.monotonic() + REAP_S
        while self.live and time.monotonic() < end:
            done += self.wait(max(0.0, end - time.monotonic()))[0]
        for w in list(self.live.values()):
            log.error("%s: worker %d did not exit after SIGKILL", self.name, w.pid)
        return done

    def close(self) -> None:
        """Stop every worker at once (SIGKILL) and let the zygote go; idempotent."""
        if self.live:
            self.kill_all()
        self._finalizer()


class _Members:
    """What a crew must not leave behind: its live workers and its zygote."""

    def __init__(self) -> None:
        self.live: dict[Any, Worker] = {}
        self.zygote: _Zygote | None = None

    def close(self) -> None:
        """SIGKILL and reap every worker (at exit, or a crew dropped unclosed)."""
        for w in self.live.values():
            if w.proc is not None and w.proc.exitcode is None:
                w.proc.kill()
        for w in self.live.values():
            if w.proc is not None:
                w.proc.join(REAP_S)
        self.live.clear()
        if self.zygote is not None:
            self.zygote.close()  # it SIGKILLs its workers as it exits
            self.zygote = None


class _ZygoteLost(ShmqError):
    """The zygote's pipe broke: it is dead."""


class _ZygoteHung(ShmqError):
    """The zygote did not answer a start within :data:`ZYGOTE_ANSWER_S`."""


class _Zygote:
    """The single-threaded process that forks a ``fork`` crew's workers (see the module
    docstring), driven over a pipe: ``("start", key, extra)`` -> ``("started", key, pid)``,
    ``("signal", key, pid, sig)``, and it reports ``("exited", key, pid, code)``."""

    def __init__(self, ctx: Any, run_args: tuple[Any, ...], name: str) -> None:
        self.conn, child = ctx.Pipe(duplex=True)
        _owned_ends.add(self.conn.fileno())  # before the fork: the zygote must not hold it
        try:
            self.proc = ctx.Process(target=_zygote_main, args=(child, ctx, run_args, name, os.getpid()),
                                    name=f"{name}-zygote", daemon=False)
            self.proc.start()
        except BaseException:
            # No zygote: the number must leave _owned_ends before the fd is closed, or
            # every later fork would put /dev/null over whatever reuses the number
            _owned_ends.discard(self.conn.fileno())
            self.conn.close()
            raise
        finally:
            child.close()
        self.workers: dict[int, Worker] = {}  # pid -> worker, for its exit report
        self.dead = False

    def start(self, key: Any, extra: tuple[Any, ...], exited: list[Worker]) -> int:
        """Have the zygote fork a worker for ``key``; its pid.  Exit reports read
        meanwhile go to ``exited``.

        :raises _ZygoteLost: its pipe broke.
        :raises _ZygoteHung: no answer within :data:`ZYGOTE_ANSWER_S`.
        :raises OSError: it could not fork.
        """
        self._send(("start", key, extra))
        deadline = time.monotonic() + ZYGOTE_ANSWER_S
        while True:
            if not self.conn.poll(max(0.0, deadline - time.monotonic())):
                raise _ZygoteHung(f"the worker zygote (pid {self.proc.pid}) did not answer "
                                  f"within {ZYGOTE_ANSWER_S:g} s")
            msg = self._recv()
            if msg[0] == "started" and msg[1] == key:
                return msg[2]
            if msg[0] == "failed" and msg[1] == key:
                raise OSError(f"the zygote could not fork a worker: {msg[2]}")
            exited += self._report(msg)

    def reports(self) -> list[Worker]:
        """The exits reported so far (``dead`` is set if the pipe broke meanwhile)."""
        out: list[Worker] = []
        try:
            while self.conn.poll(0):
                out += self._report(self._recv())
        except (_ZygoteLost, OSError):
            self.dead = True
        return out

    def _report(self, msg: tuple[Any, ...]) -> list[Worker]:
        if msg[0] != "exited":
            return []
        w = self.workers.pop(msg[2], None)
        if w is None:
            return []
        w.exitcode = msg[3]
        return [w]

    def signal(self, w: Worker, sig: int) -> None:
        try:
            self._send(("signal", w.key, w.pid, sig))
        except _ZygoteLost:
            pass  # its workers got their death signal with it

    def _send(self, msg: tuple[Any, ...]) -> None:
        try:
            self.conn.send(msg)
        except (OSError, ValueError) as exc:
            raise _ZygoteLost(f"the worker zygote (pid {self.proc.pid}) is gone: {exc}") from None

    def _recv(self) -> tuple[Any, ...]:
        try:
            msg = self.conn.recv()
        except (EOFError, OSError) as exc:
            raise _ZygoteLost(f"the worker zygote (pid {self.proc.pid}) is gone: {exc!r}") from None
        return msg

    def close(self) -> None:
        try:
            self.conn.send(("exit",))
        except (OSError, ValueError):
            pass
        self.proc.join(REAP_S)
        if self.proc.exitcode is None:
            self.proc.kill()
            self.proc.join()
        _owned_ends.discard(self.conn.fileno())
        self.conn.close()


#: The owner's ends of its zygotes' pipes: let go in every process forked from the
#: owner afterwards, so that a zygote sees its pipe's end when the owner dies.
_owned_ends: set[int] = set()


def _close_owned_ends() -> None:
    # /dev/null over each end rather than close(): the child's copy of the Connection
    # still names the fd and closes it when collected, which must not hit a file the
    # child opened since under the same number
    null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    try:
        for fd in _owned_ends:
            try:
                os.dup2(null, fd, inheritable=False)
            except OSError:
                pass
    finally:
        os.close(null)
    _owned_ends.clear()


os.register_at_fork(after_in_child=_close_owned_ends)


def _zygote_main(conn: Any, ctx: Any, run_args: tuple[Any, ...], name: str, owner_pid: int) -> None:
    """The zygote: fork workers on request, report their exits; when the owner is gone
    (its pipe's end, or a new parent), SIGKILL them and exit."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the owner's handler: this is no owner
    target, args, owner, sig, ignore = run_args
    procs: dict[Any, tuple[Any, Any]] = {}  # sentinel -> (key, process)
    try:
        while os.getppid() == owner_pid:
            ready = mpc.wait([conn, *procs], ZYGOTE_LOOK_S)
            for s in ready:
                if s in procs:
                    key, p = procs.pop(s)
                    p.join()
                    conn.send(("exited", key, p.pid, p.exitcode))
                    p.close()
            if conn not in ready:
                continue
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                return
            if msg[0] == "exit":
                return
            if msg[0] == "start":
                _, key, extra = msg
                p = ctx.Process(target=_run, args=(target, args, key, extra, owner, sig, ignore,
                                                   os.getpid()),
                                name=f"{name}-{key}", daemon=False)
                try:
                    p.start()
                except Exception as exc:  # noqa: BLE001  (reported to the owner)
                    conn.send(("failed", key, repr(exc)))
                    continue
                procs[p.sentinel] = (key, p)
                conn.send(("started", key, p.pid))
            elif msg[0] == "signal":
                _, key, pid, s = msg
                for k, p in procs.values():
                    if p.pid == pid and p.exitcode is None:
                        os.kill(pid, s)
    finally:
        for _k, p in procs.values():
            if p.exitcode is None:
                p.kill()
        for _k, p in procs.values():
            p.join()


class WakePipe:
    """A self-pipe that wakes a supervising thread's :meth:`Crew.wait` (pass it among
    ``extra``: it has a ``fileno``).

    :meth:`wake` is safe from any thread and from a signal handler, before, during
    and after :meth:`close`: it never writes once :meth:`close` has begun, so its
    byte cannot land in whatever file took a closed descriptor's number next (a
    ring's magic, another pipe).  The write and the close hold one reentrant lock:
    a signal handler that wakes the pipe in the thread holding it goes through, and
    finds the pipe either open (its byte is read or discarded) or closed.  A fork
    while another thread holds it (a microsecond) leaves the child's copy held:
    fork before threads, as the crew's zygote does.
    """

    def __init__(self) -> None:
        self._r, self._w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._lock = threading.RLock()

    def fileno(self) -> int:
        """The read end (-1 once closed)."""
        return self._r

    @property
    def closed(self) -> bool:
        """True once close() has begun: wake() writes nothing from then on."""
        return self._w < 0

    def wake(self, byte: bytes = b"\0") -> None:
        """Make the read end readable (a full pipe is readable already)."""
        with self._lock:
            if self._w >= 0:
                try:
                    os.write(self._w, byte)
                except OSError:
                    pass

    def drain(self) -> None:
        """Read the pipe empty: its bytes are wake-ups, not data (the owner's thread)."""
        try:
            while os.read(self._r, 4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def close(self) -> None:
        """Close both ends; idempotent.  Marked closed before the descriptors go, so a
        :meth:`wake` re-entering from a signal handler in this thread writes nothing."""
        with self._lock:
            r, w = self._r, self._w
            self._r = self._w = -1
            for fd in (r, w):
                if fd >= 0:
                    os.close(fd)
