"""shmq.Client with thousands of calls in flight: each reply wakes only its caller,
calls beyond the window wait in order, and a call that is cancelled or times out
frees its slot at once.

Most tests drive the service by hand (``Service.get`` in this process, through
``asyncio.to_thread``), so that which call is in whose hands is decided by the
test, not by timing; the others run a real service in a forked child.
"""

import asyncio
import multiprocessing as mp
import os
import pickle
import signal
import threading
import time

import pytest

import shmq
from conftest import bound, join_all

FORK = mp.get_context("fork")
T = bound(30)  # bound for any single wait in these tests


def echo(req):
    return {"echo": req}


def _serve(path, workers):
    shmq.Service(path).serve(echo, workers=workers)


@pytest.fixture
def svc_path(spool_dir):
    path = os.path.join(spool_dir, "svc")
    shmq.Service(path).close()
    yield path
    shmq.Service.destroy(path)


@pytest.fixture
def served(svc_path):
    """A service with 2 workers in a forked child (started before any thread)."""
    p = FORK.Process(target=_serve, args=(svc_path, 2))
    p.start()
    yield svc_path
    os.kill(p.pid, signal.SIGTERM)
    assert join_all([p]) == [0]


def settled(cl):
    """Nothing of the client's is left waiting: no call, no slot taken, no reader."""
    waits = cl._waits
    return (not cl._pending and not cl._groups and waits.free == cl.window and waits.reader is None
            and all(w.gone for w in waits.queue) and not any(waits.idle.values()))


def frames(path):
    """Frames ever put into the service's request ring."""
    with shmq.Spool.open(path) as sp:
        return sp.next_seq


async def take(svc):
    """The next call the client sent (this thread is the service's only worker)."""
    return await asyncio.to_thread(svc.get, bound(T))


async def parked(*tasks):
    """Let every task run up to its first park (each step is one loop turn)."""
    for _ in range(4):
        await asyncio.sleep(0)
    assert not any(t.done() for t in tasks)


# -- the window -------------------------------------------------------------------------


def test_calls_beyond_the_window_are_sent_in_order_as_slots_free(svc_path):
    """window=3, 10 calls started in order: 3 go at once, each answer lets the next
    one in line go; the service sees them in the order they were made."""
    async def main(cl, svc):
        tasks = [asyncio.create_task(cl.call_async(i, timeout=bound(T))) for i in range(10)]
        await parked(*tasks)
        assert cl._waits.free == 0 and len(cl._waits.queue) == 7
        seen = []
        for _ in range(10):
            call = await take(svc)
            seen.append(call.request)
            call.reply(call.request * 10)
        assert [r for r in await asyncio.gather(*tasks)] == [i * 10 for i in range(10)]
        return seen

    with shmq.Service(svc_path) as svc, shmq.Client(svc_path, window=3) as cl:
        assert asyncio.run(main(cl, svc)) == list(range(10))
        assert settled(cl)


@pytest.mark.parametrize("how", ["cancel", "asyncio.timeout", "timeout"])
def test_a_cancelled_or_timed_out_calls_slot_is_reused_and_its_late_reply_dropped(svc_path, how):
    """window=1: call A is in the service's hands, B waits for its slot.  A is
    cancelled (task cancel; an ``asyncio.timeout`` moved to now) or times out (its
    own 1 s timeout): B is sent at once.  A's late reply is dropped and counted."""
    async def main(cl, svc):
        loop = asyncio.get_running_loop()
        scope = asyncio.timeout(None)

        async def call_a():
            if how == "asyncio.timeout":
                async with scope:
                    return await cl.call_async("a", timeout=bound(T))
            return await cl.call_async("a", timeout=1.0 if how == "timeout" else bound(T))

        a = asyncio.create_task(call_a())
        call_a = await take(svc)
        b = asyncio.create_task(cl.call_async("b", timeout=bound(T)))
        await parked(b)
        assert not a.done(), "A timed out before the test could look (a heavily loaded host?)"
        assert cl._waits.free == 0 and [w.gone for w in cl._waits.queue] == [False]  # B waits for A's slot
        if how == "cancel":
            a.cancel()
            with pytest.raises(asyncio.CancelledError):
                await a
        elif how == "asyncio.timeout":
            scope.reschedule(loop.time())
            with pytest.raises(TimeoutError):
                await a
        else:
            with pytest.raises(shmq.Timeout):
                await a
        call_b = await take(svc)  # B was sent as soon as A gave up its slot
        assert call_b.request == "b"
        call_a.reply("A, too late")
        call_b.reply("B")
        assert await b == "B"
        c = asyncio.create_task(cl.call_async("c", timeout=bound(T)))
        call_c = await take(svc)
        call_c.reply("C")
        assert await c == "C"  # read after A's late reply, which was written first
        assert cl.duplicates == 1

    with shmq.Service(svc_path) as svc, shmq.Client(svc_path, window=1) as cl:
        asyncio.run(main(cl, svc))
        assert settled(cl)


def test_a_call_cancelled_while_waiting_for_a_slot_leaves_the_line(svc_path):
    """window=1, A in flight, B and C waiting in that order: B is cancelled, and C
    goes next once A is answered (B's place does not hold it back)."""
    async def main(cl, svc):
        a = asyncio.create_task(cl.call_async("a", timeout=bound(T)))
        call_a = await take(svc)
        b = asyncio.create_task(cl.call_async("b", timeout=bound(T)))
        c = asyncio.create_task(cl.call_async("c", timeout=bound(T)))
        await parked(b, c)
        b.cancel()
        with pytest.raises(asyncio.CancelledError):
            await b
        call_a.reply("A")
        assert await a == "A"
        call_c = await take(svc)
        assert call_c.request == "c"
        call_c.reply("C")
        assert await c == "C"

    with shmq.Service(svc_path) as svc, shmq.Client(svc_path, window=1) as cl:
        asyncio.run(main(cl, svc))
        assert settled(cl)
        assert cl.duplicates == 0  # B was never sent


def test_a_thread_and_coroutines_wait_for_the_window_in_one_line(svc_path):
    """window=2: a thread's call_many of 2 queued behind a coroutine's call waits for
    both slots; the coroutine queued after it goes after it (no overtaking)."""
    async def main(cl, svc):
        a = asyncio.create_task(cl.call_async("a", timeout=bound(T)))
        call_a = await take(svc)
        b = asyncio.create_task(cl.call_async("b", timeout=bound(T)))
        call_b = await take(svc)  # the window is full
        res = {}
        queued = threading.Event()

        def thread():
            queued.set()
            res["many"] = cl.call_many(["t1", "t2"], timeout=bound(T))

        t = threading.Thread(target=thread)
        t.start()
        assert await asyncio.to_thread(queued.wait, bound(T))
        deadline = time.monotonic() + bound(T)
        while not cl._waits.queue:  # the thread is about to queue: a loop turn each look
            assert time.monotonic() < deadline, "the thread's call_many never queued"
            await asyncio.sleep(0)
        c = asyncio.create_task(cl.call_async("c", timeout=bound(T)))
        await parked(c)
        assert [w.n for w in cl._waits.queue] == [2, 1]
        call_a.reply("A")  # one slot free: not enough for the thread, and C waits behind it
        assert await a == "A"
        call_b.reply("B")
        assert await b == "B"
        got = [await take(svc), await take(svc)]  # the thread's bundle, call by call
        assert [g.request for g in got] == ["t1", "t2"]
        for g in got:
            g.reply(g.request.upper())
        call_c = await take(svc)
        assert call_c.request == "c"
        call_c.reply("C")
        assert await c == "C"
        await asyncio.to_thread(t.join, bound(T))
        assert res["many"] == ["T1", "T2"]

    with shmq.Service(svc_path) as svc, shmq.Client(svc_path, window=2) as cl:
        asyncio.run(main(cl, svc))
        assert settled(cl)


def test_a_call_that_finds_no_room_in_time_says_so(svc_path):
    async def main(cl, svc):
        a = asyncio.create_task(cl.call_async("a", timeout=bound(T)))
        call_a = await take(svc)
        with pytest.raises(shmq.Timeout, match="window"):
            await cl.call_async("b", timeout=0.1)
        with pytest.raises(shmq.Timeout, match="window"):
            await asyncio.to_thread(cl.call, "c", 0.1)
        call_a.reply("A")
        assert await a == "A"

    with shmq.Service(svc_path) as svc, shmq.Client(svc_path, window=1) as cl:
        asyncio.run(main(cl, svc))
        assert settled(cl)


def test_a_look_reads_every_waiting_reply_not_one_windows_worth(svc_path):
    """A call answered behind more replies than one read takes (late replies of
    abandoned calls) is found answered by the look for lost calls, not sent again."""
    with shmq.Service(svc_path) as svc, shmq.Client(svc_path, window=2) as cl:
        from shmq.rpc.waiters import Waiter

        cl._check()
        first, gone = cl._send(["x1", "x2", "x3", "x4"], None, 0, Waiter())  # abandoned at once
        cl._abandon(first, gone)
        cid, [p] = cl._send(["live"], None, 0, Waiter())
        calls = svc.get_many(5, timeout=bound(T))
        calls = calls + svc.get_many(5, timeout=bound(T)) if len(calls) < 5 else calls
        assert sorted(str(c.request) for c in calls) == ["live", "x1", "x2", "x3", "x4"]
        for c in sorted(calls, key=lambda c: c.request == "live"):  # live's reply last
            c.reply(c.request)
        sent = frames(svc_path)
        cl._waits.reader = "test"  # the role (nobody else waits)
        cl._look()
        cl._look()  # a second look would send a call found nowhere twice
        cl._waits.reader = None
        assert p.done and p.value == "live" and p.attempt == 1
        assert frames(svc_path) == sent  # nothing sent again
        assert cl.duplicates == 4
        with cl._lock:
            cl._forget(cid, [p])


# -- thousands in flight ----------------------------------------------------------------


class CountingLoop(asyncio.SelectorEventLoop):
    """Counts ``call_soon_threadsafe``: each writes to the loop's self-pipe (a wake-up
    from outside the loop's own callbacks: a reply handed over by a thread, the
    inotify watcher's bump)."""

    threadsafe = 0

    def call_soon_threadsafe(self, *args, **kwargs):
        self.threadsafe += 1
        return super().call_soon_threadsafe(*args, **kwargs)


@pytest.mark.parametrize("thread", [False, True], ids=["coroutines", "with-a-thread"])
def test_loop_wakeups_per_reply_do_not_grow_with_the_calls_in_flight(served, thread):
    """200 and then 4,000 calls in flight at once (window 5,000): at most one loop
    wake-up per reply (waking every waiting coroutine at each hand-over of the
    reading role cost 1.3 per reply with 200 in flight, 7-8 with 4,000); with a
    thread calling on the same client throughout (replies it reads are handed to
    the loop, and the role passes between them), at most two."""
    with shmq.Client(served, window=5000) as cl:
        cl.call("warm", timeout=bound(T))
        for n in (200, 4000):
            loop = CountingLoop()
            stop = threading.Event()
            thread_calls = []

            def calls():
                while not stop.is_set():
                    k = len(thread_calls)
                    assert cl.call(("t", k), timeout=bound(T))["echo"] == ("t", k)
                    thread_calls.append(k)

            async def main():
                async def one(i):
                    return (await cl.call_async(i, timeout=bound(T)))["echo"]

                return await asyncio.gather(*[one(i) for i in range(n)])

            t = threading.Thread(target=calls)
            if thread:
                t.start()
            try:
                assert loop.run_until_complete(main()) == list(range(n))
            finally:
                stop.set()
                if thread:
                    t.join(bound(T))
                loop.close()
            replies = n + len(thread_calls)
            assert loop.threadsafe <= (2 if thread else 1) * replies, (n, loop.threadsafe, replies)
        assert settled(cl)


def test_20000_calls_with_cancellations_and_timeouts_each_reply_reaches_its_caller(served):
    """20,000 concurrent call_async on one client (and a thread calling too): every
    10th call is cancelled once a quarter of them are answered, every 10th + 1 has
    a timeout of 0 (raises Timeout), every 10th + 2 runs under asyncio.wait_for
    with 50 ms (answered or TimeoutError, either is fine).  Every other call gets
    its own reply, and the client is left with nothing waiting and its whole
    window free."""
    n = 20000
    outcome = {}

    async def main(cl):
        answered = 0
        quarter = asyncio.Event()

        async def one(i):
            nonlocal answered
            req = {"i": i, "pad": "x" * (i % 64)}
            try:
                if i % 10 == 1:
                    rep = await cl.call_async(req, timeout=0)
                elif i % 10 == 2:
                    rep = await asyncio.wait_for(cl.call_async(req, timeout=bound(T)), 0.05)
                else:
                    rep = await cl.call_async(req, timeout=bound(T))
            except shmq.Timeout:
                outcome[i] = "timeout"
                return
            except asyncio.TimeoutError:
                outcome[i] = "wait_for"
                return
            outcome[i] = "ok" if rep["echo"] == req else ("WRONG", rep)
            answered += 1
            if answered >= n // 4:
                quarter.set()

        tasks = [asyncio.create_task(one(i)) for i in range(n)]
        await asyncio.wait_for(quarter.wait(), bound(T))
        doomed = [t for i, t in enumerate(tasks) if i % 10 == 0 and not t.done()]
        for t in doomed:
            t.cancel()
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), bound(120))
        return len(doomed)

    with shmq.Client(served) as cl:
        thread_ok = []

        def thread():
            thread_ok.extend(cl.call(("t", k), timeout=bound(T))["echo"] == ("t", k)
                             for k in range(300))

        t = threading.Thread(target=thread)
        t.start()
        try:
            cancelled = asyncio.run(main(cl))
        finally:
            t.join(bound(T))
        assert thread_ok == [True] * 300
        assert cancelled > 0
        wrong = {i: o for i, o in outcome.items() if o not in ("ok", "timeout", "wait_for")}
        assert not wrong
        assert all(outcome[i] == "timeout" for i in range(1, n, 10))
        assert all(outcome.get(i) == "ok" for i in range(n) if i % 10 not in (0, 1, 2))
        assert len([i for i in range(0, n, 10) if i not in outcome]) == cancelled
        assert settled(cl)
        assert cl.call("after", timeout=bound(T)) == {"echo": "after"}
        # late replies of abandoned calls are dropped, never handed to another call
        assert cl.duplicates <= cancelled + 2 * (n // 10)


def test_a_pickled_client_starts_with_its_whole_window(served):
    with shmq.Client(served, window=7) as cl:
        assert cl.call(1, timeout=bound(T)) == {"echo": 1}
        other = pickle.loads(pickle.dumps(cl))
        try:
            assert other.window == 7
            assert other.call_many(range(20), timeout=bound(T)) == [{"echo": i} for i in range(20)]
            assert settled(other)
        finally:
            other.close()
