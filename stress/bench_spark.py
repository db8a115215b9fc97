#!/usr/bin/env python3
"""Spark -> transport -> sidecar throughput: shmq against a local socket and multiprocessing.

One Spark job (``local[2]``, two write tasks) turns N generated rows into
JSON frames and hands them to a co-located sidecar process that decodes
every frame.  Only the hand-over differs between contenders:

* ``noop``: the frames are encoded and dropped (Spark's own cost, no sidecar);
* ``shmq``: ``df.write.format("shmq")`` into a spool (on_full="block"), the
  sidecar reads it with a named reader (``get_many``);
* ``shmq+stamp``: the same with the default stamps (a ``"_shmq"`` field per row);
* ``unix socket``: a Python data source sends the same frames, length-prefixed,
  in chunks of 1000 over a Unix stream socket to the sidecar (one thread per task);
* ``mp.connection``: the same chunks through ``multiprocessing.connection``
  (``Client.send_bytes`` / ``Listener``), the transport under multiprocessing's
  queues that unrelated processes can use (a ``multiprocessing.Queue``
  itself cannot be handed to Spark's Python workers: they are not our children);
* ``shmq arrow`` / ``unix socket arrow``: one Arrow IPC stream per Spark Arrow
  batch (``encoding=arrow``: ``Spool.put_arrow`` / ``Reader.get_arrow``), the
  sidecar sums a column of each batch.

Measured: seconds from ``save()`` until the sidecar has decoded the last
frame; repeats are interleaved and the median is reported with ratios.

    python stress/bench_spark.py --quick        # ~2-3 minutes
    python stress/bench_spark.py --rows 500000 --repeats 5 --json out.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import shutil
import socket
import statistics
import struct
import sys
import tempfile
import threading
import time

import shmq

CTX = mp.get_context("spawn")
CHUNK = 1000
FRAME_BYTES = []  # mean JSON frame size seen in the shmq runs
_LEN = struct.Struct("<I")


def frames_of_chunk(blob, out):
    """Split a length-prefixed chunk into payloads (appended to ``out``)."""
    off, n = 0, len(blob)
    while off < n:
        (k,) = _LEN.unpack_from(blob, off)
        out.append(blob[off + 4:off + 4 + k])
        off += 4 + k


# --- sidecars (spawned processes) ------------------------------------------------------


def sidecar_shmq(path, n, ready, done):
    sp = shmq.Spool.open(path)
    r = sp.reader("sidecar", auto_commit=False)
    ready.set()
    got = 0
    loads = json.loads
    while got < n:
        for f in r.get_many(CHUNK, timeout=120):
            loads(f.data)
            got += 1
        r.commit()  # one commit per batch read (frees room for the blocked writers)
    done.send(time.monotonic())
    r.close()
    sp.close()


def sidecar_shmq_arrow(path, n, ready, done):
    import pyarrow.compute as pc

    sp = shmq.Spool.open(path)
    r = sp.reader("sidecar")
    ready.set()
    got = 0
    while got < n:
        t = r.get_arrow(timeout=120)  # one frame = one Spark Arrow batch
        pc.sum(t.column("amount"))
        got += t.num_rows
    done.send(time.monotonic())
    r.close()
    sp.close()


def _sum_ipc(blob):
    import pyarrow as pa
    import pyarrow.compute as pc

    t = pa.ipc.open_stream(pa.py_buffer(blob)).read_all()
    pc.sum(t.column("amount"))
    return t.num_rows


def _count_frames(recv_chunk, state, n, done):
    loads = json.loads
    while True:
        blob = recv_chunk()
        if blob is None:
            return
        if state["arrow"]:
            got = _sum_ipc(blob)
        else:
            frames = []
            frames_of_chunk(blob, frames)
            for payload in frames:
                loads(payload)
            got = len(frames)
        with state["lock"]:
            state["got"] += got
            if state["got"] >= n and not state["sent"]:
                state["sent"] = True
                done.send(time.monotonic())


def sidecar_socket(address, n, ready, done, arrow=False):
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(address)
    srv.listen(8)
    state = {"lock": threading.Lock(), "got": 0, "sent": False, "arrow": arrow}
    ready.set()

    def serve(conn):
        f = conn.makefile("rb", buffering=1 << 20)

        def recv_chunk():
            head = f.read(4)
            if len(head) < 4:
                return None
            (k,) = _LEN.unpack(head)
            return f.read(k)
        _count_frames(recv_chunk, state, n, done)
        conn.close()

    while not state["sent"]:
        srv.settimeout(0.2)
        try:
            conn, _ = srv.accept()
        except socket.timeout:
            continue
        threading.Thread(target=serve, args=(conn,), daemon=True).start()
    srv.close()


def sidecar_mpconn(address, n, ready, done):
    from multiprocessing.connection import Listener

    lst = Listener(address, family="AF_UNIX", authkey=b"bench")
    state = {"lock": threading.Lock(), "got": 0, "sent": False, "arrow": False}
    ready.set()

    def serve(conn):
        def recv_chunk():
            try:
                return conn.recv_bytes()
            except EOFError:
                return None
        _count_frames(recv_chunk, state, n, done)
        conn.close()

    lst._listener._socket.settimeout(0.2)
    while not state["sent"]:
        try:
            conn = lst.accept()
        except (socket.timeout, OSError):
            continue
        threading.Thread(target=serve, args=(conn,), daemon=True).start()
    lst.close()


# --- Spark sinks for the peers (pickled by value: this module is __main__) --------------


def make_peer_source():
    from pyspark.sql.datasource import DataSource, DataSourceArrowWriter, WriterCommitMessage

    from shmq.spark import WriterOptions as _WriterOptions, encode_list as _encode_list, record_lists as _record_lists

    class PeerWriter(DataSourceArrowWriter):
        def __init__(self, options, schema):
            self.kind = options["kind"]
            self.address = options.get("address")
            self.opts = _WriterOptions({"path": "-", "encoding": "json", "stamp": "none"}, schema)

        def write(self, iterator):
            send, close = self._connect()
            if self.kind == "socket-arrow":  # one Arrow IPC stream per Spark batch, as put_arrow
                import pyarrow as pa

                for batch in iterator:
                    sink = pa.BufferOutputStream()
                    with pa.ipc.new_stream(sink, batch.schema) as w:
                        w.write_batch(batch)
                    send(sink.getvalue().to_pybytes())
                close()
                return WriterCommitMessage()
            pack = struct.Struct("<I").pack  # (a Struct does not pickle: make it here)
            parts, count = [], 0
            for recs in _record_lists(iterator, self.opts):
                for payload in _encode_list(recs, self.opts):  # the very same JSON frames as shmq's
                    parts.append(pack(len(payload)))
                    parts.append(payload)
                    count += 1
                    if count % CHUNK == 0:
                        send(b"".join(parts))
                        parts = []
            if parts:
                send(b"".join(parts))
            close()
            return WriterCommitMessage()

        def _connect(self):
            if self.kind == "noop":
                return (lambda blob: None), (lambda: None)
            if self.kind in ("socket", "socket-arrow"):
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.connect(self.address)
                head = struct.Struct("<I").pack
                return (lambda blob: s.sendall(head(len(blob)) + blob)), s.close
            from multiprocessing.connection import Client

            c = Client(self.address, family="AF_UNIX", authkey=b"bench")
            return c.send_bytes, c.close

    class PeerSource(DataSource):
        @classmethod
        def name(cls):
            return "bench_peer"

        def writer(self, schema, overwrite):
            return PeerWriter(self.options, schema)

    return PeerSource


# --- one run --------------------------------------------------------------------------------


def rows_df(spark, n):
    return (spark.range(n, numPartitions=2)
            .selectExpr("id", "round(rand(7) * 100, 2) as amount", "cast(id % 97 as int) as user",
                        "concat('item-', cast(id % 1000 as string)) as item"))


def run_once(spark, kind, n, tmp):
    """Seconds from save() until the sidecar decoded every frame (and the save() time alone)."""
    df = rows_df(spark, n)
    if kind == "noop":
        t0 = time.monotonic()
        df.write.format("bench_peer").option("kind", "noop").mode("append").save()
        t1 = time.monotonic()
        return t1 - t0, t1 - t0
    ready, (done_r, done_w) = CTX.Event(), CTX.Pipe(duplex=False)
    stamp = "stamp" in kind
    arrow = "arrow" in kind
    if kind.startswith("shmq"):
        path = os.path.join(tmp, f"spool-{time.monotonic_ns()}")
        with shmq.Spool.create(path, capacity="64MiB", on_full="block", checksum=True) as sp:
            sp.reader("sidecar").close()  # registered before writing: block mode waits for it
        target = sidecar_shmq_arrow if arrow else sidecar_shmq
        proc = CTX.Process(target=target, args=(path, n, ready, done_w))
    else:
        path = os.path.join(tmp, f"sock-{time.monotonic_ns()}")
        if kind.startswith("unix socket"):
            proc = CTX.Process(target=sidecar_socket, args=(path, n, ready, done_w, arrow))
        else:
            proc = CTX.Process(target=sidecar_mpconn, args=(path, n, ready, done_w))
    proc.start()
    try:
        if not ready.wait(60):
            raise RuntimeError(f"{kind}: sidecar did not start")
        t0 = time.monotonic()
        if kind.startswith("shmq"):
            df.write.format("shmq").option("path", path).option("encoding", "arrow" if arrow else "json") \
                .option("stamp", "field" if stamp or arrow else "none").mode("append").save()
        else:
            peer = {"unix socket": "socket", "unix socket arrow": "socket-arrow"}.get(kind, "mpconn")
            df.write.format("bench_peer").option("kind", peer).option("address", path) \
                .mode("append").save()
        t1 = time.monotonic()
        if not done_r.poll(300):
            raise RuntimeError(f"{kind}: the sidecar did not receive every frame")
        t_end = done_r.recv()
        if kind == "shmq":
            with shmq.Spool.open(path) as sp:
                st = sp.stats()
                FRAME_BYTES.append(st.put_bytes / max(st.puts, 1))
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
        if kind.startswith("shmq"):
            shmq.Spool.destroy(path)
        elif os.path.exists(path):
            os.unlink(path)
    return max(t_end, t1) - t0, t1 - t0


def machine():
    return {"python": sys.version.split()[0], "platform": platform.platform(),
            "cpus": os.cpu_count(), "processor": platform.processor() or platform.machine()}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="100k rows, 3 repeats")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    if args.quick:
        args.rows, args.repeats = 100_000, 3
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession

    import shmq.spark

    spark = (SparkSession.builder.master("local[2]").appName("shmq-bench-spark")
             .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
             .config("spark.sql.shuffle.partitions", "2").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    shmq.spark.register(spark)
    spark.dataSource.register(make_peer_source())
    tmp = tempfile.mkdtemp(prefix="shmq-bench-spark-", dir="/dev/shm")
    kinds = ["noop", "shmq", "shmq+stamp", "unix socket", "mp.connection", "shmq arrow",
             "unix socket arrow"]
    runs = {k: [] for k in kinds}
    saves = {k: [] for k in kinds}
    try:
        for k in kinds:  # warm-up: Python workers, JIT, page cache
            run_once(spark, k, min(args.rows, 20_000), tmp)
        for _ in range(args.repeats):
            for k in kinds:  # interleaved
                total, save = run_once(spark, k, args.rows, tmp)
                runs[k].append(total)
                saves[k].append(save)
    finally:
        spark.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    n = args.rows
    size = statistics.mean(FRAME_BYTES) if FRAME_BYTES else 0
    print(f"\nSpark local[2] -> transport -> sidecar, {n} rows (JSON frames of {size:.0f} B, or "
          f"Arrow batches), median of {args.repeats} interleaved runs; {machine()}")
    med = {k: statistics.median(v) for k, v in runs.items()}
    for k in kinds:
        rate = n / med[k]
        peer = "shmq arrow" if "arrow" in k else "shmq"
        note = ("  (no sidecar: Spark + JSON encoding only)" if k == "noop" else
                "" if k == peer else f"  {peer}: {med[k] / med[peer]:4.2f}x the rate of this")
        print(f"  {k:<18} {rate / 1e3:8.1f} k rows/s  {med[k]:6.2f} s  "
              f"(save() {statistics.median(saves[k]):5.2f} s){note}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": n, "repeats": args.repeats, "machine": machine(),
                       "runs_s": runs, "save_s": saves,
                       "rows_per_s": {k: n / med[k] for k in kinds}}, f, indent=2)


if __name__ == "__main__":
    main()
