"""Thread safety and signal safety of handles.

* 8 threads in each of 2 processes share one Queue / JoinableQueue /
  WorkQueue handle per process and move every item exactly once;
* many threads block on one handle at once and all wake;
* a SIGINT storm (a handler raising KeyboardInterrupt every ~0.3 ms) against
  put/reserve/get/put_many/get_many never leaves a shared lock held;
* SIGALRM every 5 ms keeps blocking timeouts;
* a SIGSTOPped writer-lock holder makes other processes time out, not hang.

Every wait is bounded; synchronization is by events, pipes and the spool.
Child-process entry points live here (importable under spawn).
"""

import array
import logging
import os
import signal
import threading
import time
import traceback

import pytest

import shmq
from shmq import _format as F
from conftest import bound, join_all

# --------------------------------------------------------------------------
# 8 threads x 2 processes

PROCS = 2
THREADS = 8
PRODUCERS = 4  # per process; the other 4 threads consume
CONSUMERS = THREADS - PRODUCERS
#: Items moved per test (each item exactly once).
TOTAL = {"queue": 100_000, "joinable": 100_000, "work": 100_000}
STOP = None  # the sentinel: one per consumer thread


def _take(kind, handle, t):
    """One consuming step of consumer thread ``t``: a list of items (messages acked)."""
    if kind == "work":
        msgs = handle.get_many(1 + t * 5, timeout=bound(60), lease=300)
        for m in msgs:
            m.ack()
        return [m.body for m in msgs]
    if t % 2:
        return handle.get_many(1 + t * 5, timeout=bound(60))
    return [handle.get(timeout=bound(60))]


def _mover(kind, handle, proc_id, per_producer, produced, conn):
    """Child: 4 producer and 4 consumer threads sharing one handle; report what was consumed."""
    errors, got = [], [[] for _ in range(CONSUMERS)]

    def produce(t):
        base = (proc_id * PRODUCERS + t) * per_producer
        i = 0
        while i < per_producer:
            n = min(1 + (i % 13) if t % 2 else 1, per_producer - i)  # put and put_many
            if n == 1:
                handle.put(base + i)
            else:
                handle.put_many(list(range(base + i, base + i + n)))
            i += n

    def consume(t):
        out = got[t]
        while True:
            items = _take(kind, handle, t)
            stops = sum(1 for x in items if x is STOP)
            out += [x for x in items if x is not STOP]
            if kind == "joinable":
                for _ in items:
                    handle.task_done()
            if stops:
                for _ in range(stops - 1):  # took another thread's sentinel: give it back
                    handle.put(STOP)
                return

    def guarded(fn, t):
        try:
            fn(t)
        except BaseException as exc:  # reported to the parent, which fails the test
            errors.append(f"{fn.__name__}[{t}]: {exc!r}")

    prods = [threading.Thread(target=guarded, args=(produce, t)) for t in range(PRODUCERS)]
    cons = [threading.Thread(target=guarded, args=(consume, t)) for t in range(CONSUMERS)]
    for th in prods + cons:
        th.start()
    for th in prods:
        th.join(bound(120))
    produced.set()
    for th in cons:
        th.join(bound(120))
    errors += [f"thread {th.name} hung" for th in prods + cons if th.is_alive()]
    ids = array.array("q", [x for part in got for x in part])
    conn.send((errors, ids.tobytes()))
    conn.close()
    if kind == "work":
        handle.close()


def _make_handle(kind, spool_dir):
    if kind == "queue":
        return shmq.Queue(capacity="4MiB")
    if kind == "joinable":
        return shmq.JoinableQueue(capacity="4MiB")
    return shmq.WorkQueue(os.path.join(spool_dir, "wq"), capacity="4MiB", dead_capacity="64KiB")


@pytest.mark.parametrize("kind", ["queue", "joinable", "work"])
def test_8_threads_x_2_processes_move_every_item_once(ctx, spool_dir, kind):
    total = TOTAL[kind]
    per_producer = total // (PROCS * PRODUCERS)
    handle = _make_handle(kind, spool_dir)
    pipes, procs, produced = [], [], []
    try:
        for proc_id in range(PROCS):
            recv, send = ctx.Pipe(duplex=False)
            done = ctx.Event()
            pipes.append(recv)
            produced.append(done)
            procs.append(ctx.Process(target=_mover,
                                     args=(kind, handle, proc_id, per_producer, done, send)))
        for p in procs:
            p.start()
        for done in produced:
            assert done.wait(bound(120)), "producers did not finish"
        for _ in range(PROCS * CONSUMERS):
            handle.put(STOP)
        results = [r.recv() if r.poll(bound(120)) else None for r in pipes]
        assert join_all(procs, 60) == [0] * PROCS
        if kind == "joinable":
            assert handle.join(timeout=bound(30)), "join() did not return after every task_done()"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(bound(5))
        handle.close()
    ids = []
    for res in results:
        assert res is not None, "a child did not report"
        errors, raw = res
        assert errors == []
        ids += array.array("q", raw)
    assert len(ids) == total  # nothing lost, nothing delivered twice
    assert sorted(ids) == list(range(total))


def _blocked_getter(take, barrier, out, errors):
    try:
        barrier.wait(bound(30))
        out.append(take())
    except BaseException as exc:
        errors.append(repr(exc))


@pytest.mark.parametrize("handle_kind", ["queue", "anonymous", "named", "group"])
def test_32_threads_blocked_on_one_handle_all_wake(spool_path, handle_kind, ctx):
    """32 threads park in get() on ONE handle; 32 puts from another process wake all of them."""
    n = 32
    q = sp = None
    if handle_kind == "queue":
        q = shmq.Queue(capacity="1MiB")
        take, bell = (lambda: q.get(timeout=bound(30))), q._spool.data_bell
        path = q.path
    else:
        sp = shmq.Spool.create(spool_path, capacity="1MiB")
        r = sp.reader() if handle_kind == "anonymous" else sp.reader(
            "r", group=handle_kind == "group")
        take, bell = (lambda: r.get(timeout=bound(30)).data), sp.data_bell
        path = spool_path
    out, errors = [], []
    barrier = threading.Barrier(n + 1)
    threads = [threading.Thread(target=_blocked_getter, args=(take, barrier, out, errors))
               for _ in range(n)]
    # The putter starts before the threads (forking a multi-threaded process is
    # refused, see conftest) and puts once told to.
    go = ctx.Event()
    child = ctx.Process(target=_put_items, args=(path, n, go))
    child.start()
    try:
        for th in threads:
            th.start()
        barrier.wait(bound(30))
        # every thread registered as a waiter: all 32 are parked on the one handle
        deadline = time.monotonic() + bound(30)
        while bell.sem.value < n and time.monotonic() < deadline:
            time.sleep(0.001)
        assert bell.sem.value == n
        go.set()
        assert join_all([child]) == [0]
        for th in threads:
            th.join(bound(30))
        assert not any(th.is_alive() for th in threads)
        assert errors == []
        assert sorted(out) == sorted(b"item-%d" % i for i in range(n))  # each item once
        assert bell.sem.value == 0  # every waiter unregistered
    finally:
        go.set()
        join_all([child])
        if q is not None:
            q.close()
        if sp is not None:
            sp.close()


def _put_items(path, n, go=None):
    if go is not None and not go.wait(bound(60)):
        raise SystemExit("never told to put")
    sp = shmq.Spool.open(path)
    for i in range(n):
        sp.put(b"item-%d" % i)  # (bytes travel raw through shmq.Queue too)
    sp.close()


# --------------------------------------------------------------------------
# signals

BIG_RECOVERY_S = 60.0  # a wedged lock shows as a timeout, never as a silent recovery


def _storm_step(i, end, sp, named, group, queue):
    """One put/reserve/get/put_many/get_many (True: time is up)."""
    if time.monotonic() >= end:
        return True
    k = i % 8
    try:
        if k == 0 and i % 16:
            with sp.reserve(12) as buf:  # interrupted inside: abandoned; before the block: dropped
                buf[:] = b"r%011d" % i
        elif k == 0:
            sp.put(b"p%d" % i)
        elif k == 1:
            sp.put_many([b"m%d" % i, b"n%d" % i, b"o%d" % i])
        elif k == 2:
            named.get(block=False)
        elif k == 3:
            group.get_many(4, block=False)
        elif k == 4:
            queue.put(("q", i))
        elif k == 5:
            queue.put_many([("a", i), ("b", i)])
        elif k == 6:
            queue.get_many(8, block=False)
        else:
            group.get(block=False)
            named.get_many(5, block=False)
            queue.get(block=False)
    except shmq.Empty:
        pass
    return False


def _storm_loop(step_args, errors):
    """Run steps until time is up, absorbing the KeyboardInterrupts raised inside them."""
    i = ops = 0
    _armed[0] = True  # (here the handler never raises: safe to arm)
    while True:
        i += 1
        try:
            if _storm_step(i, *step_args):
                _armed[0] = False  # (here the handler never raises: safe to disarm)
                return ops
            ops += 1
        except KeyboardInterrupt:
            pass
        except Exception:  # anything else is a failure, reported to the parent
            _armed[0] = False  # no KeyboardInterrupt while formatting it (it would escape)
            errors.append(traceback.format_exc())
            _armed[0] = True


_raised = [0]
_armed = [False]  # only _storm_loop arms it: the storm may begin while ready.set() runs


def _raise_kbi(signum, frame):
    # KeyboardInterrupt at any bytecode of shmq's code and of the step (C calls
    # included), never in _storm_loop's own bookkeeping, where it would escape
    # the try that absorbs it. A second SIGINT can arrive while this handler
    # runs (at its first bytecode): then ``frame`` is this handler's own frame,
    # and what counts is the frame the first call interrupted.
    while frame is not None and frame.f_code is _raise_kbi.__code__:
        frame = frame.f_back
    if not _armed[0] or frame is not None and frame.f_code is _storm_loop.__code__:
        return
    _raised[0] += 1
    raise KeyboardInterrupt


def _storm_victim(spool_path, queue, seconds, ready, conn):
    """Loop over put/get/put_many/get_many for ``seconds`` while SIGINTs raise KeyboardInterrupt."""
    signal.signal(signal.SIGINT, _raise_kbi)
    sp = shmq.Spool.open(spool_path, recovery_timeout=BIG_RECOVERY_S)
    named = sp.reader("named")
    group = sp.reader("grp", group=True)
    errors = []
    ready.set()
    try:
        ops = _storm_loop((time.monotonic() + seconds, sp, named, group, queue), errors)
    except BaseException:  # escaped the loop: report it instead of dying silently
        _armed[0] = False
        ops = -1
        errors.append(traceback.format_exc())
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (disarmed: nothing raises here)
    conn.send((ops, _raised[0], errors[:5]))
    conn.close()


def _group_holder_word(sp, name):
    for r in sp.readers():
        if r.name == name:
            return sp.slots.words[r.slot * F.SLOT_WORDS + F.S_LOCK_HOLDER]
    raise KeyError(name)


def test_sigint_storm_never_leaves_a_lock_held(ctx, spool_path, caplog):
    sp = shmq.Spool.create(spool_path, capacity="1MiB", recovery_timeout=BIG_RECOVERY_S)
    sp.reader("named").close()
    sp.reader("grp", group=True).close()
    q = shmq.Queue(capacity="1MiB")
    recv, send = ctx.Pipe(duplex=False)
    ready = ctx.Event()
    victim = ctx.Process(target=_storm_victim, args=(spool_path, q, 2.0, ready, send))
    stop = threading.Event()
    sent = [0]

    def storm():
        while not stop.is_set():
            try:
                os.kill(victim.pid, signal.SIGINT)
            except ProcessLookupError:
                return
            sent[0] += 1
            time.sleep(0.0003)

    stormer = threading.Thread(target=storm)
    try:
        victim.start()
        assert ready.wait(bound(60))
        stormer.start()
        res = recv.recv() if recv.poll(bound(60)) else None
        stop.set()
        stormer.join(bound(10))
        assert join_all([victim], 30) == [0]
        assert res is not None, "the victim did not report"
        ops, interrupts, errors = res
        assert errors == [], "\n".join(errors)
        assert interrupts > 100 and ops > 100, (ops, interrupts, sent[0])

        qsp = q._spool
        for s in (sp, qsp):
            assert s.stats().lock_pid == 0  # nobody holds the writer lock
        assert _group_holder_word(sp, "grp") == 0
        assert _group_holder_word(qsp, "queue") == 0
        # another process's next put / group get / queue put+get: fast, no recovery
        caplog.set_level(logging.WARNING, logger="shmq")
        other = shmq.Spool.open(spool_path, recovery_timeout=BIG_RECOVERY_S)
        try:
            t = time.monotonic()
            seq = other.put(b"after the storm", timeout=bound(5))
            other.put_many([b"x", b"y"], timeout=bound(5))
            g = other.reader("grp", group=True)
            with pytest.raises(shmq.Empty):
                while True:
                    g.get_many(1000, block=False)
            q.put("after", timeout=bound(5))
            while q.get(timeout=bound(5)) != "after":
                pass
            # A lock left held would cost BIG_RECOVERY_S (60 s) here; the bound is
            # loose so a loaded machine (CPU burner, parallel workers) passes too.
            assert time.monotonic() - t < 10.0
            assert other.read_at(seq).data == b"after the storm"
            assert other.stats().lock_breaks == 0 and qsp.stats().lock_breaks == 0
            assert _group_holder_word(other, "grp") == 0
        finally:
            other.close()
        assert not [r for r in caplog.records if "recovered" in r.getMessage()]
    finally:
        stop.set()
        if stormer.is_alive():
            stormer.join(bound(10))
        if victim.is_alive():
            victim.kill()
            victim.join(bound(5))
        q.close()
        sp.close()


class _Alarms:
    """SIGALRM every 5 ms while active (counted), restored afterwards."""

    def __init__(self):
        self.count = 0

    def _handler(self, signum, frame):
        self.count += 1

    def __enter__(self):
        self._old = signal.signal(signal.SIGALRM, self._handler)
        signal.setitimer(signal.ITIMER_REAL, 0.005, 0.005)
        return self

    def __exit__(self, *exc):
        signal.setitimer(signal.ITIMER_REAL, 0, 0)
        signal.signal(signal.SIGALRM, self._old)


def _timed(call, exc_type):
    t = time.monotonic()
    with pytest.raises(exc_type):
        call()
    return time.monotonic() - t


TIMEOUT_S = 0.5
SLACK_S = 1.5  # generous upper bound for a loaded 2-CPU machine


def test_sigalrm_every_5ms_keeps_blocking_timeouts(make_spool):
    empty = make_spool(capacity="64KiB")
    anon, named, group = empty.reader(), empty.reader("n"), empty.reader("g", group=True)
    full = make_spool(capacity="4KiB", on_full="block")
    keeper = full.reader("keeper")  # consumes nothing: the ring stays full
    while True:
        try:
            full.put(b"x" * 1000, block=False)
        except shmq.Full:
            break
    q = shmq.Queue(maxsize=2, capacity="64KiB")
    q.put(1)
    q.put(2)
    q2 = shmq.Queue(capacity="64KiB")
    calls = {
        "reader.get": (lambda: anon.get(timeout=TIMEOUT_S), shmq.Empty),
        "reader.get_many": (lambda: anon.get_many(10, timeout=TIMEOUT_S), shmq.Empty),
        "named.get": (lambda: named.get(timeout=TIMEOUT_S), shmq.Empty),
        "group.get": (lambda: group.get(timeout=TIMEOUT_S), shmq.Empty),
        "group.get_many": (lambda: group.get_many(5, timeout=TIMEOUT_S), shmq.Empty),
        "spool.put": (lambda: full.put(b"y" * 1000, timeout=TIMEOUT_S), shmq.Full),
        "spool.put_many": (lambda: full.put_many([b"y" * 1000] * 2, timeout=TIMEOUT_S), shmq.Full),
        "queue.get": (lambda: q2.get(timeout=TIMEOUT_S), shmq.Empty),
        "queue.put": (lambda: q.put(3, timeout=TIMEOUT_S), shmq.Full),
    }
    try:
        for name, (call, exc_type) in calls.items():
            with _Alarms() as alarms:
                took = _timed(call, exc_type)
            assert TIMEOUT_S - 0.01 <= took <= TIMEOUT_S + SLACK_S, (name, took)
            assert alarms.count >= 20, (name, alarms.count)  # the signals did arrive meanwhile
        assert keeper.get(timeout=1).data == b"x" * 1000  # the spool still works
    finally:
        q.close()
        q2.close()


def _stop_inside_writer_lock(path, conn):
    """Child: pause inside put_many's critical section (writer lock held) and SIGSTOP itself."""
    sp = shmq.Spool.open(path)
    fired = []

    def hook(point, _spool):
        if point == "frame-written" and not fired:
            fired.append(point)
            conn.send(("holding", os.getpid()))
            os.kill(os.getpid(), signal.SIGSTOP)  # resumed by the parent's SIGCONT

    shmq.spool.set_crash_hook(hook)
    seq = sp.put_many([b"batch-0", b"batch-1", b"batch-2"])
    shmq.spool.set_crash_hook(None)
    conn.send(("done", seq))
    conn.close()
    sp.close()


def _put_and_report(path, recovery_timeout, conn):
    sp = shmq.Spool.open(path, recovery_timeout=recovery_timeout)
    t = time.monotonic()
    try:
        sp.put(b"other", timeout=TIMEOUT_S)
        conn.send(("ok", time.monotonic() - t))
    except Exception as exc:  # reported, the parent asserts
        conn.send((type(exc).__name__, time.monotonic() - t))
    conn.close()
    sp.close()


def _state(pid):
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_sigstopped_writer_lock_holder_makes_others_time_out(ctx, spool_path):
    """A stopped (alive) lock holder is never broken: put(timeout) raises shmq.Timeout.

    Spool.put raises ``shmq.Timeout`` (the lock's live holder did not release
    in time), not ``Full``: the ring has room, the lock is what is stuck.  A
    writer waits for the lock up to ``max(timeout, recovery_timeout)``
    (even a non-blocking put waits out the recovery period, since a stuck
    lock is normally a dead holder about to be recovered); shmq.Queue turns
    the same condition into ``Full``, as multiprocessing.Queue would.
    """
    rt = 1.0
    sp = shmq.Spool.create(spool_path, capacity="64KiB", recovery_timeout=rt)
    sp.put(b"before")
    recv, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_stop_inside_writer_lock, args=(spool_path, send))
    try:
        child.start()
        assert recv.poll(bound(60)), "the child never took the lock"
        assert recv.recv() == ("holding", child.pid)
        deadline = time.monotonic() + bound(30)
        while _state(child.pid) != "T" and time.monotonic() < deadline:
            time.sleep(0.001)
        assert _state(child.pid) == "T"
        assert sp.stats().lock_pid == child.pid

        took = _timed(lambda: sp.put(b"blocked", timeout=TIMEOUT_S), shmq.Timeout)
        assert TIMEOUT_S - 0.01 <= took <= TIMEOUT_S + rt + SLACK_S, took
        took = _timed(lambda: sp.put_many([b"a", b"b"], timeout=TIMEOUT_S), shmq.Timeout)
        assert TIMEOUT_S - 0.01 <= took <= TIMEOUT_S + rt + SLACK_S, took
        took = _timed(lambda: sp.put(b"nb", block=False), shmq.Timeout)
        assert took <= rt + SLACK_S, took
        # from yet another process too (its own handle and semaphore)
        recv2, send2 = ctx.Pipe(duplex=False)
        other = ctx.Process(target=_put_and_report, args=(spool_path, rt, send2))
        other.start()
        res = recv2.recv() if recv2.poll(bound(60)) else None
        assert join_all([other]) == [0]
        assert res is not None and res[0] == "Timeout", res
        assert TIMEOUT_S - 0.01 <= res[1] <= TIMEOUT_S + rt + SLACK_S, res
        st = sp.stats()
        assert st.lock_pid == child.pid and st.lock_breaks == 0  # a live holder is never broken
        assert [f.data for f in sp.reader().get_many(10, block=False)] == [b"before"]
    finally:
        if child.is_alive():
            os.kill(child.pid, signal.SIGCONT)
    assert recv.poll(bound(30)) and recv.recv() == ("done", 1)
    assert join_all([child]) == [0]
    t = time.monotonic()
    assert sp.put(b"after", timeout=bound(5)) == 4
    assert time.monotonic() - t < 5.0  # (loose: a loaded machine; a held lock would raise Timeout)
    assert [f.data for f in sp.reader().get_many(10, block=False)] == [
        b"before", b"batch-0", b"batch-1", b"batch-2", b"after"]
    assert sp.stats().lock_breaks == 0 and sp.stats().lock_pid == 0
    sp.close()


# --------------------------------------------------------------------------
# A KeyboardInterrupt inside a blocking wait (found by a SIGINT storm against
# get(timeout=0.002); made deterministic here by raising it at a point where a
# signal handler can run: a call's return).

def test_keyboardinterrupt_while_registered_leaks_no_waiter(make_spool):
    """A KeyboardInterrupt at the first signal-delivery point after registering (the first
    call inside the wait) unregisters: a leaked count would make every writer ring forever."""
    sp = make_spool(capacity="64KiB")
    bell = sp.data_bell
    calls = []

    def ready():
        calls.append(bell.sem.value)
        if bell.sem.value:  # registered: the signal lands here
            raise KeyboardInterrupt
        return False

    with pytest.raises(KeyboardInterrupt):
        bell.wait(ready, 5)
    assert calls[-1] == 1  # it was registered when interrupted
    assert bell.sem.value == 0


@pytest.mark.parametrize("how", ["forever", "timeout", "queue"])
def test_ctrl_c_in_a_parked_get_unregisters_and_the_next_get_wakes(make_spool, safety_net, how):
    """SIGINT to the main thread while it sleeps on the doorbell's futex (``get()`` with no
    timeout waits in C, with one in Python; ``shmq.Queue.get()`` in C) raises
    KeyboardInterrupt with the waiter registration undone, and the next blocking get is
    woken by a put (a missed wake-up would cost the 30 s safety net)."""
    safety_net(30.0)
    if how == "queue":
        q = shmq.Queue(capacity="64KiB")
        sp, get = q._spool, q.get
    else:
        sp = make_spool(capacity="64KiB")
        r = sp.reader()
        get = (lambda: r.get().data) if how == "forever" else (lambda: r.get(timeout=bound(20)).data)
    main = threading.main_thread().ident

    def when_parked(action):
        deadline = time.monotonic() + bound(10)
        while sp.data_bell.sem.value < 1 and time.monotonic() < deadline:
            time.sleep(0.001)
        action()

    try:
        th = threading.Thread(target=when_parked, args=(lambda: signal.pthread_kill(main, signal.SIGINT),))
        th.start()
        try:
            with pytest.raises(KeyboardInterrupt):
                get()
        finally:
            th.join(bound(15))
        assert sp.data_bell.sem.value == 0  # unregistered: writers do not ring forever

        th = threading.Thread(target=when_parked, args=(lambda: sp.put(b"wake"),))
        th.start()
        t = time.monotonic()
        try:
            assert get() == b"wake"
        finally:
            th.join(bound(15))
        assert time.monotonic() - t < 10.0
        assert sp.data_bell.sem.value == 0
    finally:
        if how == "queue":
            q.close()


def test_a_signal_delivered_to_another_thread_still_interrupts_a_get_parked_in_c(make_spool):
    """A process-directed SIGINT may be delivered to any thread; Python runs its handler in
    the main thread, which must notice it while parked in C (within the safety net)."""
    sp = make_spool(capacity="64KiB")
    r = sp.reader()
    fired, handled = threading.Event(), threading.Event()

    def signal_from_a_thread():
        deadline = time.monotonic() + bound(10)
        while sp.data_bell.sem.value < 1 and time.monotonic() < deadline:
            time.sleep(0.001)
        # Block SIGINT in every thread but this one: the kernel must deliver it here.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        os.kill(os.getpid(), signal.SIGINT)
        fired.set()
        if not handled.wait(bound(10)):
            sp.put(b"rescue")  # a regression fails the test instead of hanging it

    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})  # inherited by the thread
    try:
        th = threading.Thread(target=signal_from_a_thread)
        th.start()
        t = time.monotonic()
        try:
            with pytest.raises(KeyboardInterrupt):
                try:
                    r.get()
                finally:
                    handled.set()
                    signal.pthread_sigmask(signal.SIG_SETMASK, old)
        finally:
            th.join(bound(15))
        assert fired.is_set() and time.monotonic() - t < 10.0
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
    assert sp.data_bell.sem.value == 0


def test_sigstopped_writer_lock_holder_makes_queue_put_raise_full(ctx):
    """shmq.Queue reports the same stuck (live) lock holder as ``Full``, like multiprocessing.Queue.

    Its put waits for the lock up to ``max(timeout, recovery_timeout)``
    (the default 1 s here), then raises ``shmq.Full`` (a ``queue.Full``).
    """
    from shmq._lock import LOCK_RECOVERY_TIMEOUT_S as rt

    q = shmq.Queue(capacity="64KiB")
    recv, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_stop_inside_writer_lock, args=(q.path, send))
    try:
        child.start()
        assert recv.poll(bound(60)) and recv.recv() == ("holding", child.pid)
        deadline = time.monotonic() + bound(30)
        while _state(child.pid) != "T" and time.monotonic() < deadline:
            time.sleep(0.001)
        assert _state(child.pid) == "T"
        took = _timed(lambda: q.put("blocked", timeout=TIMEOUT_S), shmq.Full)
        assert TIMEOUT_S - 0.01 <= took <= TIMEOUT_S + rt + SLACK_S, took
        assert q._spool.stats().lock_breaks == 0
    finally:
        if child.is_alive():
            os.kill(child.pid, signal.SIGCONT)
    try:
        assert recv.poll(bound(30)) and recv.recv() == ("done", 0)
        assert join_all([child]) == [0]
        assert q.get_many(10, timeout=bound(5)) == [b"batch-0", b"batch-1", b"batch-2"]
        q.put("after", timeout=bound(5))
        assert q.get(timeout=bound(5)) == "after"
    finally:
        q.close()


@pytest.mark.parametrize("kind", ["named", "group"])
def test_threads_sharing_a_reader_of_large_frames_take_each_once(make_spool, kind):
    """After a large frame a caught-up get spins with the GIL released (reading its
    cursor once, unlocked): the reader's other threads take frames meanwhile, and
    every frame still goes to exactly one of them.  (Named and group readers: a
    block ring with only an anonymous reader keeps every frame and fills up.)"""
    sp = make_spool(capacity="8MiB", on_full="block")
    r = sp.reader("r", group=kind == "group")
    n, nthreads, size = 400, 4, 256 * 1024  # 256 KiB: a 18 us spin, unlocked
    got, errors = [], []

    def take():
        try:
            while True:
                data = r.get(timeout=bound(30)).data
                if data == b"stop":
                    return
                got.append(int.from_bytes(data[:8], "little"))
                assert data[-8:] == data[:8]
        except BaseException as exc:  # reported below
            errors.append(repr(exc))

    threads = [threading.Thread(target=take) for _ in range(nthreads)]
    for th in threads:
        th.start()
    buf = bytearray(size)
    for i in range(n):
        buf[:8] = buf[-8:] = i.to_bytes(8, "little")
        sp.put(buf, timeout=bound(30))
    for _ in range(nthreads):
        sp.put(b"stop", timeout=bound(30))
    for th in threads:
        th.join(bound(60))
    assert not any(th.is_alive() for th in threads) and errors == []
    assert sorted(got) == list(range(n))


@pytest.mark.parametrize("kind", ["anonymous", "group"])
@pytest.mark.parametrize("closing", ["reader", "spool"])
@pytest.mark.parametrize("timeout", [None, 30])
def test_closing_under_a_thread_parked_in_get_makes_it_raise_valueerror(make_spool, closing, timeout,
                                                                      kind):
    """A thread blocked in get (parked in C, with or without a timeout) while another
    thread closes the reader or the whole spool handle raises ValueError within the safety
    net, with its waiter registration undone, and nothing touches the unmapped file."""
    sp = make_spool(capacity="64KiB")
    path = sp.path
    r = sp.reader("g", group=True) if kind == "group" else sp.reader()
    errors = []

    def blocked():
        try:
            r.get(timeout=timeout)
            errors.append("returned")
        except ValueError as exc:
            errors.append(exc)
        except BaseException as exc:  # reported below
            errors.append(repr(exc))

    th = threading.Thread(target=blocked, daemon=True)
    th.start()
    deadline = time.monotonic() + bound(10)
    while sp.data_bell.sem.value < 1 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert sp.data_bell.sem.value == 1
    t = time.monotonic()
    (r if closing == "reader" else sp).close()
    th.join(bound(10))
    assert not th.is_alive() and time.monotonic() - t < 5
    assert len(errors) == 1 and isinstance(errors[0], ValueError), errors
    with shmq.Spool.open(path) as again:
        assert again.data_bell.sem.value == 0  # unregistered
        again.put(b"still works")
        assert again.reader().get(timeout=bound(5)).data == b"still works"
