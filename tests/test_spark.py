"""The "shmq" PySpark data source: writes, streaming and batch reads, offsets, loss, hosts.

Needs pyspark (the ``test`` extra installs it) and Java 17; deselect with
``-m "not spark"``.  One ``local[2]`` SparkSession serves the whole module.
"""

import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import bound, pyspark_unsupported

if pyspark_unsupported():
    pytest.skip(pyspark_unsupported(), allow_module_level=True)
pytest.importorskip("pyspark")
pytest.importorskip("pyarrow")

import pyarrow as pa  # noqa: E402

import shmq  # noqa: E402
import shmq.spark as ss  # noqa: E402

pytestmark = [pytest.mark.spark, pytest.mark.xdist_group("spark")]

QUERY_TIMEOUT_S = 90


@pytest.fixture(scope="session")
def spark(tmp_path_factory):
    if not (shutil.which("java") or os.environ.get("JAVA_HOME")):
        pytest.skip("Spark needs Java (none on PATH, no JAVA_HOME)")
    from pyspark.sql import SparkSession

    saved = {k: os.environ.get(k) for k in ("PYSPARK_PYTHON", "SPARK_LOCAL_IP")}
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    warehouse = tmp_path_factory.mktemp("warehouse")
    session = (SparkSession.builder.master("local[2]").appName("shmq-tests")
               .config("spark.ui.enabled", "false")
               .config("spark.sql.shuffle.partitions", "2")
               .config("spark.default.parallelism", "2")
               .config("spark.sql.warehouse.dir", str(warehouse))
               .config("spark.sql.streaming.forceDeleteTempCheckpointLocation", "true")
               .getOrCreate())
    session.sparkContext.setLogLevel("ERROR")
    ss.register(session)
    yield session
    session.stop()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def frames_of(path):
    sp = shmq.Spool.open(path)
    try:
        out = []
        r = sp.reader()
        while True:
            try:
                out += r.get_many(1000, block=False)
            except shmq.Empty:
                return out
    finally:
        sp.close()


class Collector:
    """foreachBatch sink: every batch's rows, in order (runs in this driver process)."""

    def __init__(self, *cols):
        self.cols = cols or ("seq", "value")
        self.batches = []

    def __call__(self, df, batch_id):
        self.batches.append((batch_id, [tuple(r) for r in df.select(*self.cols).collect()]))

    @property
    def rows(self):
        return [row for _b, rows in self.batches for row in rows]

    def sizes(self):
        return [len(rows) for _b, rows in self.batches if rows]


def run_available_now(spark, path, checkpoint, collector, **options):
    reader = spark.readStream.format("shmq").option("path", path)
    for k, v in options.items():
        reader = reader.option(k, v)
    q = (reader.load().writeStream.foreachBatch(collector)
         .option("checkpointLocation", str(checkpoint)).trigger(availableNow=True).start())
    try:
        assert q.awaitTermination(QUERY_TIMEOUT_S), "availableNow query did not finish"
    finally:
        q.stop()
    return q


# --- batch write and read back ----------------------------------------------------------


def test_batch_write_value_and_json_read_back(spark, make_spool):
    sp = make_spool(capacity="1MiB", name="batch")
    n = 40
    df = spark.range(n).selectExpr("id", "cast(id * 1.5 as double) as score",
                                   "concat('row-', cast(id as string)) as value").repartition(2)
    # a string `value` column travels as-is: plain consumers get exactly those bytes
    df.select("value").write.format("shmq").option("path", sp.path).mode("append").save()
    assert sp.next_seq == n
    assert sorted(f.data for f in frames_of(sp.path)) == sorted(f"row-{i}".encode() for i in range(n))

    # rows as JSON, stamped in a "_shmq" field
    df.select("id", "score").write.format("shmq").option("path", sp.path) \
        .option("encoding", "json").mode("append").save()
    assert sp.next_seq == 2 * n

    back = spark.read.format("shmq").option("path", sp.path).load()
    assert back.columns == ["seq", "timestamp", "value"]
    assert sorted(r.seq for r in back.collect()) == list(range(2 * n))

    schema = ("seq long, id long, score double, "
              f"_shmq {ss.STAMP_DDL}")
    decoded = (spark.read.format("shmq").schema(schema).option("path", sp.path)
               .option("startingOffsets", str(n)).option("numPartitions", 3).load().collect())
    assert sorted((r.id, r.score) for r in decoded) == [(i, i * 1.5) for i in range(n)]
    stamps = [r._shmq for r in decoded]
    assert len({(s.w, s.b, s.p, s.i) for s in stamps}) == n  # one key per row
    assert {s.b for s in stamps} == {-1} and {s.a for s in stamps} == {0}
    assert len({s.w for s in stamps}) == 1  # one writer id per write job
    assert sum(s.last for s in stamps) == len({s.p for s in stamps})  # one "last" per task


def test_write_needs_existing_spool_or_create(spark, spool_dir):
    path = os.path.join(spool_dir, "made-by-spark")
    df = spark.range(5).selectExpr("cast(cast(id as string) as binary) as value")
    with pytest.raises(Exception, match="no shmq spool"):
        df.write.format("shmq").option("path", path).mode("append").save()
    df.write.format("shmq").option("path", path).option("create", "true") \
        .option("capacity", "64KiB").option("onFull", "block").mode("append").save()
    sp = shmq.Spool.open(path)
    try:
        assert (sp.next_seq, sp.on_full, sp.capacity) == (5, "block", 65536)
    finally:
        sp.close()


# --- streaming reads ------------------------------------------------------------------------

APPENDER = textwrap.dedent("""
    import sys, time, shmq
    sp = shmq.Spool.open(sys.argv[1])
    for k in range(5):
        sp.put_many([f"outside-{k * 10 + i}".encode() for i in range(10)])
        time.sleep(0.2)
    sp.close()
""")


def test_running_stream_picks_up_outside_appends(spark, make_spool, tmp_path):
    sp = make_spool(capacity="1MiB", name="live")
    sp.put(b"before-the-query")  # not read: the query starts at seq 1
    got = Collector()
    q = (spark.readStream.format("shmq").option("path", sp.path)
         .option("startingOffsets", '{"seq": 1}').load()
         .writeStream.foreachBatch(got).option("checkpointLocation", str(tmp_path / "ck"))
         .trigger(processingTime="200 milliseconds").start())
    try:
        deadline = time.monotonic() + QUERY_TIMEOUT_S
        while not q.recentProgress and time.monotonic() < deadline:  # first batch planned
            time.sleep(0.1)
        proc = subprocess.run([sys.executable, "-c", APPENDER, sp.path], timeout=bound(60))
        assert proc.returncode == 0
        while len(got.rows) < 50 and time.monotonic() < deadline:
            assert q.exception() is None, q.exception()
            time.sleep(0.1)
    finally:
        q.stop()
    assert sorted(got.rows) == [(1 + i, f"outside-{i}".encode()) for i in range(50)]


def test_available_now_restart_reads_each_frame_once(spark, make_spool, tmp_path):
    sp = make_spool(capacity="1MiB", name="restart")
    sp.put_many([b"a%d" % i for i in range(30)])
    ck = tmp_path / "ck"
    first = Collector()
    run_available_now(spark, sp.path, ck, first, readerName="spark", maxFramesPerTrigger=7)
    assert first.sizes() == [7, 7, 7, 7, 2]  # the read limit, honoured under availableNow
    sp.put_many([b"b%d" % i for i in range(20)])

    second = Collector()
    run_available_now(spark, sp.path, ck, second, readerName="spark", maxFramesPerTrigger=7)
    seqs = [s for s, _v in first.rows + second.rows]
    assert sorted(seqs) == list(range(50)), "each frame exactly once across the restart"
    assert [s for s, _v in second.rows] == list(range(30, 50))
    # Spark commits one batch late, but asks for new offsets once a batch is in the
    # sink: the named reader is advanced then, so a finished availableNow run leaves
    # it after the last frame processed.
    (stats,) = [r for r in sp.readers() if r.name == "spark"]
    assert stats.position == 50


def test_read_limit_offsets_without_spark(make_spool):
    """latestOffset honours ReadMaxRows / ReadMinRows / ReadAllAvailable and availableNow."""
    from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMaxRows, ReadMinRows

    sp = make_spool(capacity="1MiB", name="limits")
    sp.put_many([b"x"] * 25)
    r = ss.ShmqStreamReader({"path": sp.path, "maxFramesPerTrigger": "10",
                             "startingOffsets": "earliest"}, ss.BASE_SCHEMA)
    try:
        assert r.getDefaultReadLimit() == ReadMaxRows(10)
        start = r.initialOffset()
        assert start == {"seq": 0}
        assert r.latestOffset(start, ReadMaxRows(10)) == {"seq": 10}
        assert r.latestOffset({"seq": 20}, ReadMaxRows(10)) == {"seq": 25}
        assert r.latestOffset(start, ReadAllAvailable()) == {"seq": 25}
        assert r.latestOffset({"seq": 20}, ReadMinRows(10)) == {"seq": 20}  # wait for more
        r.prepareForTriggerAvailableNow()
        sp.put_many([b"late"] * 5)  # arrives after the availableNow target
        assert r.latestOffset({"seq": 20}, ReadAllAvailable()) == {"seq": 25}
        assert r.latestOffset({"seq": 25}, ReadAllAvailable()) == {"seq": 25}
        assert r.reportLatestOffset() == {"seq": 30}
        parts = r.partitions({"seq": 0}, {"seq": 25})
        assert [(p.start, p.end) for p in parts] == [(0, 25)]
    finally:
        r.stop()
    r4 = ss.ShmqStreamReader({"path": sp.path, "numPartitions": "4"}, ss.BASE_SCHEMA)
    try:
        parts = r4.partitions({"seq": 3}, {"seq": 30})
        assert [(p.start, p.end) for p in parts] == [(3, 9), (9, 16), (16, 23), (23, 30)]
        rows = [row for p in parts for b in r4.read(p) for row in b.to_pylist()]
        assert [row["seq"] for row in rows] == list(range(3, 30))
    finally:
        r4.stop()


def test_data_loss_fails_or_is_skipped_and_counted(spark, make_spool, tmp_path):
    sp = make_spool(capacity=4096, name="lossy")  # holds ~60 small frames
    sp.put_many([b"early-%03d" % i for i in range(10)])
    ck = tmp_path / "ck"
    first = Collector()
    run_available_now(spark, sp.path, ck, first, readerName="lossy-reader")
    assert [s for s, _v in first.rows] == list(range(10))

    for i in range(300):  # the ring wraps several times: frames 10.. are overwritten
        sp.put(b"late-%03d" % i)
    oldest = sp.first_seq
    assert oldest > 10

    failed = Collector()
    with pytest.raises(Exception) as info:
        run_available_now(spark, sp.path, ck, failed, readerName="lossy-reader")
    assert "were overwritten before" in str(info.value) and "failOnDataLoss" in str(info.value)
    assert failed.rows == []

    skipped = Collector()
    run_available_now(spark, sp.path, ck, skipped, readerName="lossy-reader",
                      failOnDataLoss="false")
    assert [s for s, _v in skipped.rows] == list(range(oldest, 310))
    (stats,) = [r for r in sp.readers() if r.name == "lossy-reader"]
    assert stats.lost == oldest - 10  # counted exactly, durably, in the named reader


def test_stream_write_stamps_batches(spark, make_spool, tmp_path):
    src = make_spool(capacity="1MiB", name="src")
    dst = make_spool(capacity="1MiB", name="dst")
    src.put_many([b"v%d" % i for i in range(12)])
    q = (spark.readStream.format("shmq").option("path", src.path)
         .option("startingOffsets", "earliest").option("maxFramesPerTrigger", 5).load()
         .selectExpr("seq", "value").writeStream.format("shmq").option("path", dst.path)
         .option("stamp", "prefix").option("checkpointLocation", str(tmp_path / "ck"))
         .trigger(availableNow=True).start())
    try:
        assert q.awaitTermination(QUERY_TIMEOUT_S)
    finally:
        q.stop()
    frames = frames_of(dst.path)
    assert len(frames) == 12
    stamps, payloads = zip(*(ss.split_stamp(f.data) for f in frames))
    assert sorted(bytes(p) for p in payloads) == sorted(b"v%d" % i for i in range(12))
    assert {s.writer for s in stamps} == {q.id.replace("-", "")[:16]}  # stable query id
    assert sorted({s.batch for s in stamps}) == [0, 1, 2]  # 5 + 5 + 2 frames
    dedup = ss.Deduper()
    assert not any(dedup.seen(s) for s in stamps)
    assert all(dedup.seen(s) for s in stamps)  # a retry's copies are recognised


# --- without a running query --------------------------------------------------------------


def test_read_task_on_another_host_fails_clearly(make_spool):
    sp = make_spool(capacity="64KiB", name="hosts")
    sp.put_many([b"a", b"b"])
    reader = ss.ShmqStreamReader({"path": sp.path}, ss.BASE_SCHEMA)
    (part,) = reader.partitions({"seq": 0}, {"seq": 2})
    assert part.host == socket.gethostname()
    assert [row["value"] for b in reader.read(part) for row in b.to_pylist()] == [b"a", b"b"]
    part.host = "some-other-executor"
    with pytest.raises(ss.WrongHost, match="host-local") as info:
        list(reader.read(part))
    assert "some-other-executor" in str(info.value)
    reader.stop()


def test_task_writer_commit_message_and_encodings(make_spool):
    from pyspark.sql import types as T

    sp = make_spool(capacity="64KiB", name="enc")
    schema = T.StructType([T.StructField("id", T.LongType()), T.StructField("value", T.BinaryType())])
    batch = pa.record_batch([pa.array([1, 2, 3]), pa.array([b"a", b"bb", None])], names=["id", "value"])

    w = ss.ShmqWriter({"path": sp.path}, schema)  # encoding auto -> value, stamp auto -> none
    msg = w.write(iter([batch]))
    assert (msg.first_seq, msg.next_seq, msg.count, msg.bytes) == (0, 3, 3, 3)
    assert msg.host == socket.gethostname() and msg.writer == w.writer_id
    assert [f.data for f in frames_of(sp.path)] == [b"a", b"bb", b""]

    w = ss.ShmqWriter({"path": sp.path, "encoding": "pickle", "batchFrames": "2"}, schema)
    msg = w.write(iter([batch]))
    assert (msg.first_seq, msg.next_seq, msg.count) == (3, 6, 3)
    import pickle

    rows = [pickle.loads(f.data) for f in frames_of(sp.path)[3:]]
    assert [ss.pop_stamp(r).row for r in rows] == [0, 1, 2]
    assert rows == [{"id": 1, "value": b"a"}, {"id": 2, "value": b"bb"}, {"id": 3, "value": None}]

    with pytest.raises(ValueError, match="stamp=field needs encoding json, pickle or arrow"):
        ss.ShmqWriter({"path": sp.path, "stamp": "field"}, schema)
    with pytest.raises(ValueError, match="append-only"):
        ss.ShmqDataSource({"path": sp.path}).writer(schema, overwrite=True)


def test_prefix_stamp_round_trip():
    st = ss.Stamp("00112233445566ff", 7, 3, 2, 41, last=True)
    stamp, payload = ss.split_stamp(st.pack() + b"payload")
    assert stamp == st and bytes(payload) == b"payload"
    assert ss.split_stamp(b"plain") == (None, b"plain")
    assert ss.Stamp.from_json(st.to_json()) == st


def test_arrow_encoding_one_frame_per_batch(make_spool):
    from pyspark.sql import types as T

    sp = make_spool(capacity="1MiB", name="arrow")
    schema = T.StructType([T.StructField("id", T.LongType()), T.StructField("x", T.DoubleType())])
    batches = [pa.record_batch([pa.array(range(k, k + 500)), pa.array([0.5] * 500)], names=["id", "x"])
               for k in (0, 500)]
    w = ss.ShmqWriter({"path": sp.path, "encoding": "arrow"}, schema)
    msg = w.write(iter(batches))
    assert (msg.count, msg.rows, msg.first_seq, msg.next_seq) == (2, 1000, 0, 2)
    r = sp.reader()
    tables = [r.get_arrow(block=False) for _ in range(2)]
    assert sum(t.num_rows for t in tables) == 1000
    assert [t.column("id")[0].as_py() for t in tables] == [0, 500]
    stamps = [ss.arrow_stamp(t) for t in tables]
    assert [(s.row, s.rows, s.last) for s in stamps] == [(0, 500, False), (500, 500, True)]
    with pytest.raises(ValueError, match="break Arrow IPC"):
        ss.ShmqWriter({"path": sp.path, "encoding": "arrow", "stamp": "prefix"}, schema)


@pytest.mark.parametrize("fail", [True, False])
def test_frames_overwritten_after_planning(make_spool, fail):
    """A task finds its frames overwritten between planning and reading."""
    sp = make_spool(capacity=4096, name="race")
    sp.put_many([b"old-%03d" % i for i in range(20)])
    reader = ss.ShmqStreamReader({"path": sp.path, "failOnDataLoss": str(fail).lower()}, ss.BASE_SCHEMA)
    try:
        (part,) = reader.partitions({"seq": 0}, {"seq": 20})
        for i in range(200):
            sp.put(b"new-%03d" % i)  # the ring wraps over frames 0..19
        if fail:
            with pytest.raises(ss.DataLoss, match="were overwritten before a Spark task read them"):
                list(reader.read(part))
        else:
            assert list(reader.read(part)) == []  # skipped (and logged), not an error
    finally:
        reader.stop()


def _sidecar_handler(batch):
    import pyarrow.compute as pc

    return pa.record_batch({"id": batch.column("id"),
                            "score": pc.multiply(batch.column("x"), 2.0)})


def _sidecar_serve(path):
    shmq.Service(path).serve(_sidecar_handler, workers=2)


def test_call_sidecar_answers_every_row_once(spark, spool_dir):
    import multiprocessing as mp

    path = os.path.join(spool_dir, "scorer")
    shmq.Service(path).close()
    # spawn, not fork: this process runs the SparkSession's py4j threads
    proc = mp.get_context("spawn").Process(target=_sidecar_serve, args=(path,))
    proc.start()
    try:
        df = spark.range(0, 20_000, numPartitions=4).selectExpr("id", "id * 0.5 as x")
        out = ss.call_sidecar(df, path, "id long, score double", batch_rows=3000)
        rows = out.collect()
        assert len(rows) == 20_000
        assert sorted(r.id for r in rows) == list(range(20_000))
        assert all(r.score == r.id for r in rows)  # x * 2 == id
        with pytest.raises(ValueError):
            ss.call_sidecar(df, path, "id long", batch_rows=0)
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        proc.join(QUERY_TIMEOUT_S)
        shmq.Service.destroy(path)
