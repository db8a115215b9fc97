"""Child-process entry points for multi-process tests (importable under spawn)."""

import os
import signal
import struct
import time

import shmq

from conftest import bound

REC = struct.Struct("<II")  # writer id, per-writer counter


def write_records(path, writer_id, count, payload_bytes=100, batch=1):
    sp = shmq.Spool.open(path)
    pad = b"p" * max(0, payload_bytes - REC.size)
    i = 0
    while i < count:
        n = min(batch, count - i)
        items = [REC.pack(writer_id, i + k) + pad for k in range(n)]
        if n == 1:
            sp.put(items[0])
        else:
            sp.put_many(items)
        i += n
    sp.close()


def read_records(path, name, count, conn, group=False, timeout=bound(30)):
    """Read ``count`` frames from a named reader; send back (writer, counter, seq) triples."""
    sp = shmq.Spool.open(path)
    r = sp.reader(name, group=group)
    got = []
    try:
        while len(got) < count:
            f = r.get(timeout=timeout)
            w, c = REC.unpack_from(f.data)
            got.append((w, c, f.seq))
    except shmq.Empty:
        pass
    conn.send((got, r.lost))
    conn.close()
    sp.close()


def group_drain(path, name, conn, stop_after_idle=1.0):
    sp = shmq.Spool.open(path)
    r = sp.reader(name, group=True)
    got = []
    try:
        while True:
            got.append(r.get(timeout=stop_after_idle).seq)
    except shmq.Empty:
        pass
    conn.send(got)
    conn.close()
    sp.close()


def hold_writer_lock_forever(path, ready):
    """Take the writer lock and signal; the parent SIGKILLs us while we hold it."""
    sp = shmq.Spool.open(path)
    sp.writer_lock.acquire()
    ready.set()
    time.sleep(600)


def hold_group_lock_forever(path, name, ready):
    sp = shmq.Spool.open(path)
    r = sp.reader(name, group=True)
    r._lock.acquire()
    ready.set()
    time.sleep(600)


def put_after_event(path, go, data):
    sp = shmq.Spool.open(path)
    if go.wait(bound(30)):
        sp.put(data)
    sp.close()


def put_and_report(path, data, conn, timeout):
    sp = shmq.Spool.open(path)
    t = time.monotonic()
    try:
        seq = sp.put(data, timeout=timeout)
        conn.send(("ok", seq, time.monotonic() - t))
    except Exception as exc:  # report, the parent asserts
        conn.send(("error", repr(exc), time.monotonic() - t))
    conn.close()
    sp.close()


def attach_named(path, name, conn):
    sp = shmq.Spool.open(path)
    try:
        sp.reader(name)
        conn.send("attached")
    except shmq.ReaderBusy as exc:
        conn.send(f"busy: {exc}")
    conn.close()
    sp.close()


def die_holding_reader(path, name, ready):
    sp = shmq.Spool.open(path)
    sp.reader(name)
    ready.set()
    os.kill(os.getpid(), signal.SIGKILL)


def squatted_group_member(path, q):
    """Join group "workers"; report "refused" if its semaphore was squatted (test_security)."""
    sp = shmq.Spool.open(path)
    try:
        r = sp.reader("workers", group=True)
    except shmq.ShmqError as exc:
        q.put("refused" if "squatted" in str(exc) else str(exc))
    else:
        q.put(r.get(timeout=1).data)
    finally:
        sp.close()
