#!/usr/bin/env python3
"""Request/reply: ``shmq.Service``/``shmq.Client`` against named peers, in one run.

Three measurements, each against the same handler behind its peers
(interleaved repeats; medians and ratios printed at the end):

* ``small``: round trip of a small call (a dict in, a dict out), one client,
  one worker: p50 and p99 of single calls.  Peers: a Unix stream socket
  (length-prefixed pickle), pyzmq REQ/REP over ``ipc://``, and
  ``multiprocessing.connection`` (AF_UNIX).
* ``pipelined``: 8 client processes each calling ``call_many`` in batches
  of ``--batch`` small calls; calls/s for all of them.  Peer: the socket
  server (one process, selectors), each client writing a batch of
  requests then reading the batch of replies.  The service has one worker
  (``--workers``), the socket server one process.
  Each client is set up (its first call made, its socket connected) before
  the clock starts, and multiprocessing's resource tracker (every
  ``shmq.Queue``, so every client's reply queue, registers with it) is
  started once in this process first, as in a long-running application:
  otherwise each forked client starts its own (a new interpreter, ~50 ms of
  CPU) while the others are being measured.
* ``arrow``: 64k rows x 10 float64 columns in, one column (their row sum)
  out, one client, one worker: calls/s.  Peer: a Unix socket carrying Arrow
  IPC streams both ways.
* ``concurrency``: N concurrent ``call_async`` (``--concurrency``, default
  2,000, 20,000 and 100,000) on one ``Client`` in one event loop, all
  issued at once, until all are answered; calls/s.  Peer: 64 threads
  calling ``call()`` on one ``Client`` (``--thread-calls`` in all).  The
  service has 2 workers (``--concurrency-workers``); each run is a fresh
  service and a fresh client process (forked), which checks every reply
  against its request and reports its CPU time per call, its peak RSS
  and the event loop's ``call_soon_threadsafe`` calls (self-pipe writes:
  wake-ups from outside the loop's own callbacks) per reply.  On a
  shared host the calls/s move with the other load; the client's CPU per
  call is the steadier figure.

    python stress/bench_service.py --quick
    python stress/bench_service.py --repeats 5 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import json
import multiprocessing as mp
import os
import pickle
import platform
import resource
import selectors
import shutil
import signal
import socket
import statistics
import struct
import sys
import tempfile
import threading
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
# This checkout's shmq when its core is built in place; otherwise the installed one
# (a source tree without a built core cannot be imported).
if glob.glob(os.path.join(ROOT, "shmq", "_core*.so")):
    sys.path.insert(0, ROOT)

import shmq  # noqa: E402

FORK = mp.get_context("fork")
LEN = struct.Struct("<I")
_runs = iter(range(1 << 30))  # a fresh address per run: a killed server leaves its socket file


def small_handler(req):
    return {"id": req["id"], "ok": True, "score": req["x"] * 2}


def small_request(i):
    return {"id": i, "x": 1.5, "name": "row"}


def arrow_handler(batch):
    import numpy as np
    import pyarrow as pa

    total = np.zeros(batch.num_rows)
    for col in batch.columns:
        total += col.to_numpy(zero_copy_only=False)
    return pa.record_batch({"sum": total})


def arrow_request(rows, cols):
    import numpy as np
    import pyarrow as pa

    rng = np.random.default_rng(1)
    return pa.record_batch({f"c{i}": rng.random(rows) for i in range(cols)})


# ------------------------------------------------------------------ servers


def _recv_exact(sock, n):
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            raise EOFError
        got += k
    return buf


def socket_server(path, handler, ready):
    """One process, many connections (selectors): length-prefixed pickles."""
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(64)
    ready.set()
    sel = selectors.DefaultSelector()
    sel.register(srv, selectors.EVENT_READ)
    bufs = {}
    while True:
        for key, _ in sel.select():
            s = key.fileobj
            if s is srv:
                c, _ = srv.accept()
                sel.register(c, selectors.EVENT_READ)
                bufs[c] = bytearray()
                continue
            data = s.recv(1 << 20)
            if not data:
                sel.unregister(s)
                s.close()
                del bufs[s]
                continue
            b = bufs[s]
            b += data
            out = []
            while len(b) >= 4:
                (n,) = LEN.unpack_from(b)
                if len(b) < 4 + n:
                    break
                req = pickle.loads(b[4:4 + n])
                del b[:4 + n]
                rep = pickle.dumps(handler(req), 5)
                out.append(LEN.pack(len(rep)) + rep)
            if out:
                s.sendall(b"".join(out))


def arrow_socket_server(path, handler, ready):
    import pyarrow as pa

    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(4)
    ready.set()
    while True:
        c, _ = srv.accept()
        try:
            while True:
                (n,) = LEN.unpack(_recv_exact(c, 4))
                buf = _recv_exact(c, n)
                batch = pa.ipc.open_stream(pa.py_buffer(buf)).read_next_batch()
                rep = handler(batch)
                sink = pa.BufferOutputStream()
                with pa.ipc.new_stream(sink, rep.schema) as w:
                    w.write_batch(rep)
                out = sink.getvalue()
                c.sendall(LEN.pack(out.size))
                c.sendall(out)
        except EOFError:
            c.close()


def zmq_server(addr, handler, ready):
    import zmq

    z = zmq.Context()
    s = z.socket(zmq.REP)
    s.bind(addr)
    ready.set()
    while True:
        s.send(pickle.dumps(handler(pickle.loads(s.recv())), 5))


def mpc_server(addr, handler, ready):
    from multiprocessing.connection import Listener

    with Listener(addr, "AF_UNIX") as ln:
        ready.set()
        while True:
            conn = ln.accept()
            try:
                while True:
                    conn.send(handler(conn.recv()))
            except EOFError:
                conn.close()


def service_server(path, handler, workers, prefetch=1, copy=True):
    shmq.Service(path, prefetch=prefetch, copy=copy).serve(handler, workers=workers)


def start(target, *args):
    ready = FORK.Event()
    p = FORK.Process(target=target, args=args + (ready,), daemon=True)
    p.start()
    assert ready.wait(30), f"{target.__name__} did not start"
    return p


def stop(p):
    if p.is_alive():
        os.kill(p.pid, signal.SIGTERM)
    p.join(30)
    if p.is_alive():
        p.kill()
        p.join()


# ------------------------------------------------------------------ clients


def percentiles(lat):
    lat = sorted(lat)
    return lat[len(lat) // 2], lat[min(len(lat) - 1, int(len(lat) * 0.99))]


def time_calls(call, n, warm=200):
    for i in range(warm):
        call(small_request(i))
    lat = []
    clock = time.perf_counter_ns
    for i in range(n):
        req = small_request(i)
        t = clock()
        call(req)
        lat.append((clock() - t) / 1000)
    return percentiles(lat)


def small_shmq(d, n):
    path = os.path.join(d, "small")
    shmq.Service(path).close()
    p = FORK.Process(target=service_server, args=(path, small_handler, 1))
    p.start()
    try:
        with shmq.Client(path) as cl:
            cl.call(small_request(0), timeout=30)
            return time_calls(lambda r: cl.call(r, timeout=30), n)
    finally:
        stop(p)
        shmq.Service.destroy(path)


def small_socket(d, n):
    path = os.path.join(d, f"small{next(_runs)}.sock")
    p = start(socket_server, path, small_handler)
    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(path)

        def call(req):
            data = pickle.dumps(req, 5)
            s.sendall(LEN.pack(len(data)) + data)
            (m,) = LEN.unpack(_recv_exact(s, 4))
            return pickle.loads(_recv_exact(s, m))

        try:
            return time_calls(call, n)
        finally:
            s.close()
    finally:
        stop(p)
        os.unlink(path)


def small_zmq(d, n):
    import zmq

    addr = f"ipc://{d}/small{next(_runs)}.zmq"
    p = start(zmq_server, addr, small_handler)
    try:
        z = zmq.Context()
        s = z.socket(zmq.REQ)
        s.connect(addr)

        def call(req):
            s.send(pickle.dumps(req, 5))
            return pickle.loads(s.recv())

        try:
            return time_calls(call, n)
        finally:
            s.close(0)
            z.term()
    finally:
        stop(p)


def small_mpc(d, n):
    from multiprocessing.connection import Client

    addr = os.path.join(d, f"small{next(_runs)}.mpc")
    p = start(mpc_server, addr, small_handler)
    try:
        with Client(addr, "AF_UNIX") as c:
            def call(req):
                c.send(req)
                return c.recv()

            return time_calls(call, n)
    finally:
        stop(p)


def _pipe_shmq(path, calls, batch, go, out):
    with shmq.Client(path) as cl:
        cl.call(small_request(0), timeout=30)
        out.put("ready")
        go.wait(60)
        t = time.perf_counter()
        for i in range(0, calls, batch):
            got = cl.call_many([small_request(j) for j in range(i, i + batch)], timeout=120)
            assert got[-1]["id"] == i + batch - 1
        out.put(time.perf_counter() - t)


def _pipe_socket(path, calls, batch, go, out):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    out.put("ready")
    go.wait(60)
    t = time.perf_counter()
    for i in range(0, calls, batch):
        parts = []
        for j in range(i, i + batch):
            data = pickle.dumps(small_request(j), 5)
            parts.append(LEN.pack(len(data)) + data)
        s.sendall(b"".join(parts))
        for _ in range(batch):
            (m,) = LEN.unpack(_recv_exact(s, 4))
            rep = pickle.loads(_recv_exact(s, m))
        assert rep["id"] == i + batch - 1
    out.put(time.perf_counter() - t)
    s.close()


def pipelined(kind, d, clients, calls, batch, workers, prefetch):
    """Calls/s of ``clients`` processes, from a common start to the last one done."""
    if kind == "shmq":
        path = os.path.join(d, "pipe")
        shmq.Service(path).close()
        server = FORK.Process(target=service_server, args=(path, small_handler, workers, prefetch))
        server.start()
        target = _pipe_shmq
    else:
        path = os.path.join(d, f"pipe{next(_runs)}.sock")
        server = start(socket_server, path, small_handler)
        target = _pipe_socket
    go, out = FORK.Event(), FORK.Queue()
    procs = [FORK.Process(target=target, args=(path, calls, batch, go, out)) for _ in range(clients)]
    try:
        for p in procs:
            p.start()
        for _ in procs:  # every client set up (a shmq client's reply queue, a socket's
            assert out.get(timeout=120) == "ready"  # connection): the steady state only
        t = time.perf_counter()
        go.set()
        for _ in procs:
            out.get(timeout=300)
        elapsed = time.perf_counter() - t
        for p in procs:
            p.join(30)
        return clients * calls / elapsed
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        stop(server)
        if kind == "shmq":
            shmq.Service.destroy(path)
        else:
            os.unlink(path)


def arrow_shmq(d, n, batch, copy=True):
    path = os.path.join(d, "arrow")
    shmq.Service(path, capacity="64MiB").close()
    p = FORK.Process(target=service_server, args=(path, arrow_handler, 1, 1, copy))
    p.start()
    try:
        with shmq.Client(path) as cl:
            rep = cl.call(batch, timeout=60)
            assert rep.num_rows == batch.num_rows
            t = time.perf_counter()
            for _ in range(n):
                cl.call(batch, timeout=60)
            return n / (time.perf_counter() - t)
    finally:
        stop(p)
        shmq.Service.destroy(path)


def arrow_views(d, n, batch):
    """``arrow_shmq`` with ``Service(copy=False)``: the worker reads requests in place."""
    return arrow_shmq(d, n, batch, copy=False)


def arrow_socket(d, n, batch):
    import pyarrow as pa

    path = os.path.join(d, f"arrow{next(_runs)}.sock")
    p = start(arrow_socket_server, path, arrow_handler)
    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(path)

        def call(b):
            sink = pa.BufferOutputStream()
            with pa.ipc.new_stream(sink, b.schema) as w:
                w.write_batch(b)
            buf = sink.getvalue()
            s.sendall(LEN.pack(buf.size))
            s.sendall(buf)
            (m,) = LEN.unpack(_recv_exact(s, 4))
            return pa.ipc.open_stream(pa.py_buffer(_recv_exact(s, m))).read_next_batch()

        try:
            assert call(batch).num_rows == batch.num_rows
            t = time.perf_counter()
            for _ in range(n):
                call(batch)
            return n / (time.perf_counter() - t)
        finally:
            s.close()
    finally:
        stop(p)
        os.unlink(path)


class CountingLoop(asyncio.SelectorEventLoop):
    """An event loop that counts ``call_soon_threadsafe`` calls: each writes to its
    self-pipe, waking it from outside its own callbacks."""

    threadsafe = 0

    def call_soon_threadsafe(self, *args, **kwargs):
        self.threadsafe += 1
        return super().call_soon_threadsafe(*args, **kwargs)


async def _many_async(cl, n):
    """``n`` concurrent ``call_async``, all issued at once; the replies that do not
    match their request."""
    async def one(i):
        rep = await cl.call_async(small_request(i), timeout=600)
        return rep["id"] != i or rep["score"] != 3.0

    return sum(await asyncio.gather(*[one(i) for i in range(n)]))


def _many_threads(cl, threads, calls):
    """``threads`` threads calling ``call()`` ``calls`` times in all; mismatched replies."""
    start = threading.Barrier(threads + 1)
    bad = [0] * threads

    def work(k):
        start.wait(60)
        for i in range(k, calls, threads):
            rep = cl.call(small_request(i), timeout=600)
            bad[k] += rep["id"] != i or rep["score"] != 3.0

    ts = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
    for t in ts:
        t.start()
    start.wait(60)
    t0 = time.perf_counter()
    for t in ts:
        t.join()
    return time.perf_counter() - t0, sum(bad)


def _concurrency_client(path, kind, n, out):
    """A client process: one run of ``n`` calls (``kind``: "async" or "threads")."""
    try:
        with shmq.Client(path) as cl:
            cl.call(small_request(0), timeout=60)  # set up: reply queue, ring attached
            wakes = 0
            cpu = time.process_time()
            if kind == "threads":
                elapsed, bad = _many_threads(cl, THREADS, n)
            else:
                loop = CountingLoop()
                try:
                    t0 = time.perf_counter()
                    bad = loop.run_until_complete(_many_async(cl, n))
                    elapsed = time.perf_counter() - t0
                    wakes = loop.threadsafe
                finally:
                    loop.close()
            cpu = time.process_time() - cpu
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB -> MiB
            out.put((n / elapsed, bad, rss, wakes / n, cpu / n * 1e6))
    except BaseException as exc:  # noqa: BLE001  (reported by the parent)
        out.put(repr(exc))
        raise


#: Threads calling ``call()`` in the concurrency row's peer.
THREADS = 64


def concurrency(kind, d, n, workers):
    """One run: (calls/s, mismatched replies, client peak RSS in MiB, wake-ups per reply,
    the client process's CPU time per call in us)."""
    path = os.path.join(d, "conc")
    shmq.Service(path).close()
    server = FORK.Process(target=service_server, args=(path, small_handler, workers))
    server.start()
    out = FORK.Queue()
    client = FORK.Process(target=_concurrency_client, args=(path, kind, n, out))
    try:
        client.start()
        got = out.get(timeout=1800)
        client.join(60)
        if isinstance(got, str):
            raise RuntimeError(f"concurrency client ({kind}, {n}) failed: {got}")
        return got
    finally:
        if client.is_alive():
            client.kill()
        stop(server)
        shmq.Service.destroy(path)


# ------------------------------------------------------------------ main


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer calls, 1 repeat")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--calls", type=int, default=5000, help="small calls per round-trip run")
    ap.add_argument("--clients", type=int, default=8)
    # 64,000: about half a second of shmq's 8 clients, 2-3 s of the socket's.  At
    # 16,000 (0.1-0.3 s) a window was a few scheduler quanta of this shared 2-vCPU
    # host and its figure moved by 2x between repeats (docs/service.md).
    ap.add_argument("--pipe-calls", type=int, default=64000, help="calls per pipelining client")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--prefetch", type=int, default=1, help="Service(prefetch=) when pipelining")
    ap.add_argument("--arrow-calls", type=int, default=60)
    ap.add_argument("--rows", type=int, default=65536)
    ap.add_argument("--concurrency", default="2000,20000,100000",
                    help="concurrent call_async runs, comma-separated (the first two are the ratio's)")
    ap.add_argument("--thread-calls", type=int, default=20000,
                    help=f"calls of the {THREADS} threads' run, in all")
    ap.add_argument("--concurrency-workers", type=int, default=2)
    ap.add_argument("--only", choices=["small", "pipelined", "arrow", "concurrency"], action="append")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    if a.quick:
        a.repeats, a.calls, a.pipe_calls, a.arrow_calls = 1, 1000, 512, 10
        a.concurrency, a.thread_calls = "100,1000,3000", 640
    sweep = [int(x) for x in a.concurrency.split(",")]
    if len(sweep) < 2 or min(sweep) < 1:
        ap.error("--concurrency needs at least two positive counts")
    only = a.only or ["small", "pipelined", "arrow", "concurrency"]
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()  # shared by every forked client (see the docstring)
    d = tempfile.mkdtemp(prefix="shmq-bench-svc-", dir="/dev/shm")
    runs = {}

    def add(key, val):
        runs.setdefault(key, []).append(val)

    try:
        batch = None
        if "arrow" in only:
            batch = arrow_request(a.rows, 10)
        for r in range(a.repeats):
            if "small" in only:
                for name, fn in (("shmq", small_shmq), ("socket", small_socket),
                                 ("pyzmq", small_zmq), ("mp.connection", small_mpc)):
                    p50, p99 = fn(d, a.calls)
                    add(("small", name, "p50"), p50)
                    add(("small", name, "p99"), p99)
                    print(f"  [{r}] small {name:14s} p50 {p50:7.1f} us  p99 {p99:7.1f} us", flush=True)
            if "pipelined" in only:
                for name in ("shmq", "socket"):
                    v = pipelined(name, d, a.clients, a.pipe_calls, a.batch, a.workers, a.prefetch)
                    add(("pipelined", name, "calls/s"), v)
                    print(f"  [{r}] pipelined {name:10s} {v:10.0f} calls/s", flush=True)
            if "arrow" in only:
                for name, fn in (("shmq", arrow_shmq), ("shmq copy=False", arrow_views),
                                 ("socket+arrow-ipc", arrow_socket)):
                    v = fn(d, a.arrow_calls, batch)
                    add(("arrow", name, "calls/s"), v)
                    print(f"  [{r}] arrow {name:16s} {v:8.1f} calls/s "
                          f"({v * a.rows / 1e6:.2f} M rows/s)", flush=True)
            if "concurrency" in only:
                for kind, n in [("threads", a.thread_calls)] + [("async", n) for n in sweep]:
                    name = f"{THREADS} threads" if kind == "threads" else f"async {n}"
                    v, bad, rss, wakes, cpu = concurrency(kind, d, n, a.concurrency_workers)
                    if bad:
                        raise SystemExit(f"concurrency {name}: {bad} replies did not match their call")
                    add(("concurrency", name, "calls/s"), v)
                    add(("concurrency", name, "rss MiB"), rss)
                    add(("concurrency", name, "cpu us/call"), cpu)
                    if kind == "async":
                        add(("concurrency", name, "wakes/reply"), wakes)
                    print(f"  [{r}] concurrency {name:14s} {v:9.0f} calls/s  client CPU {cpu:5.1f} us/call"
                          f"  peak RSS {rss:6.1f} MiB"
                          + (f"  {wakes:.4f} wake-ups/reply" if kind == "async" else ""), flush=True)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in runs.items()}
    print(f"\nmedians of {a.repeats} interleaved run(s); machine: {platform.processor() or platform.machine()} "
          f"x{os.cpu_count()}, Python {platform.python_version()}, load {os.getloadavg()[0]:.1f}")
    lines = []
    if "small" in only:
        s50, s99 = med[("small", "shmq", "p50")], med[("small", "shmq", "p99")]
        lines.append(f"small call, 1 client, 1 worker: shmq p50 {s50:.1f} us, p99 {s99:.1f} us")
        for peer in ("socket", "pyzmq", "mp.connection"):
            p50, p99 = med[("small", peer, "p50")], med[("small", peer, "p99")]
            lines.append(f"  {peer:14s} p50 {p50:7.1f} us (shmq {p50 / s50:.2f}x)   "
                         f"p99 {p99:7.1f} us (shmq {p99 / s99:.2f}x)")
    if "pipelined" in only:
        s, k = med[("pipelined", "shmq", "calls/s")], med[("pipelined", "socket", "calls/s")]
        lines.append(f"pipelined, {a.clients} clients x call_many({a.batch}): shmq {s:,.0f} calls/s, "
                     f"socket {k:,.0f} calls/s: shmq {s / k:.2f}x (target >= 3x)")
    if "arrow" in only:
        s, k = med[("arrow", "shmq", "calls/s")], med[("arrow", "socket+arrow-ipc", "calls/s")]
        v = med[("arrow", "shmq copy=False", "calls/s")]
        lines.append(f"arrow {a.rows} rows x 10 cols in, 1 col out: shmq {s:.1f} calls/s, socket+IPC "
                     f"{k:.1f} calls/s: shmq {s / k:.2f}x (target >= 1.5x); Service(copy=False) "
                     f"{v:.1f} calls/s: {v / k:.2f}x")
    if "concurrency" in only:
        th = med[("concurrency", f"{THREADS} threads", "calls/s")]
        lines.append(f"concurrency, one Client, {a.concurrency_workers} workers: {THREADS} threads "
                     f"on call() {th:,.0f} calls/s (client CPU "
                     f"{med[('concurrency', f'{THREADS} threads', 'cpu us/call')]:.1f} us/call, peak RSS "
                     f"{med[('concurrency', f'{THREADS} threads', 'rss MiB')]:.0f} MiB)")
        for n in sweep:
            v = med[("concurrency", f"async {n}", "calls/s")]
            lines.append(f"  {n:>7,} concurrent call_async {v:9,.0f} calls/s ({v / th:.2f}x the threads), "
                         f"client CPU {med[('concurrency', f'async {n}', 'cpu us/call')]:.1f} us/call, "
                         f"peak RSS {med[('concurrency', f'async {n}', 'rss MiB')]:.0f} MiB, "
                         f"{med[('concurrency', f'async {n}', 'wakes/reply')]:.4f} wake-ups/reply")
        lo, hi = sweep[0], sweep[1]
        v0, v1 = med[("concurrency", f"async {lo}", "calls/s")], med[("concurrency", f"async {hi}", "calls/s")]
        lines.append(f"  {hi:,} / {lo:,} concurrent: {v1 / v0:.2f}x (target >= 0.8x); {hi:,} / "
                     f"{THREADS} threads: {v1 / th:.2f}x (target >= 1x); every reply matched its call")
    print("\n".join(lines))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"medians": {"/".join(k): v for k, v in med.items()},
                       "runs": {"/".join(k): v for k, v in runs.items()},
                       "summary": lines, "args": vars(a)}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
