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

The sidecar part (``--part sidecar``) scores ``--sidecar-rows``
rows (1M) with examples/spark_sidecar.py's numpy model and scorer on
``local[2]``, four ways, each in a fresh SparkSession (so no Python worker
keeps another contender's model) after a 20k-row warm-up in it:

* ``call_sidecar, 2 sidecar workers`` / ``1 sidecar worker``: the model is
  loaded in a sidecar ``shmq.Service`` (2 or 1 worker processes), Spark's
  Python workers send it each Arrow batch (``shmq.spark.call_sidecar``);
* ``mapInArrow, model per worker``: the example's ``score`` runs in Spark's
  Python workers, each loading the model once (module-level cache);
* ``predict_batch_udf, model per worker``: ``pyspark.ml.functions`` with the
  same formula, the model loaded once per Python worker (its own cache).

Every run's row count and score sum are checked against numpy.  Reported:
rows/s (median of ``--repeats`` interleaved runs), and memory: the peak of
the summed PSS (and RSS) of Spark's Python workers (``pyspark.daemon`` and
the workers it forks) and of the sidecar's processes, sampled with psutil
every 0.5 s during the timed job (the JVM is the same in every run and is
left out).  ``--model-mb 256`` adds 256 MiB of resident parameters to the
model (not read by the scorer: a stand-in for a real model's weights).

    python stress/bench_spark.py --quick        # ~4-5 minutes
    python stress/bench_spark.py --rows 500000 --repeats 5 --json out.json
    python stress/bench_spark.py --part sidecar --model-mb 0 256
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import shutil
import signal
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


# --- the sidecar comparison: call_sidecar against the model in every worker ---------------
#
# The model and its scorer are examples/spark_sidecar.py's, imported as the module
# ``spark_sidecar`` (the examples directory is put on PYTHONPATH before Spark starts,
# so Spark's Python workers import it by reference, as a deployed package: its model
# cache ``_model`` then lives once per Python worker process, like predict_batch_udf's).

EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "examples")
SIDECAR_KINDS = ("call_sidecar, 2 sidecar workers", "call_sidecar, 1 sidecar worker",
                 "mapInArrow, model per worker", "predict_batch_udf, model per worker")
FEATURES = 4


def _model(model_mb):
    """The example's model in this process (loaded once), plus ``model_mb`` MiB of resident
    parameters that the scorer does not read (a stand-in for a real model's weights)."""
    import numpy as np
    import spark_sidecar as ex

    m = ex.load_model()
    if model_mb and "ballast" not in m:
        m["ballast"] = np.full(model_mb << 17, 0.5)  # written: resident, not lazily mapped
    return m


def _sidecar_handler(model_mb):
    import spark_sidecar as ex

    def handle(batch):
        _model(model_mb)
        return ex.score(batch)  # the example's handler
    return handle


def sidecar_service(path, workers, model_mb, ready):
    svc = shmq.Service(path)
    ready.set()
    svc.serve(_sidecar_handler(model_mb), workers=workers)  # until SIGTERM


def _features_df(spark, n):
    return spark.range(0, n, numPartitions=4).selectExpr(
        "id", *[f"cast(id % {7 + i} as double) as f{i}" for i in range(FEATURES)])


def _scored(spark, kind, n, path, model_mb):
    """The scored DataFrame (``id``, ``score``) of ``kind`` over ``n`` rows."""
    df = _features_df(spark, n)
    if kind.startswith("call_sidecar"):
        import shmq.spark

        return shmq.spark.call_sidecar(df, path, "id long, score double, sidecar_pid long")
    if kind.startswith("mapInArrow"):
        def in_worker(batches):
            import spark_sidecar as ex

            for b in batches:
                _model(model_mb)
                yield ex.score(b)
        return df.mapInArrow(in_worker, "id long, score double, sidecar_pid long")
    from pyspark.ml.functions import predict_batch_udf

    def make_predict_fn():  # called once per Python worker (predict_batch_udf caches it)
        import numpy as np

        m = _model(model_mb)
        w, b = m["weights"], m["bias"]

        def predict(f0, f1, f2, f3):  # the example's score() (one argument per column)
            return np.column_stack([f0, f1, f2, f3]) @ w + b
        return predict
    from pyspark.sql.types import DoubleType

    udf = predict_batch_udf(make_predict_fn, return_type=DoubleType(), batch_size=10_000)
    return df.select("id", udf(*[f"f{i}" for i in range(FEATURES)]).alias("score"))


class MemorySampler:
    """Peak of the summed RSS and PSS (psutil ``memory_full_info``) of the processes in
    each group (RSS only for the JVM), sampled every ``interval`` s in a thread: ``spark_python`` (descendants of
    this process whose command line runs ``pyspark.daemon`` or ``pyspark.worker``),
    ``sidecar`` (the sidecar process and its children) and ``jvm`` (the ``java`` child)."""

    def __init__(self, sidecar_pid=None, interval=0.5):
        import psutil

        self._psutil, self.sidecar_pid, self.interval = psutil, sidecar_pid, interval
        self.peak = {}  # group -> {"rss": bytes, "pss": bytes, "procs": n}
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _groups(self):
        ps = self._psutil
        side = set()
        if self.sidecar_pid:
            try:
                p = ps.Process(self.sidecar_pid)
                side = {p.pid} | {c.pid for c in p.children(recursive=True)}
            except ps.Error:
                pass
        out = {"spark_python": [], "sidecar": [], "jvm": []}
        for c in ps.Process().children(recursive=True):
            try:
                if c.pid in side:
                    out["sidecar"].append(c)
                elif c.name() == "java":
                    out["jvm"].append(c)
                elif any("pyspark.daemon" in a or "pyspark.worker" in a or "pyspark/daemon" in a
                         for a in c.cmdline()):
                    out["spark_python"].append(c)
            except ps.Error:
                continue
        return out

    def sample(self):
        ps = self._psutil
        for g, procs in self._groups().items():
            rss = pss = 0
            for p in procs:
                try:  # the JVM's PSS would mean reading its huge smaps: RSS only
                    mi = p.memory_info() if g == "jvm" else p.memory_full_info()
                except ps.Error:
                    continue
                rss += mi.rss
                pss += getattr(mi, "pss", mi.rss)
            cur = self.peak.setdefault(g, {"rss": 0, "pss": 0, "procs": 0})
            cur["rss"] = max(cur["rss"], rss)
            cur["pss"] = max(cur["pss"], pss)
            cur["procs"] = max(cur["procs"], len(procs))

    def _run(self):
        while not self._stop.wait(self.interval):
            self.sample()

    def __enter__(self):
        self.sample()
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.sample()


def sidecar_run(kind, n, model_mb, tmp):
    """One fresh SparkSession (so no Python worker keeps another contender's model), a
    20k-row warm-up of ``kind`` (starts the Python workers and loads the model), then
    the timed job over ``n`` rows.  Returns ``{"s", "count", "score_sum", "mem"}``."""
    from pyspark.sql import SparkSession, functions as F

    side = ready = None
    path = os.path.join(tmp, f"scorer-{time.monotonic_ns()}")
    if kind.startswith("call_sidecar"):
        workers = 1 if "1 sidecar worker" in kind else 2
        shmq.Service(path).close()
        ready = CTX.Event()
        side = CTX.Process(target=sidecar_service, args=(path, workers, model_mb, ready))
        side.start()
        if not ready.wait(60):
            raise RuntimeError("the sidecar did not start")
    spark = (SparkSession.builder.master("local[2]").appName("shmq-bench-sidecar")
             .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
             .getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    try:
        _scored(spark, kind, 20_000, path, model_mb).agg(F.count("*")).collect()  # warm-up
        with MemorySampler(side.pid if side else None) as mem:
            t0 = time.monotonic()
            row = _scored(spark, kind, n, path, model_mb).agg(
                F.count("*").alias("n"), F.sum("score").alias("s")).collect()[0]
            dt = time.monotonic() - t0
    finally:
        spark.stop()
        if side is not None:
            os.kill(side.pid, signal.SIGTERM)
            side.join(60)
            shmq.Service.destroy(path)
    return {"s": dt, "count": row["n"], "score_sum": row["s"], "mem": mem.peak}


def expected_score_sum(n):
    """The exact sum of the example's scores over ids 0..n-1 (numpy, in this process)."""
    import numpy as np

    ids = np.arange(n)
    w = np.array([0.5, -1.0, 2.0, 0.25])
    x = np.column_stack([(ids % (7 + i)).astype(float) for i in range(FEATURES)])
    return float((x @ w + 1.0).sum())


def sidecar_part(n, repeats, model_mbs, tmp, only=None):
    """Rows/s (median of ``repeats`` interleaved runs) and peak memory of each kind
    (those whose name starts with one of ``only``, if given)."""
    import importlib.util

    results = {}
    want = expected_score_sum(n)
    kinds = [k for k in SIDECAR_KINDS if not only or any(k.startswith(o) for o in only)]
    if importlib.util.find_spec("pyspark.ml") is None and SIDECAR_KINDS[3] in kinds:
        kinds.remove("predict_batch_udf, model per worker")
    for mb in model_mbs:
        runs = {k: [] for k in kinds}
        for _ in range(repeats):
            for k in kinds:
                r = sidecar_run(k, n, mb, tmp)
                if r["count"] != n or abs(r["score_sum"] - want) > 1e-6 * abs(want):
                    raise RuntimeError(f"{k}: {r['count']} rows, score sum {r['score_sum']}; "
                                       f"expected {n} rows, sum {want}")
                runs[k].append(r)
                print(f"    [{mb} MiB model] {k}: {r['s']:.2f} s", flush=True)
        results[mb] = runs
    return results


def print_sidecar(results, n, repeats):
    mib = 1 / 2**20
    for mb, runs in results.items():
        model = "the example's model (4 weights)" + (f" + {mb} MiB resident parameters" if mb else "")
        print(f"\nScoring {n} rows on local[2], {model}; median of {repeats} runs (fresh "
              "SparkSession each); memory: peak summed PSS (RSS) of Spark's Python workers and "
              "of the sidecar's processes, psutil every 0.5 s")
        ref = runs.get(SIDECAR_KINDS[2]) or next(iter(runs.values()))
        base = statistics.median(r["s"] for r in ref)
        for k, rs in runs.items():
            med = statistics.median(r["s"] for r in rs)
            mem = rs[-1]["mem"]  # memory of the last run (the runs agree to a few MiB)
            py, side = mem.get("spark_python", {}), mem.get("sidecar", {})
            jvm = mem.get("jvm", {}).get("rss", 0)
            total = py.get("pss", 0) + side.get("pss", 0)
            print(f"  {k:<38} {n / med / 1e3:7.1f} k rows/s  {med:6.2f} s  "
                  f"({base / med:4.2f}x mapInArrow)  Python workers {py.get('pss', 0) * mib:6.0f} "
                  f"MiB PSS ({py.get('rss', 0) * mib:.0f} RSS, {py.get('procs', 0)} procs) + "
                  f"sidecar {side.get('pss', 0) * mib:5.0f} MiB PSS ({side.get('rss', 0) * mib:.0f} "
                  f"RSS, {side.get('procs', 0)} procs) = {total * mib:6.0f} MiB  "
                  f"[JVM {jvm * mib:.0f} MiB RSS, not counted]")


def machine():
    return {"python": sys.version.split()[0], "platform": platform.platform(),
            "cpus": os.cpu_count(), "processor": platform.processor() or platform.machine()}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=("all", "transport", "sidecar"), default="all",
                    help="transport: the hand-over table; sidecar: call_sidecar against the "
                    "model in every Python worker (default: both)")
    ap.add_argument("--rows", type=int, default=200_000, help="rows of the transport runs")
    ap.add_argument("--sidecar-rows", type=int, default=1_000_000, help="rows of the sidecar runs")
    ap.add_argument("--model-mb", type=int, nargs="+", default=[0], metavar="MIB",
                    help="sidecar runs: resident model parameters (MiB) besides the example's "
                    "4 weights, one pass per value (default 0: the example's model as it is)")
    ap.add_argument("--sidecar-kinds", nargs="+", metavar="PREFIX",
                    help="sidecar runs: only the kinds starting with these (e.g. call_sidecar "
                    "mapInArrow predict_batch_udf)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true",
                    help="transport: 100k rows, 3 repeats; sidecar: 100k rows, 1 run")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    side_repeats = args.repeats
    if args.quick:
        args.rows, args.repeats = 100_000, 3
        args.sidecar_rows, side_repeats = 100_000, 1
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    # Spark's Python workers (and the spawned sidecar) import the example's model module
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (os.path.abspath(EXAMPLES), os.environ.get("PYTHONPATH")) if p)
    sys.path.insert(0, os.path.abspath(EXAMPLES))
    tmp = tempfile.mkdtemp(prefix="shmq-bench-spark-", dir="/dev/shm")
    out = {"machine": machine()}
    try:
        if args.part in ("all", "transport"):
            out["transport"] = transport_part(args.rows, args.repeats, tmp)
        if args.part in ("all", "sidecar"):
            res = sidecar_part(args.sidecar_rows, side_repeats, args.model_mb, tmp,
                               args.sidecar_kinds)
            print_sidecar(res, args.sidecar_rows, side_repeats)
            out["sidecar"] = {"rows": args.sidecar_rows, "repeats": side_repeats,
                              "by_model_mb": res}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


def transport_part(n, repeats, tmp):
    """The hand-over table: every kind on one SparkSession, interleaved repeats."""
    from pyspark.sql import SparkSession

    import shmq.spark

    spark = (SparkSession.builder.master("local[2]").appName("shmq-bench-spark")
             .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
             .config("spark.sql.shuffle.partitions", "2").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    shmq.spark.register(spark)
    spark.dataSource.register(make_peer_source())
    kinds = ["noop", "shmq", "shmq+stamp", "unix socket", "mp.connection", "shmq arrow",
             "unix socket arrow"]
    runs = {k: [] for k in kinds}
    saves = {k: [] for k in kinds}
    try:
        for k in kinds:  # warm-up: Python workers, JIT, page cache
            run_once(spark, k, min(n, 20_000), tmp)
        for _ in range(repeats):
            for k in kinds:  # interleaved
                total, save = run_once(spark, k, n, tmp)
                runs[k].append(total)
                saves[k].append(save)
    finally:
        spark.stop()
    size = statistics.mean(FRAME_BYTES) if FRAME_BYTES else 0
    print(f"\nSpark local[2] -> transport -> sidecar, {n} rows (JSON frames of {size:.0f} B, or "
          f"Arrow batches), median of {repeats} interleaved runs; {machine()}")
    med = {k: statistics.median(v) for k, v in runs.items()}
    for k in kinds:
        rate = n / med[k]
        peer = "shmq arrow" if "arrow" in k else "shmq"
        note = ("  (no sidecar: Spark + JSON encoding only)" if k == "noop" else
                "" if k == peer else f"  {peer}: {med[k] / med[peer]:4.2f}x the rate of this")
        print(f"  {k:<18} {rate / 1e3:8.1f} k rows/s  {med[k]:6.2f} s  "
              f"(save() {statistics.median(saves[k]):5.2f} s){note}", flush=True)
    return {"rows": n, "repeats": repeats, "runs_s": runs, "save_s": saves,
            "rows_per_s": {k: n / med[k] for k in kinds}}

if __name__ == "__main__":
    main()
