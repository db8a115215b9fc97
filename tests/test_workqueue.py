"""WorkQueue: leases, acks, retries, dead letters, dedup by key, delays, kills, restarts."""

import os
import pickle
import signal
import time

import pytest

import shmq
from conftest import bound, join_all


@pytest.fixture
def wq_path(spool_dir):
    path = os.path.join(spool_dir, "wq")
    yield path
    try:
        shmq.WorkQueue.destroy(path)
    except FileNotFoundError:
        pass


@pytest.fixture
def wq(wq_path):
    q = shmq.WorkQueue(wq_path, capacity="1MiB", max_attempts=3, leases=64, keys=64,
                       dead_capacity="256KiB", liveness_interval=0.05)
    yield q
    q.close()


def test_put_get_ack(wq):
    mid = wq.put({"n": 1}, headers={"type": "resize"})
    m = wq.get(timeout=1)
    assert (m.id, m.body, m.attempt, m.headers, m.key) == (mid, {"n": 1}, 1, {"type": "resize"}, None)
    assert m.enqueued_at <= time.time() and m.token > 0
    m.ack()
    with pytest.raises(shmq.Empty):
        wq.get(timeout=0.05)
    st = wq.stats()
    assert (st.ready, st.in_flight, st.acked) == (0, 0, 1)


def test_a_name_too_long_for_its_dead_letters_is_refused_before_anything_is_made(spool_dir):
    # The queue's spool and its PATH.dead are created one after the other: a name that
    # fits the first but not the second must fail before the first exists.
    import errno

    fits = os.path.join(spool_dir, "q" * 227)
    shmq.WorkQueue(fits, capacity="64KiB", leases=4, keys=4, dead_capacity="64KiB").close()
    shmq.WorkQueue.destroy(fits)
    path = os.path.join(spool_dir, "q" * 228)
    with pytest.raises(OSError) as info:
        shmq.WorkQueue(path, capacity="64KiB", leases=4, keys=4, dead_capacity="64KiB")
    assert info.value.errno == errno.ENAMETOOLONG and info.value.filename == path
    assert "228 bytes, at most 227" in info.value.strerror and "'.dead'" in info.value.strerror
    assert os.listdir(spool_dir) == []


def test_fifo_and_get_many(wq):
    wq.put_many(range(5))
    got = wq.get_many(10, timeout=1)
    assert [m.body for m in got] == list(range(5))
    for m in got:
        m.ack()


def test_nack_redelivers_with_next_attempt(wq):
    wq.put("job")
    m = wq.get(timeout=1)
    m.nack()
    m2 = wq.get(timeout=1)
    assert (m2.id, m2.attempt) == (m.id, 2) and m2.token != m.token
    m2.ack()
    assert wq.stats().redeliveries == 1


def test_stale_token_refused(wq):
    wq.put("job")
    m = wq.get(timeout=1, lease=0.05)
    time.sleep(0.1)  # let the lease expire (the thing under test is wall-clock expiry)
    m2 = wq.get(timeout=1)
    assert m2.id == m.id and m2.attempt == 2
    for call in (m.ack, m.nack, lambda: m.extend(5)):
        with pytest.raises(shmq.LeaseLost):
            call()
    m2.ack()
    with pytest.raises(shmq.LeaseLost):
        m2.ack()  # settled already


def test_extend_keeps_lease(wq):
    wq.put("long")
    m = wq.get(timeout=1, lease=0.2)
    m.extend(30)
    with pytest.raises(shmq.Empty):
        wq.get(timeout=0.3)  # not redelivered after the original 0.2 s
    m.ack()


def test_dead_letter_after_max_attempts_and_replay(wq):
    wq.put("poison", max_attempts=2)
    for attempt in (1, 2):
        m = wq.get(timeout=1)
        assert m.attempt == attempt
        try:
            raise ValueError(f"bad input {attempt}")
        except ValueError as exc:
            m.nack(error=exc)
    with pytest.raises(shmq.Empty):
        wq.get(timeout=0.05)
    (dl,) = wq.dead_letters()
    assert dl.body == "poison" and dl.attempts == 2 and dl.message_id == m.id
    assert dl.error["type"] == "ValueError" and "bad input 2" in dl.error["message"]
    assert "Traceback" in dl.error["traceback"] and dl.last_holder_pid == os.getpid()
    assert wq.stats().dead == 1
    assert wq.replay_dead() == 1
    assert wq.dead_letters() == []
    m = wq.get(timeout=1)
    assert m.body == "poison" and m.attempt == 1
    m.ack()


def test_purge_dead(wq):
    wq.put("x", max_attempts=1)
    wq.get(timeout=1).nack(error="nope")
    assert len(wq.dead_letters()) == 1
    assert wq.purge_dead(older_than=3600) == 0
    assert wq.purge_dead() == 1
    assert wq.dead_letters() == []


def test_expired_lease_past_max_attempts_is_dead_lettered(wq):
    wq.put("slow", max_attempts=1)
    wq.get(timeout=1, lease=0.01)
    time.sleep(0.05)
    with pytest.raises(shmq.Empty):
        wq.get(timeout=0.05)
    (dl,) = wq.dead_letters()
    assert dl.error["type"] == "LeaseExpired"


def test_dedup_latest_wins(wq):
    wq.put("v1", key="user:1")
    wq.put("other", key="user:2")
    wq.put("v2", key="user:1")
    got = [m.body for m in wq.get_many(10, timeout=1)]
    assert got == ["other", "v2"]
    assert wq.stats().superseded == 1


def test_dedup_in_flight_finishes_but_is_not_redelivered(wq):
    wq.put("old", key="k")
    m = wq.get(timeout=1)
    wq.put("new", key="k")
    m.nack()  # would be redelivered, but a newer message with its key exists
    got = wq.get_many(10, timeout=1)
    assert [x.body for x in got] == ["new"]
    got[0].ack()
    with pytest.raises(shmq.Empty):
        wq.get(timeout=0.05)


def test_delay_does_not_hold_up_the_queue(wq):
    t = time.monotonic()
    wq.put("later", delay=1.0)
    wq.put("now")
    assert wq.get(timeout=1).body == "now"  # not held up behind the delayed one
    if time.monotonic() - t < 0.9:  # (a machine stalled past the delay proves nothing here)
        assert wq.stats().delayed == 1
    m = wq.get(timeout=bound(5))  # a blocked get wakes when the delayed message is due
    assert m.body == "later" and time.monotonic() - t >= 0.99
    m.ack()


def test_nack_with_delay(wq):
    wq.put("retry-later")
    wq.get(timeout=1).nack(delay=0.2)
    with pytest.raises(shmq.Empty):
        wq.get(timeout=0.05)
    assert wq.get(timeout=2).attempt == 2


def test_bad_input(wq):
    with pytest.raises(TypeError):
        wq.put(1, headers=["not", "a", "dict"])
    with pytest.raises(TypeError):
        wq.put(1, key=3)
    with pytest.raises(ValueError):
        wq.put(1, delay=-1)
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        wq.put(lambda: 1)
    with pytest.raises(ValueError):
        wq.get(lease=0)
    with pytest.raises(shmq.TooLarge):
        wq.put(b"x" * (2 << 20))
    assert wq.stats().ready == 0  # nothing half-enqueued


def test_lease_table_full_stops_taking(wq_path):
    q = shmq.WorkQueue(wq_path, capacity="1MiB", leases=2, keys=8)
    q.put_many(range(4))
    a, b = q.get(timeout=1), q.get(timeout=1)
    with pytest.raises(shmq.Empty):
        q.get(timeout=0.05)  # both records in use: nothing more handed out
    a.ack()
    assert q.get(timeout=1).body == 2
    b.ack()
    q.close()


def test_leased_frames_are_never_overwritten(wq_path):
    q = shmq.WorkQueue(wq_path, capacity=8192, leases=8, keys=8)
    q.put(b"x" * 1000)
    m = q.get(timeout=1)
    with pytest.raises(shmq.Full):
        for _ in range(20):
            q._spool.writer.append(((b"h" * 24, b"y" * 1000),), 0.05, shmq._format.CODEC_WORKQ)
    m.nack()
    assert q.get(timeout=1).body == b"x" * 1000  # still intact
    q.close()


def test_handle_pickles(wq):
    other = pickle.loads(pickle.dumps(wq))
    other.put("via pickle")
    assert wq.get(timeout=1).body == "via pickle"
    other.close()


def test_open_missing(spool_dir):
    with pytest.raises(FileNotFoundError):
        shmq.WorkQueue.open(os.path.join(spool_dir, "nope"))


# --- processes ---------------------------------------------------------------------


def _hold_lease_and_hang(path, ready):
    q = shmq.WorkQueue(path)
    q.get(timeout=bound(10), lease=600)  # a long lease: only death detection can free it
    ready.set()
    time.sleep(600)


def test_killed_consumer_message_redelivered_promptly(ctx, wq_path):
    q = shmq.WorkQueue(wq_path, capacity="1MiB", liveness_interval=0.05)
    q.put("survives")
    ready = ctx.Event()
    p = ctx.Process(target=_hold_lease_and_hang, args=(wq_path, ready))
    p.start()
    assert ready.wait(bound(30))
    assert q.stats().in_flight == 1
    os.kill(p.pid, signal.SIGKILL)
    p.join(bound(10))
    t = time.monotonic()
    m = q.get(timeout=bound(10))
    assert m.body == "survives" and m.attempt == 2
    assert time.monotonic() - t < 5  # not after the 600 s lease
    m.ack()
    q.close()


def _die_granting(path):
    """Take a message and die (SIGKILL) inside the take: its lease is recorded, the
    take cursor not moved yet, the work queue's lock held."""
    q = shmq.WorkQueue(path)

    def die(*_a):
        os.kill(os.getpid(), signal.SIGKILL)

    q._spool.slots.set_cursor = die
    q.get(timeout=bound(10))


def _kill_inside_a_take(ctx, path):
    p = ctx.Process(target=_die_granting, args=(path,))
    p.start()
    join_all([p], timeout=30)
    assert p.exitcode == -signal.SIGKILL


def _take_all(q):
    got = []
    try:
        while True:
            for m in q.get_many(10, timeout=0.5):
                got.append((m.body, m.attempt))
                m.ack()
    except shmq.Empty:
        return sorted(got)


@pytest.mark.parametrize("breaker", ["attach", "other_tool"])
def test_consumer_killed_inside_a_take_its_message_is_delivered_once(ctx, wq_path, breaker):
    """A consumer SIGKILLed after recording a lease but before moving the take
    cursor, holding the lock: whoever breaks the lock, the message is delivered
    again once (attempt 2), never also as a fresh message.  Breakers: a consumer
    attaching (its repair must already be set up), or a tool taking the group's
    lock without the work queue's repair (the next take repairs then)."""
    q = shmq.WorkQueue(wq_path, capacity="1MiB", liveness_interval=0.05)
    q.put_many(["m0", "m1"])
    _kill_inside_a_take(ctx, wq_path)
    if breaker == "attach":
        q.close()
        q = shmq.WorkQueue(wq_path, liveness_interval=0.05)  # breaks the dead holder's lock
    else:
        sp = shmq.Spool.open(wq_path)
        r = sp.reader("wq", group=True)
        with r.lock:  # broken here, without the work queue's repair
            pass
        r.close()
        sp.close()
    try:
        assert _take_all(q) == [("m0", 2), ("m1", 1)]
        st = q.stats()
        assert (st.acked, st.ready, st.in_flight) == (2, 0, 0)
    finally:
        q.close()


def _consume_all(path, out, idle):
    q = shmq.WorkQueue(path)
    got = []
    try:
        while True:
            m = q.get(timeout=idle)
            got.append(m.body)
            m.ack()
    except shmq.Empty:
        pass
    out.put(got)
    q.close()


def test_competing_consumers_each_message_acked_once(ctx, wq_path):
    q = shmq.WorkQueue(wq_path, capacity="4MiB")
    n = 1500
    out = ctx.Queue()
    procs = [ctx.Process(target=_consume_all, args=(wq_path, out, 2.0)) for _ in range(3)]
    for p in procs:
        p.start()
    for i in range(0, n, 50):
        q.put_many(range(i, i + 50))
    results = [out.get(timeout=bound(120)) for _ in procs]
    join_all(procs)
    got = sorted(x for r in results for x in r)
    assert got == list(range(n))
    assert q.stats().acked == n
    q.close()


def test_restart_recovery(wq_path):
    q = shmq.WorkQueue(wq_path, capacity="1MiB")
    q.put_many(["acked", "in flight", "waiting"])
    q.get(timeout=1).ack()
    m = q.get(timeout=1, lease=0.2)
    assert m.body == "in flight"
    q.close()  # "every process killed": nothing but the spool remains
    q = shmq.WorkQueue(wq_path)
    first = q.get(timeout=1)
    assert first.body == "waiting"  # never the acked one
    second = q.get(timeout=2)  # the in-flight one comes back when its lease expires
    assert second.body == "in flight" and second.attempt == 2
    first.ack()
    second.ack()
    with pytest.raises(shmq.Empty):
        q.get(timeout=0.1)
    q.close()


# --- release(slot, token): settling another holder's delivery ---------------------------


def test_release_gives_the_delivery_back(wq):
    wq.put("job")
    m = wq.get(timeout=bound(5))
    assert isinstance(m.slot, int) and m.slot >= 0
    wq.release(m.slot, m.token, error=RuntimeError("holder died"))
    with pytest.raises(shmq.LeaseLost):
        m.ack()  # the holder's own settle is now stale
    m2 = wq.get(timeout=bound(5))
    assert (m2.body, m2.attempt) == ("job", 2) and m2.token != m.token
    with pytest.raises(shmq.LeaseLost, match=f"lease slot {m2.slot}: lease token {m.token}"):
        wq.release(m2.slot, m.token)  # the old token cannot touch the new delivery
    m2.ack()
    with pytest.raises(shmq.LeaseLost):
        wq.release(m2.slot, m2.token)  # settled


def test_release_past_max_attempts_dead_letters_with_the_error(wq):
    wq.put("doomed")
    for attempt in (1, 2, 3):
        m = wq.get(timeout=bound(5))
        assert m.attempt == attempt
        wq.release(m.slot, m.token, error=ValueError(f"try {attempt}"))
    (dl,) = wq.dead_letters()
    assert dl.body == "doomed" and dl.attempts == 3
    assert dl.error["type"] == "ValueError" and dl.error["message"] == "try 3"


def test_release_with_delay(wq):
    wq.put("later")
    m = wq.get(timeout=bound(5))
    wq.release(m.slot, m.token, delay=60)
    with pytest.raises(shmq.Empty):
        wq.get(timeout=0.05)
    assert wq.stats().in_flight + wq.stats().delayed + wq.stats().ready >= 1


def test_release_bad_input(wq):
    wq.put("x")
    m = wq.get(timeout=bound(5))
    with pytest.raises(ValueError, match="out of range"):
        wq.release(10**6, m.token)
    with pytest.raises(ValueError, match="out of range"):
        wq.release(-1, m.token)
    for slot, token in ((True, m.token), (m.slot, "1"), (1.0, m.token)):
        with pytest.raises(TypeError, match="must be an int"):
            wq.release(slot, token)
    with pytest.raises(ValueError):
        wq.release(m.slot, m.token, delay=-1)
    m.ack()  # nothing above touched the lease
    wq.close()
    with pytest.raises(ValueError, match="closed"):
        wq.release(m.slot, m.token)


def _lease_and_wait(path, conn, go):
    q = shmq.WorkQueue(path)
    m = q.get(timeout=bound(10), lease=600)
    conn.send((m.slot, m.token, m.body))
    go.wait(bound(30))
    try:
        m.ack()
        conn.send("acked")
    except shmq.LeaseLost:
        conn.send("stale")
    q.close()


def test_release_from_another_process(ctx, wq_path):
    """The Dispatcher's supervisor case: the holder published (slot, token); another
    process gives the message back while the holder still lives."""
    q = shmq.WorkQueue(wq_path, capacity="1MiB", dead_capacity="256KiB")
    q.put({"n": 1})
    parent, child = ctx.Pipe()
    go = ctx.Event()
    p = ctx.Process(target=_lease_and_wait, args=(wq_path, child, go))
    p.start()
    try:
        assert parent.poll(bound(30))
        slot, token, body = parent.recv()
        assert body == {"n": 1}
        q.release(slot, token, error="released by the supervisor")
        m = q.get(timeout=bound(10))
        assert m.attempt == 2 and m.body == {"n": 1}
        go.set()
        assert parent.poll(bound(30)) and parent.recv() == "stale"  # the holder's late ack is refused
        m.ack()
    finally:
        go.set()
        assert join_all([p]) == [0]
        q.close()
