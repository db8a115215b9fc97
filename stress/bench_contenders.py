"""What stress/bench.py races: shmq's public API, ``multiprocessing.Queue``,
faster-fifo, and the inline pure-Python rings (the ceiling on this machine).

The other IPC peers a Python user might pick (pyzmq, POSIX message queues,
iceoryx2) are in ``bench_peers.py``.  Only shmq's public API is used here, so
the benchmark keeps working whatever happens to the internals.

A contender's life in one measured run::

    chan = c.setup(tmp, sc)                 # parent, before forking
    h = c.open(chan, role, index, sc)        # each child, before the start line
    c.producer(h, item, n, sc)               #   timed
    c.consumer(h, n, index, sc)              #   timed
    c.close(h)                               # each child, after its last item
    c.teardown(chan)                         # parent

``sc`` is the scenario (kind, size, producers, consumers, batch, fanout).
``c.unavailable(sc)`` names why a contender cannot run here ("not installed
..."), so the row says so instead of the run crashing.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time

import numpy as np

import shmq

try:
    import faster_fifo
except ImportError:  # optional peer
    faster_fifo = None

CTX = mp.get_context("fork")  # closures as process targets; no pickling of channels
BIG_CAPACITY = "64MiB"  # never wraps in one run: the unwrapped fast path
GROW_START = "1MiB"  # a growable spool's first allocation (shmq.Queue()'s default)
WRAP_CAPACITY = "1MiB"  # the wrapped rows: small enough that every run wraps it many times
WRAPS_BEFORE_TIMING = 4  # pre-fill: bytes written before timing, in ring capacities
BIG_WRAPS_BEFORE_TIMING = 2  # the same for the wrapped BIG_CAPACITY row (256 MiB of pre-fill is slow)
THREADS = 8  # per process, in the threads row
RECORD = np.dtype([("id", "<i8"), ("ts", "<i8"), ("value", "<f8"), ("name", "S76")])
assert RECORD.itemsize == 100


# --- payloads -------------------------------------------------------------------

def payload(kind, size):
    if kind == "bytes":
        return b"x" * size
    if kind == "dict":
        return {"id": 12345, "name": "sensor-7", "value": 3.25, "ok": True, "tags": ["a", "b"]}
    if kind == "numpy":
        return np.ones(size // 8, dtype=np.float64)
    if kind == "records":  # a batch of 1000 100-byte records
        recs = np.zeros(1000, dtype=RECORD)
        recs["id"] = np.arange(1000)
        return recs
    if kind == "arrow":  # 64k rows x 10 columns
        import pyarrow as pa

        return pa.record_batch({f"c{i}": (np.arange(65536, dtype=np.int64) if i % 2 else
                                          np.random.default_rng(i).random(65536)) for i in range(10)})
    raise ValueError(kind)


def nbytes_of(kind, size):
    if kind == "records":
        return 100
    if kind == "arrow":
        return 65536 * 10 * 8
    return size if kind in ("bytes", "numpy") else 0


def distinct(item, count):
    """``count`` distinct objects like ``item`` for one batch.

    A batch of one object repeated would flatter whoever pickles the batch as
    a whole (pickle's memo writes the repeats as back-references); real
    batches hold distinct rows.
    """
    if isinstance(item, bytes) and len(item) >= 8:
        return [item[:-8] + i.to_bytes(8, "little") for i in range(count)]
    if isinstance(item, dict):
        return [dict(item, id=i, name=f"sensor-{i}", tags=list(item["tags"])) for i in range(count)]
    return [item] * count


class Contender:
    name = "?"
    batch = False

    def unavailable(self, sc):
        """Why this contender cannot run scenario ``sc`` here, or None."""
        return None

    def setup(self, tmp, sc):
        return None

    def open(self, chan, role, index, sc):
        return chan

    def close(self, h):
        pass

    def teardown(self, chan):
        pass


# --- shmq -------------------------------------------------------------------------


class Spool(Contender):
    """shmq.Spool put/get: a named reader, or a group when there are several consumers."""

    def __init__(self, batch=False):
        self.batch = batch
        self.name = "spool-batch" if batch else "spool"

    def setup(self, tmp, sc):
        path = os.path.join(tmp, f"spool-{time.monotonic_ns()}")
        sp = shmq.Spool.create(path, capacity=BIG_CAPACITY, on_full="block", checksum=False)
        self._add_readers(sp, sc)
        sp.close()
        return path

    @staticmethod
    def _add_readers(sp, sc):
        if sc.fanout:
            for i in range(sc.consumers):
                sp.reader(f"r{i}").close()
        elif sc.consumers > 1:
            sp.reader("g", group=True).close()
        else:
            sp.reader("r0").close()

    def open(self, path, role, index, sc):
        sp = shmq.Spool.open(path)
        if role == "producer":
            return sp, None
        group = not sc.fanout and sc.consumers > 1
        return sp, (sp.reader("g", group=True) if group else sp.reader(f"r{index}"))

    def producer(self, h, item, n, sc):
        sp = h[0]
        if self.batch:
            items = distinct(item, sc.batch)
            for _ in range(n // sc.batch):
                sp.put_many(items)
        else:
            put = sp.put
            for _ in range(n):
                put(item)

    def consumer(self, h, n, index, sc):
        r = h[1]
        got = 0
        if self.batch:
            while got < n:
                got += len(r.get_many(sc.batch))
        else:
            get = r.get
            for _ in range(n):
                get()

    def close(self, h):
        h[0].close()

    def teardown(self, path):
        shmq.Spool.destroy(path)


class SpoolWrapped(Spool):
    """A ring in steady state (1 MiB, or BIG_CAPACITY for the large-ring row):
    pre-filled (and drained) until it has wrapped, so every timed put must make
    room by evicting old frames, and the producer process writes, for its whole
    run, into pages of an earlier lap that it has never touched."""

    def __init__(self, capacity=WRAP_CAPACITY, wraps=WRAPS_BEFORE_TIMING):
        super().__init__()
        self.name = "spool-wrapped"
        self.capacity, self.wraps = capacity, wraps

    def unavailable(self, sc):
        return None if sc.producers == sc.consumers == 1 and sc.kind == "bytes" else "n/a (1->1 bytes only)"

    def setup(self, tmp, sc):
        path = os.path.join(tmp, f"wrapped-{time.monotonic_ns()}")
        sp = shmq.Spool.create(path, capacity=self.capacity, on_full="block", checksum=False)
        r = sp.reader("r0")
        items = distinct(payload(sc.kind, sc.size), 64)
        chunk = sum(len(x) for x in items)
        for _ in range(-(-self.wraps * sp.capacity // chunk)):
            sp.put_many(items)
            got = 0
            while got < len(items):
                got += len(r.get_many(len(items), timeout=10))
        wrapped = sp.first_seq > 0
        r.close()
        sp.close()
        if not wrapped:
            shmq.Spool.destroy(path)
            raise RuntimeError("pre-fill did not wrap the ring: the row would not measure the steady state")
        return path


class SpoolGrowable(Spool):
    """A growable spool: 1 MiB of pages at first, growing on demand up to
    BIG_CAPACITY (the fixed ``spool`` row's size), the way ``shmq.Queue()``'s
    rings grow: the ratio of the two rows is what growth costs."""

    def __init__(self):
        super().__init__()
        self.name = "spool-growable"

    def setup(self, tmp, sc):
        path = os.path.join(tmp, f"growable-{time.monotonic_ns()}")
        sp = shmq.Spool.create(path, capacity=GROW_START, max_capacity=BIG_CAPACITY,
                               on_full="block", checksum=False)
        self._add_readers(sp, sc)
        sp.close()
        return path


WARM_BYTES = 256 << 20  # a grown spool's untimed pass: at most this much payload


def _warm_role(contender, role, path, item, n, sc):
    """One side of a grown spool's untimed pass: the row's own producer or
    consumer code, in a process of its own, as the timed run has it."""
    h = contender.open(path, role, 0, sc)
    try:
        if role == "producer":
            contender.producer(h, item, n, sc)
        else:
            contender.consumer(h, n, 0, sc)
    finally:
        contender.close(h)


class SpoolGrown(SpoolGrowable):
    """The growable spool once grown: before timing, one untimed pass of the same
    1->1 workload (the row's producer and consumer code in two processes, up to
    WARM_BYTES of payload) lets the hot zone reach the size this workload keeps,
    as in a long-running queue.  With ``spool-growable`` (growth inside the timed
    run) it gives the ratio with and without growth.

    The pass is the timed run's own code because the zone's size follows the
    two sides' speeds: a pass of other code (a reader in this process, puts
    with a timeout) leaves 100-byte frames a zone of 2-3 MiB instead of
    11-32, and the timed run then grows it by 10 to 20 segments."""

    def __init__(self):
        super().__init__()
        self.name = "spool-grown"

    def unavailable(self, sc):
        return None if sc.producers == sc.consumers == 1 and sc.batch == 1 else "n/a (1->1 only)"

    def setup(self, tmp, sc):
        path = super().setup(tmp, sc)
        item = payload(sc.kind, sc.size)
        n = max(64, min(sc.items, WARM_BYTES // max(1, nbytes_of(sc.kind, sc.size))))
        roles = ("consumer", "producer")
        procs = [CTX.Process(target=_warm_role, args=(self, role, path, item, n, sc), daemon=True)
                 for role in roles]
        try:
            for p in procs:
                p.start()
            for role, p in zip(roles, procs):
                p.join(60)
                if p.exitcode != 0:
                    why = "did not finish within 60 s" if p.exitcode is None else f"exited with {p.exitcode}"
                    raise RuntimeError(f"warm-up {role} {why}")
        except BaseException:
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join(10)
            shmq.Spool.destroy(path)
            raise
        return path


class SpoolReserve(Spool):
    """Zero-copy writes: ``with sp.reserve(nbytes) as buf: buf[:] = payload``; the
    reader copies each frame out with get(), as iceoryx2's subscriber does."""

    def __init__(self):
        super().__init__()
        self.name = "spool-reserve"

    def unavailable(self, sc):
        return None if hasattr(shmq.Spool, "reserve") else "n/a (no reserve API)"

    def producer(self, h, item, n, sc):
        sp = h[0]
        size = len(item)
        for _ in range(n):
            with sp.reserve(size) as buf:
                buf[:] = item


class SpoolCProducer(Spool):
    """A C program puts through shmq.h (stress/bench_cproducer.c, built here with the
    engine's sources), a Python named reader gets: the C API's producer with Python on
    the other end.  The program is started and opens the spool before the timed run,
    which starts when it reads a byte on its stdin."""

    _binary = None

    def __init__(self, batch=False):
        super().__init__(batch)
        self.name = "C producer" + (" batch" if batch else "")

    def unavailable(self, sc):
        if sc.kind != "bytes" or sc.producers != 1:
            return "n/a (bytes, one producer)"
        return None if self._build() else "n/a (no C compiler)"

    @classmethod
    def _build(cls):
        if cls._binary is None:
            import shutil
            import subprocess
            import tempfile

            cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
            here = os.path.dirname(os.path.abspath(__file__))
            engine = os.path.join(here, "..", "shmq", "engine")
            out = os.path.join(tempfile.mkdtemp(prefix="shmq-bench-c-"), "bench_cproducer")
            srcs = [os.path.join(engine, f) for f in sorted(os.listdir(engine)) if f.endswith(".c")]
            ok = cc and subprocess.run([cc, "-std=c11", "-O2", "-I", engine, "-o", out,
                                        os.path.join(here, "bench_cproducer.c"), *srcs, "-pthread"],
                                       capture_output=True).returncode == 0
            cls._binary = out if ok else ""
        return cls._binary

    def open(self, path, role, index, sc):
        if role != "producer":
            return super().open(path, role, index, sc)
        import subprocess

        # started and attached now; the count on its stdin starts the timed run
        return subprocess.Popen([self._build(), path, str(sc.size), str(sc.batch if self.batch else 1)],
                                stdin=subprocess.PIPE), None

    def producer(self, h, item, n, sc):
        h[0].communicate(f"{n}\n".encode())
        if h[0].returncode:
            raise RuntimeError(f"bench_cproducer exited with {h[0].returncode}")

    def close(self, h):
        if h[1] is not None:
            h[0].close()
        elif h[0].poll() is None:
            h[0].kill()
            h[0].wait()


class ShmqQueue(Contender):
    def __init__(self, batch=False):
        self.batch = batch
        self.name = "shmq.Queue-batch" if batch else "shmq.Queue"

    def setup(self, tmp, sc):
        return shmq.Queue(capacity=BIG_CAPACITY)

    def producer(self, q, item, n, sc):
        if self.batch:
            items = distinct(item, sc.batch)
            for _ in range(n // sc.batch):
                q.put_many(items)
        else:
            put = q.put
            for _ in range(n):
                put(item)

    def consumer(self, q, n, index, sc):
        got = 0
        if self.batch:
            while got < n:
                got += len(q.get_many(sc.batch))
        else:
            get = q.get
            for _ in range(n):
                get()

    def teardown(self, q):
        q.close()


# --- the stdlib and faster-fifo --------------------------------------------------------


class MpQueue(Contender):
    name = "mp.Queue"

    def setup(self, tmp, sc):
        return CTX.Queue()

    def producer(self, q, item, n, sc):
        put = q.put
        for _ in range(n):
            put(item)
        q.close()
        q.join_thread()  # the feeder thread has written everything

    def consumer(self, q, n, index, sc):
        get = q.get
        for _ in range(n):
            get()

    def teardown(self, q):
        q.close()


class FasterFifo(Contender):
    def __init__(self, batch=False):
        self.batch = batch
        self.name = "faster-fifo-batch" if batch else "faster-fifo"

    def unavailable(self, sc):
        return None if faster_fifo else "not installed (pip install faster-fifo)"

    def setup(self, tmp, sc):
        return faster_fifo.Queue(max_size_bytes=64 * 1024 * 1024)

    def producer(self, q, item, n, sc):
        if self.batch:
            items = distinct(item, sc.batch)
            for _ in range(n // sc.batch):
                q.put_many(items, timeout=1e9)
        else:
            put = q.put
            for _ in range(n):
                put(item, True, 1e9)

    def consumer(self, q, n, index, sc):
        got = 0
        if self.batch:
            while got < n:
                got += len(q.get_many(timeout=1e9, max_messages_to_get=sc.batch))
        else:
            get = q.get
            for _ in range(n):
                get(True, 1e9)

    def teardown(self, q):
        q.close()


def run_threads(body, count, per_thread, timeout_s):
    """Run ``body(per_thread)`` in ``count`` threads; raise the first error at once.

    :raises RuntimeError: a thread was still running after ``timeout_s``.
    """
    errors = []
    finished = threading.Semaphore(0)

    def run():
        try:
            body(per_thread)
        except BaseException as e:  # reported by the caller's thread
            errors.append(e)
        finished.release()

    for _ in range(count):
        threading.Thread(target=run, daemon=True).start()
    deadline = time.monotonic() + timeout_s
    for done in range(count):
        if not finished.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise RuntimeError(f"{count - done} of {count} threads still running after {timeout_s:.0f} s")
        if errors:
            raise errors[0]


class Threaded(Contender):
    """THREADS producer threads in one process, THREADS consumer threads in another,
    all sharing one queue handle per process.

    Each item is the payload dict with its own ``id``; the consumer process checks
    that it got every id exactly once, so a run that "works" also lost and
    duplicated nothing.
    """

    def __init__(self, inner):
        self.inner = inner
        self.name = f"{inner.name} {THREADS} threads"

    def unavailable(self, sc):
        if sc.kind != "dict":
            return "n/a (dict items carry the ids checked)"
        return self.inner.unavailable(sc)

    def setup(self, tmp, sc):
        return self.inner.setup(tmp, sc)

    def producer(self, q, item, n, sc):
        per = n // THREADS
        first = iter(range(0, n, per))

        def body(count):
            start = next(first)  # one thread at a time: next() on a range iterator holds the GIL
            put = q.put
            for k in range(start, start + count):
                put(dict(item, id=k))

        run_threads(body, THREADS, per, sc.timeout_s)
        if isinstance(self.inner, MpQueue):
            q.close()
            q.join_thread()

    def consumer(self, q, n, index, sc):
        seen = []

        def body(count):
            get = q.get
            got = [get()["id"] for _ in range(count)]
            seen.extend(got)

        run_threads(body, THREADS, n // THREADS, sc.timeout_s)
        if len(set(seen)) != n or min(seen) != 0 or max(seen) != n - 1:
            raise RuntimeError(f"{n - len(set(seen))} items lost, {len(seen) - len(set(seen))} duplicated")

    def teardown(self, q):
        self.inner.teardown(q)


# --- the ceilings: pure-Python rings, memcpy ---------------------------------------------


def _map(path):
    import mmap

    with open(path, "r+b") as f:
        return mmap.mmap(f.fileno(), 0)


class Ring(Contender):
    """The ceiling: one producer, one consumer, bytes only, nothing but copies."""

    name = "ring"

    def unavailable(self, sc):
        return None if sc.producers == sc.consumers == 1 else "n/a (single producer, single consumer)"

    def setup(self, tmp, sc):
        path = os.path.join(tmp, f"ring-{time.monotonic_ns()}")
        with open(path, "wb") as f:
            f.truncate(4096 + 16 * 1024 * 1024)
        return path

    def open(self, path, role, index, sc):
        return _map(path)

    def producer(self, mm, item, n, sc):
        ctl = memoryview(mm)[:64].cast("Q")  # [0] bytes written, [1] bytes read
        cap = len(mm) - 4096
        size = len(item)
        rec = (8 + size + 7) & ~7
        head = 0
        for _ in range(n):
            while head + rec - ctl[1] > cap:
                pass
            off = 4096 + head % cap
            if off + rec > len(mm):  # a record never straddles the end: skip the tail
                head += len(mm) - off
                off = 4096
                while head + rec - ctl[1] > cap:
                    pass
            mm[off:off + 8] = size.to_bytes(8, "little")
            mm[off + 8:off + 8 + size] = item
            head += rec
            ctl[0] = head
        ctl.release()

    def consumer(self, mm, n, index, sc):
        ctl = memoryview(mm)[:64].cast("Q")
        cap = len(mm) - 4096
        tail = 0
        for _ in range(n):
            while ctl[0] <= tail:
                pass
            off = 4096 + tail % cap
            length = int.from_bytes(mm[off:off + 8], "little")
            if length == 0 or off + 8 + length > len(mm):  # skipped tail (zeroed or stale)
                tail += len(mm) - off
                while ctl[0] <= tail:
                    pass
                off = 4096
                length = int.from_bytes(mm[off:off + 8], "little")
            mm[off + 8:off + 8 + length]
            tail += (8 + length + 7) & ~7
            ctl[1] = tail
        ctl.release()

    def close(self, mm):
        mm.close()

    def teardown(self, path):
        os.unlink(path)


class NumpyRing(Ring):
    """The ceiling for batches: the inline ring moving each batch as one array copy."""

    name = "numpy-ring"

    def producer(self, mm, item, n, sc):
        super().producer(mm, item.view(np.uint8).data, n // len(item), sc)

    def consumer(self, mm, n, index, sc):
        ctl = memoryview(mm)[:64].cast("Q")
        cap = len(mm) - 4096
        tail = 0
        for _ in range(n // 1000):
            while ctl[0] <= tail:
                pass
            off = 4096 + tail % cap
            length = int.from_bytes(mm[off:off + 8], "little")
            if length == 0 or off + 8 + length > len(mm):
                tail += len(mm) - off
                while ctl[0] <= tail:
                    pass
                off = 4096
                length = int.from_bytes(mm[off:off + 8], "little")
            np.frombuffer(mm, dtype=RECORD, count=length // 100, offset=off + 8).copy()
            tail += (8 + length + 7) & ~7
            ctl[1] = tail
        ctl.release()


class Memcpy(Contender):
    """Not a channel: one process copying the same bytes (the row's item size, from one
    buffer into another, both reused), for the bandwidth ceiling."""

    name = "memcpy"

    def open(self, chan, role, index, sc):
        if role == "producer":
            return None
        src = np.ones(nbytes_of(sc.kind, sc.size) // 8, dtype=np.int64)
        return src, np.empty_like(src)

    def producer(self, chan, item, n, sc):
        pass

    def consumer(self, h, n, index, sc):
        src, dst = h
        for _ in range(n):
            np.copyto(dst, src)


# --- columnar (docs/columnar.md) ----------------------------------------------------------


class SpoolRecords(Spool):
    """Record-stream mode: put_many(structured array) / get_many(as_array=True)."""

    def __init__(self):
        super().__init__()
        self.name = "spool-records"

    def producer(self, h, item, n, sc):
        for _ in range(n // len(item)):
            h[0].put_many(item)

    def consumer(self, h, n, index, sc):
        got = 0
        while got < n:
            got += len(h[1].get_many(64, as_array=True))


class FasterFifoRecords(FasterFifo):
    """The same records as 100-byte bytes objects, 1000 per put_many."""

    def __init__(self):
        super().__init__(batch=True)

    def producer(self, q, item, n, sc):
        items = [r.tobytes() for r in item]
        for _ in range(n // len(items)):
            q.put_many(items, timeout=1e9)

    def consumer(self, q, n, index, sc):
        got = 0
        while got < n:
            got += len(q.get_many(timeout=1e9, max_messages_to_get=1000))


class SpoolView(Spool):
    """put_array / get_array(copy=False): the reader maps the frame, no copy."""

    def __init__(self, copy=False):
        super().__init__()
        self.copy = copy
        self.name = "spool-array" if copy else "spool-array-view"

    def producer(self, h, item, n, sc):
        for _ in range(n):
            h[0].put_array(item)

    def consumer(self, h, n, index, sc):
        r = h[1]
        for _ in range(n):
            if self.copy:
                r.get_array()
            else:
                with r.get_array(copy=False) as v:
                    v.array[0]  # touch it


class SpoolArrow(Spool):
    def __init__(self):
        super().__init__()
        self.name = "spool-arrow-view"

    def producer(self, h, item, n, sc):
        for _ in range(n):
            h[0].put_arrow(item)

    def consumer(self, h, n, index, sc):
        r = h[1]
        for _ in range(n):
            with r.get_arrow(copy=False) as v:
                v.batch.num_rows
