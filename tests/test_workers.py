"""The worker platform (shmq.workers): the crew of worker processes, the status board,
the at-least-once bookkeeping; and the boards of services and dispatchers on it."""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest

import shmq
from conftest import START_METHODS, assert_nothing_written_into, bound
from shmq.workers import Board, BoardBusy, Crew, Hands, Layout, Lookout, held_ranges, read_words, reclaim
from shmq.workers import holdings

HERE = os.path.dirname(os.path.abspath(__file__))
LAYOUT = Layout("test", 16, 4, 24, what="test board")
ANON = Layout("anon", 16, what="anonymous test board")  # its geometry chosen by its owner


# -- child entry points (importable under spawn) ----------------------------------------

def exit_with(key, how):
    """A worker: exit with ``how`` (an int), kill itself with a signal (-signal), or sleep."""
    if how == "sleep":
        time.sleep(600)
    elif how == "term-ignoring":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        time.sleep(600)
    elif how < 0:
        os.kill(os.getpid(), -how)
        time.sleep(600)
    sys.exit(how)


def parent_of_me(conn, key):
    conn.send((os.getpid(), os.getppid()))
    time.sleep(600)


# -- the crew ---------------------------------------------------------------------------

def _reap(crew, n):
    got = []
    end = time.monotonic() + bound(30)
    while len(got) < n and time.monotonic() < end:
        got += crew.wait(bound(30))[0]
    assert len(got) == n, got
    return got


@pytest.mark.parametrize("method", START_METHODS)
def test_crew_starts_reaps_restarts_and_stops(method):
    crew = Crew(method, exit_with, name="t")
    try:
        crew.start("a", 3)
        crew.start("b", -signal.SIGKILL)
        crew.start("c", "sleep")
        with pytest.raises(shmq.ShmqError, match="running already"):
            crew.start("c", "sleep")
        dead = {w.key: w for w in _reap(crew, 2)}
        assert {k: w.exitcode for k, w in dead.items()} == {"a": 3, "b": -signal.SIGKILL}
        assert list(crew.live) == ["c"]
        w = crew.restart(dead["a"])  # same key, same arguments, a new process
        assert w.pid != dead["a"].pid and _reap(crew, 1)[0] is w and w.exitcode == 3
        t = time.monotonic()
        [c] = crew.stop(grace=bound(30))  # SIGTERM: it exits at once
        assert c.key == "c" and c.exitcode == -signal.SIGTERM and time.monotonic() - t < bound(10)
        assert not crew.live
    finally:
        crew.close()


def test_crew_stop_kills_a_worker_that_ignores_sigterm_after_the_grace():
    crew = Crew("fork", exit_with, name="t")
    try:
        crew.start(0, "term-ignoring")
        time.sleep(0.2)  # let it install SIG_IGN (the grace below is what is measured)
        t = time.monotonic()
        [w] = crew.stop(grace=0.5)
        took = time.monotonic() - t
        assert w.exitcode == -signal.SIGKILL and 0.5 <= took < bound(10)
    finally:
        crew.close()


@pytest.mark.parametrize("method", START_METHODS)
def test_a_worker_knows_its_parent_and_a_fork_worker_comes_from_the_zygote(method):
    import multiprocessing as mp

    r, w = mp.Pipe(duplex=False)
    # in the crew's arguments, not start()'s: under fork those are pickled to the zygote,
    # and a descriptor so pickled goes through multiprocessing's resource sharer (a thread)
    crew = Crew(method, parent_of_me, (w,), name="t")
    try:
        crew.start(0)
        assert r.poll(bound(60))
        pid, ppid = r.recv()
        assert pid == crew.live[0].pid
        if method == "spawn":
            assert ppid == os.getpid()
        else:  # the zygote, or the fork server: never this (maybe threaded) process
            assert ppid != os.getpid()
    finally:
        crew.close()
        r.close()
        w.close()


def _starts_a_thread_then_a_worker():
    """Forks are checked (conftest): with a thread running here, the crew's fork worker
    must come from its zygote, never from a fork of this process."""
    crew = Crew("fork", exit_with, name="t")
    stop = threading.Event()
    t = threading.Thread(target=stop.wait)
    t.start()
    try:
        crew.start(0, 7)
        assert _reap(crew, 1)[0].exitcode == 7
    finally:
        stop.set()
        t.join()
        crew.close()


def test_a_fork_crew_forks_nothing_here_once_threads_run():
    _starts_a_thread_then_a_worker()


def test_a_zygote_that_fails_to_start_leaves_no_descriptor_marked(monkeypatch):
    # A fork that fails (here: refused, as the suite's fork check refuses one beside a
    # thread) must not leave the pipe's number in the set every later fork's child puts
    # /dev/null over: that number is reused by the next file opened.
    import multiprocessing

    from shmq.workers import processes

    def refused(self):
        raise OSError("fork refused")

    before = set(processes._owned_ends)
    fds_before = set(os.listdir("/proc/self/fd"))
    monkeypatch.setattr(multiprocessing.get_context("fork").Process, "start", refused)
    with pytest.raises(OSError, match="fork refused"):
        Crew("fork", exit_with, name="t", death_signal=signal.SIGKILL)
    assert processes._owned_ends == before
    assert set(os.listdir("/proc/self/fd")) <= fds_before  # both ends of the pipe closed
    monkeypatch.undo()
    crew = Crew("fork", exit_with, name="t", death_signal=signal.SIGKILL)  # and it works again
    try:
        crew.start("a", 3)
        assert _reap(crew, 1)[0].exitcode == 3
    finally:
        crew.close()


def test_a_killed_zygote_is_replaced_and_its_workers_reported():
    crew = Crew("fork", exit_with, name="t", death_signal=signal.SIGKILL)
    try:
        a = crew.start("a", "sleep")
        zygote = psutil.Process(a.pid).parent()
        assert zygote.pid != os.getpid()
        zygote.kill()
        [lost] = _reap(crew, 1)
        assert lost is a and lost.exitcode == -signal.SIGKILL  # its death signal
        assert not psutil.pid_exists(a.pid) or psutil.Process(a.pid).wait(bound(10)) is not False
        b = crew.start("a", "sleep")  # a new zygote forks it (alive while we look at its parent)
        assert psutil.Process(b.pid).parent().pid not in (zygote.pid, os.getpid())
        os.kill(b.pid, signal.SIGTERM)
        assert _reap(crew, 1)[0].exitcode == -signal.SIGTERM
    finally:
        crew.close()


def test_a_hung_zygote_is_a_clear_error_and_is_replaced(monkeypatch):
    from shmq.workers import processes

    crew = Crew("fork", exit_with, name="t", death_signal=signal.SIGKILL)
    try:
        a = crew.start("a", "sleep")
        zygote = psutil.Process(a.pid).parent()
        zygote.suspend()  # SIGSTOP: alive, its pipe open, never answering
        # the short bound for this start only: a loaded machine may take longer than
        # 0.5 s to run a healthy zygote's first or replacement answer
        monkeypatch.setattr(processes, "ZYGOTE_ANSWER_S", 0.5)
        t = time.monotonic()
        with pytest.raises(shmq.ShmqError, match=rf"zygote \(pid {zygote.pid}\) did not answer "
                                                 r"within 0.5 s.*worker 'b' not started"):
            crew.start("b", 5)
        assert time.monotonic() - t < bound(10)
        monkeypatch.undo()
        assert not zygote.is_running()  # killed and reaped, not left stopped
        [lost] = _reap(crew, 1)  # its worker went with it, and is reported
        assert lost is a and lost.exitcode == -signal.SIGKILL
        b = crew.start("b", "sleep")  # a new zygote forks it (alive while we look at its parent)
        assert psutil.Process(b.pid).parent().pid not in (zygote.pid, os.getpid())
        os.kill(b.pid, signal.SIGTERM)
        assert _reap(crew, 1)[0].exitcode == -signal.SIGTERM
    finally:
        crew.close()


OWNER = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {here!r})
    from shmq.workers import Crew
    from test_workers import exit_with
    if __name__ == "__main__":
        crew = Crew(sys.argv[1], exit_with, name="t", death_signal=int(sys.argv[2]))
        for i in range(2):
            crew.start(i, "term-ignoring" if sys.argv[2] == "9" else "sleep")
        print(" ".join(str(w.pid) for w in crew.live.values()), flush=True)
        time.sleep(600)
""")


@pytest.mark.parametrize("method", START_METHODS)
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_sigkilled_owner_leaves_no_worker(method, sig):
    """The parent-death signal (armed by every worker, whoever forked it) ends the workers
    within a second of their owner's SIGKILL, even ones that ignore SIGTERM."""
    p = subprocess.Popen([sys.executable, "-c", OWNER.format(here=HERE), method, str(int(sig))],
                         stdout=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline()
        pids = [int(x) for x in line.split()]
        assert len(pids) == 2, line
        procs = [psutil.Process(x) for x in pids]
    finally:
        p.kill()
        p.wait()
        p.stdout.close()
    end = time.monotonic() + bound(10)

    def gone(x):
        try:
            return x.status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True
    while not all(gone(x) for x in procs) and time.monotonic() < end:
        time.sleep(0.01)
    alive = [x.pid for x in procs if not gone(x)]
    for x in alive:
        os.kill(x, signal.SIGKILL)
    assert not alive


# -- the board --------------------------------------------------------------------------

def test_board_claims_rows_and_takes_over_a_dead_holders(spool_dir):
    path = os.path.join(spool_dir, "b")
    Board.create(path, LAYOUT)
    rows = [Board.claim_row(path, LAYOUT) for _ in range(2)]
    assert rows[0].index == rows[1].index  # the row this process holds already
    r = rows[0]
    holdings.hold_range(r, 4, 9, 2)
    r.add(16, 5)  # a kind's own word
    dead = 1 | (1 << 32)  # pid 1 with a start time it never had: a dead holder
    for i in range(LAYOUT.rows):
        if i != r.index:
            r.board.row(i).set(0, dead)
    r.set(0, dead)
    again = Board.claim_row(path, LAYOUT)  # every row's holder dead: ours is taken over
    assert again is not None and again.holder != dead
    assert holdings.peek(again).n == 0 and again.get(16) == 5  # holding cleared, counters kept
    w = read_words(path, LAYOUT)
    assert held_ranges(w) == []
    for x in (r, again):
        x.board.close()


def test_an_owned_board_is_exclusive_and_says_who_owns_it(spool_dir):
    path = os.path.join(spool_dir, "owned")
    lay = Layout("owned", 16, what="owned board")
    b, before = Board.own(path, lay, 3, 20)
    try:
        assert before is None
        b.publish()
        with pytest.raises(BoardBusy, match=f"pid {os.getpid()}") as ei:
            Board.own(path, lay, 3, 20)
        assert ei.value.owner == os.getpid()
    finally:
        b.close()
    b, before = Board.own(path, lay, 3, 20)  # the flock went with the close
    assert before is not None and len(before) == lay.file_bytes(3, 20)
    b.close()


def test_an_anonymous_board_is_shared_with_a_forked_child():
    import multiprocessing as mp

    b = Board.anonymous(ANON, 2, 24)
    ctx = mp.get_context("fork")

    def child():
        mine = Board.attach_fd(b.fd, ANON).row(1)
        mine.hold()
        holdings.working_on(mine, 41, 7)
        holdings.hold_range(mine, 40, 43, 3)
        os.kill(os.getpid(), signal.SIGKILL)

    p = ctx.Process(target=child)
    p.start()
    p.join(bound(30))
    held = reclaim(b.row(1))
    assert held is not None and (held.n, held.lo, held.hi, held.frame, held.running) == (3, 40, 43, 41, 7)
    assert reclaim(b.row(1)) is None  # emptied
    b.close()


def test_hands_publish_what_is_held_and_lookout_finds_the_lost():
    b = Board.anonymous(ANON, 1, 24)
    row = b.row(0)
    row.hold()
    h = Hands(row)
    h.took([10, 11, 12])
    h.count(11, 5)
    assert holdings.peek(row)[:3] == (7, 10, 13)
    h.answered(10)
    h.answered(11, 5)
    h.publish()
    assert holdings.peek(row)[:3] == (1, 12, 13)

    class Item:
        def __init__(self, seq, attempt=1):
            self.seq, self.attempt, self.strikes, self.done = seq, attempt, 0, False

    items = [Item(9), Item(12), Item(20), Item(-1), Item(5, attempt=2)]
    live = [(12, 13, 0, 0)]
    look = Lookout(strikes=2, again=4)
    assert look.lost(items, look.finder(15, live)) == []  # one strike each for 9 and 5
    lost = look.lost(items, look.finder(15, live))
    assert [p.seq for p in lost] == [9]  # twice found nowhere; 5 (sent again) needs four
    expired = look.finder(15, [(12, 13, time.time_ns() - 2_000_000_000, 1_000_000_000)])
    assert not expired(12) and expired(20)  # a held range past its lease does not count
    b.close()


# -- older boards of services and dispatchers -------------------------------------------

def _legacy(path, magic, words):
    with open(path, "wb") as f:
        f.write(magic + (2).to_bytes(8, "little") + bytes(8 * words))


def test_an_older_service_board_is_refused_by_readers_and_rewritten_by_the_service(spool_dir):
    from shmq.rpc import board as B

    path = os.path.join(spool_dir, "svc")
    shmq.Service(path).close()
    _legacy(path + ".svc", b"SHMQSVC1", 1000)
    with pytest.raises(shmq.ShmqError, match="older shmq .*SHMQSVC1.*start the service with this "
                                             "shmq.*or remove"):
        B.service_status(path)
    res = subprocess.run([sys.executable, "-m", "shmq", "stat", path], capture_output=True,
                         text=True, timeout=bound(60))
    assert res.returncode == 0 and "older shmq" in res.stdout, res.stdout + res.stderr
    svc, cl = shmq.Service(path), shmq.Client(path)  # the service serves on ...
    try:
        t = threading.Thread(target=lambda: next(iter(svc)).reply("ok"))
        t.start()
        assert cl.call("x", timeout=bound(30)) == "ok"
        t.join(bound(30))
        assert B.service_status(path)["calls"] == 1  # ... and its board is this shmq's
    finally:
        cl.close()
        svc.close()
    shmq.Service.destroy(path)


def test_an_older_dispatcher_board_is_refused_by_status_and_rewritten_by_start(spool_dir):
    from shmq.dispatch import Dispatcher, status

    path = os.path.join(spool_dir, "jobs")
    _legacy(path + ".dispatch", b"SHMQDSP1", 4000)
    with pytest.raises(shmq.ShmqError, match="older shmq .*SHMQDSP1.*start the dispatcher with "
                                             "this shmq.*or remove"):
        status(path)
    d = Dispatcher(path, start_method="spawn")
    d.register("noop", holdings.peek)  # any importable callable: never called here
    d.start()
    try:
        assert status(path, queues=False)["state"] == "running"
    finally:
        d.close()
    Dispatcher.destroy(path, ["noop"])
    assert not os.path.lexists(path + ".dispatch")


def test_one_module_starts_worker_processes():
    """Every process shmq starts comes from shmq.workers.processes (the demo and
    ``shmq bench`` aside): no other module calls a ``Process(...)`` constructor,
    ``os.fork`` or ``subprocess``."""
    import ast

    root = os.path.dirname(shmq.__file__)
    allowed = {"workers/processes.py", "demo.py", "cli/bench.py"}
    starters = {}
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, root)
            with open(path) as f:
                tree = ast.parse(f.read(), path)
            for node in ast.walk(tree):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                    f = node.func
                    owner = f.value.id if isinstance(f.value, ast.Name) else ""
                    if f.attr == "Process" or (owner == "os" and f.attr in ("fork", "forkpty")) \
                            or owner == "subprocess":
                        starters.setdefault(rel, []).append(node.lineno)
    assert set(starters) - allowed == set(), starters
    assert "workers/processes.py" in starters


# -- the wake pipe ----------------------------------------------------------------------


def test_a_wake_pipe_wakes_a_crews_wait_and_drains():
    from shmq.workers import WakePipe
    import multiprocessing.connection as mpc
    pipe = WakePipe()
    try:
        assert mpc.wait([pipe], 0) == []
        pipe.wake()
        pipe.wake()
        assert mpc.wait([pipe], bound(5)) == [pipe]
        pipe.drain()
        assert mpc.wait([pipe], 0) == []
    finally:
        pipe.close()
    assert pipe.closed and pipe.fileno() == -1
    pipe.close()  # idempotent


def test_a_closed_wake_pipe_writes_nothing_into_the_number_it_freed():
    # The byte of a wake() after close() would corrupt whatever file took the
    # write end's number (a ring's magic, a zygote's pipe).
    from shmq.workers import WakePipe
    pipe = WakePipe()
    freed = pipe._w
    pipe.close()
    assert_nothing_written_into(freed, pipe.wake)


def test_a_signal_handler_wakes_the_pipe_in_the_thread_that_holds_its_lock():
    # wake() and close() hold one lock; a signal handler that wakes the pipe runs in the
    # main thread, which may be inside either.  It must go through, not deadlock (in a
    # child: a deadlock fails by the timeout instead of hanging the suite).
    code = textwrap.dedent("""
        import signal
        import multiprocessing.connection as mpc
        from shmq.workers import WakePipe
        pipe = WakePipe()
        signal.signal(signal.SIGUSR1, lambda *a: pipe.wake())
        with pipe._lock:  # as wake() or close() holds it
            signal.raise_signal(signal.SIGUSR1)
        assert mpc.wait([pipe], 5) == [pipe]
        with pipe._lock:  # inside close(), after it marked the pipe closed
            pipe._r, pipe._w, r, w = -1, -1, pipe._r, pipe._w
            signal.raise_signal(signal.SIGUSR1)
        import os
        os.close(r)
        os.close(w)
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=bound(60))
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stdout + out.stderr
