"""A typed client of shmq's public API, as the README and docs use it.

Never run: tests/test_typing.py type-checks it with ``mypy --strict`` (shmq's own
modules are followed silently, as for an installed package).  ``assert_type``
pins the return types users rely on; a wrong one fails the check.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any, assert_type

import numpy as np
import numpy.typing as npt

import shmq
import shmq.codec
import shmq.columnar
import shmq.dedupe
import shmq.dispatch
import shmq.gc
import shmq.metrics
from shmq.dispatch import Context, Dispatcher


def spools(path: str) -> None:
    sp = shmq.Spool.create(path, capacity="64MiB", on_full="overwrite")
    reveal_type(sp.put)  # the test checks each revealed type
    assert_type(sp, shmq.Spool)
    assert_type(sp.put(b"hello"), int)
    assert_type(sp.put(bytearray(b"x"), block=False, timeout=1.0), int)
    assert_type(sp.put(memoryview(b"x")), int)
    assert_type(sp.put_many([b"a", b"b"]), int)
    assert_type(sp.put_array(np.arange(10)), int)
    assert_type(sp.capacity, int)
    assert_type(sp.next_seq, int)
    assert_type(sp.trim(), int | None)

    with sp.reserve(5) as buf:
        assert_type(buf, memoryview)
        buf[:] = b"hello"
    rv = sp.reserve(3)
    assert_type(rv, shmq.Reservation)
    assert_type(rv.commit(), int)

    frame = sp.read_at(0)
    assert_type(frame, shmq.Frame)
    seq, ts, data = frame  # a tuple with named fields
    assert_type(seq, int)
    assert_type(frame.seq, int)
    assert_type(frame.timestamp_ns, int)
    assert_type(frame.data, bytes | bytearray | memoryview)
    assert_type(frame.codec, int)

    r = sp.reader("indexer")  # named: durable position
    assert_type(r, shmq.NamedReader)
    f = r.get(timeout=1.0)
    reveal_type(r.get)
    assert_type(f, shmq.Frame)
    print(f.seq, f.data, r.lost)
    assert_type(r.lost, int)
    assert_type(r.committed, int)
    r.commit()
    assert_type(r.get_many(100, timeout=0.5), list[shmq.Frame])
    assert_type(r.get_many(100, as_array=True), npt.NDArray[Any])
    assert_type(r.get_array(), npt.NDArray[Any])
    with r.get_array(copy=False) as view:
        assert_type(view, shmq.columnar.PinnedView)
        arr: Any = view.array
        print(arr)
    for frame in r:
        assert_type(frame, shmq.Frame)
        break
    r.seek("earliest")
    r.seek(3)
    r.close()

    anon = sp.reader()
    assert_type(anon, shmq.Reader)
    assert_type(anon.get(block=False), shmq.Frame)
    workers = sp.reader("jobs", group=True)  # each frame to exactly one member
    assert_type(workers, shmq.GroupReader)
    assert_type(workers.get_many(10), list[shmq.Frame])

    async def consume() -> shmq.Frame:
        return await anon.get_async(timeout=1.0)

    assert_type(asyncio.run(consume()), shmq.Frame)

    st = sp.stats()
    assert_type(st, shmq.SpoolStats)
    for rs in sp.readers():
        assert_type(rs, shmq.ReaderStats)
    print(shmq.metrics.prometheus_text([st]))
    sp.close()
    shmq.Spool.destroy(path)

    with shmq.Spool.open(path) as sp2:
        assert_type(sp2, shmq.Spool)


def queues() -> None:
    q = shmq.Queue()
    q.put({"any": "object"})
    reveal_type(q.get)
    assert_type(q.get(), Any)
    assert_type(q.get(timeout=1.0), Any)
    assert_type(q.get_many(10), list[Any])
    assert_type(q.qsize(), int)
    q.close()
    jq = shmq.JoinableQueue(maxsize=10, path="/dev/shm/shmq-typing-jq")
    jq.put(1)
    jq.task_done()
    assert_type(jq.join(timeout=1.0), bool)
    sq = shmq.SimpleQueue()
    sq.put(b"x")
    assert_type(sq.get(), Any)


def work_queues(path: str) -> None:
    wq = shmq.WorkQueue(path, max_attempts=3)
    assert_type(wq.put("profile v1", key="user:42"), int)
    wq.put("reminder", delay=0.5)
    assert_type(wq.put_many([f"job {i}" for i in range(6)]), int)
    msg = wq.get(timeout=1.0, lease=10.0)
    assert_type(msg, shmq.Message)
    assert_type(msg.body, Any)
    assert_type(msg.id, int)
    assert_type(msg.attempt, int)
    msg.extend(5.0)
    msg.nack(error=ValueError("cannot process poison"))
    msg.ack()
    assert_type(wq.get_many(10), list[shmq.Message])
    for dl in wq.dead_letters():
        assert_type(dl, shmq.DeadLetter)
        print(dl.body, dl.attempts, dl.error["type"])
    assert_type(wq.replay_dead(), int)
    assert_type(wq.stats(), shmq.WorkQueueStats)
    wq.close()
    shmq.WorkQueue.destroy(path)


def upper(request: str) -> str:
    return request.upper()


def services(name: str) -> None:
    svc = shmq.Service(name, capacity="1MiB", lease=30.0)
    assert_type(svc, shmq.Service)
    call = svc.get(timeout=1.0)
    assert_type(call, shmq.Call)
    assert_type(call.request, Any)
    assert_type(call.id, int)
    assert_type(call.attempt, int)
    call.reply(call.request)
    for c in svc:
        assert_type(c, shmq.Call)
        c.fail(ValueError("bad request"))
        break
    assert_type(svc.stats(), shmq.ServiceStats)
    svc.serve(upper, workers=2, mp_context="spawn")
    svc.close()
    shmq.Service.destroy(name)

    with shmq.Client(name, window=16) as cl:
        assert_type(cl, shmq.Client)
        assert_type(cl.call("hello", timeout=5.0), Any)
        assert_type(cl.call_many(["a", "b"], timeout=5.0), list[Any])
        assert_type(cl.call_many(iter(["c"])), list[Any])

        async def ask() -> Any:
            return await cl.call_async("hi", timeout=1.0)

        print(asyncio.run(ask()))
    try:
        shmq.Client(name).call("x")
    except shmq.RemoteError as exc:
        assert_type(exc.type_name, str | None)
        assert_type(exc.remote_traceback, str | None)
    sweep = shmq.gc.sweep(remove=False)
    assert_type(sweep, shmq.gc.Orphans)
    assert_type(sweep.semaphores, dict[str, list[str]])
    assert_type(shmq.gc.orphaned_queues(), list[str])


def resize(ctx: Context, body: Any) -> None:
    assert_type(ctx.message_id, int)
    assert_type(ctx.correlation_id, int)
    assert_type(ctx.cancelled, threading.Event)
    assert_type(ctx.logger, logging.Logger)
    assert_type(ctx.time_left(), float | None)
    ctx.heartbeat(extend=10.0)
    assert_type(ctx.publish("thumbnail", body), int)


def dispatching(path: str) -> None:
    d = Dispatcher(path, start_method="spawn")
    handler = d.handler("resize", parallelism=2, timeout=30.0)(resize)
    reveal_type(handler)  # the decorator returns the handler unchanged (checked by the test)

    @d.handler("thumbnail", retry_delay=lambda attempt: 2.0 ** attempt)
    def thumbnail(ctx: Context, body: bytes) -> None:
        ctx.logger.info("thumbnail of %d bytes", len(body))

    assert_type(d.publish("resize", {"w": 100}), int)
    with d:
        assert_type(d.scale("resize", 4, wait=5.0), bool)
        assert_type(d.wait_ready(timeout=5.0), bool)
        assert_type(d.workers(), dict[str, list[int]])
        st = d.status()
        print(shmq.dispatch.format_status(st))
        assert_type(shmq.dispatch.format_status(shmq.dispatch.status(path)), str)
        assert_type(d.metrics(), dict[str, Any])
    assert_type(Dispatcher.metrics(path), dict[str, Any])
    shmq.dispatch.scale(path, "resize", 2)
    shmq.dispatch.stop(path)
    Dispatcher.destroy(path)
    assert_type(shmq.Dispatcher, type[Dispatcher])


def odds_and_ends(data: bytes) -> None:
    stamp, payload = shmq.dedupe.split_stamp(data)
    dedupe = shmq.dedupe.Deduper(max_keys=1000)
    assert_type(dedupe.seen(stamp), bool)
    if stamp is not None:
        assert_type(stamp.key, tuple[str, int, int, int])
    print(payload)
    item, codec = shmq.codec.encode({"a": 1})
    assert_type(codec, int)
    arr = shmq.columnar.decode_array(shmq.columnar.encode_array(np.zeros(3))[0])
    assert_type(arr, npt.NDArray[Any])
    try:
        raise shmq.Empty("none")
    except shmq.ShmqError as exc:
        assert_type(exc.kind, str)
    assert_type(shmq.FORMAT_VERSION, int)
