"""Spark -> spool -> sidecar -> spool -> Structured Streaming, on one machine.

A Spark job (``local[2]``) writes request rows into the "requests" spool
with the "shmq" data source; a co-located sidecar (plain Python, no Spark)
scores them and appends results to the "results" spool; a Structured
Streaming query reads the results back.  This is the per-host loop of a
cluster deployment (see docs/spark.md), bounded in time; both spools live
in a temporary directory under /dev/shm that is removed at the end.

Run: python examples/spark_pipeline.py [--columnar]   (needs pyspark, pyarrow and Java)

``--columnar`` is the fast variant: Spark writes each Arrow batch of a task
as one frame (``encoding=arrow``), and the sidecar reads it zero-copy
(``get_arrow(copy=False)``) and scores the whole batch with pyarrow.compute.
"""

import json
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time

import shmq

ROWS = 3000
DEADLINE_S = 150


def sidecar(requests_path, results_path, expected, idle_s=30.0):
    """The scorer: consume requests (named reader), append one result per unique request.

    Plain Python: shmq.dedupe needs no pyspark, so the sidecar's host needs none.
    """
    from shmq.dedupe import Deduper, pop_stamp

    requests = shmq.Spool.open(requests_path)
    results = shmq.Spool.open(results_path)
    inbox = requests.reader("scorer")  # durable: a restarted sidecar resumes here
    dedup = Deduper()  # drops rows a retried Spark task wrote twice
    done = 0
    t0 = None
    while done < expected:
        try:
            # Spark takes a while to start: wait longer for the first request.
            frames = inbox.get_many(500, timeout=idle_s if t0 else DEADLINE_S)
        except shmq.Empty:
            break
        t0 = t0 or time.monotonic()
        out = []
        for f in frames:
            row = json.loads(f.data)
            if dedup.seen(pop_stamp(row)):
                continue
            score = round(row["amount"] * (1.0 + (row["user"] % 7) / 10.0), 3)
            out.append(json.dumps({"id": row["id"], "score": score,
                                   "sidecar_pid": os.getpid()}).encode())
        if out:
            results.put_many(out)  # one atomic batch per batch read
            done += len(out)
    busy = time.monotonic() - t0 if t0 else 0.0
    print(f"  sidecar {os.getpid()}: scored {done} requests in {busy:.2f} s since the first one "
          f"arrived, dropped {dedup.duplicates} duplicates, named reader 'scorer' lost {inbox.lost} "
          f"(pyspark {'loaded' if 'pyspark' in sys.modules else 'not loaded'} in the sidecar)",
          flush=True)
    inbox.close()
    requests.close()
    results.close()


def sidecar_columnar(requests_path, results_path, expected, idle_s=30.0):
    """The scorer, columnar: one Arrow frame per Spark batch, scored vectorized."""
    import pyarrow.compute as pc

    from shmq.dedupe import Deduper, arrow_stamp  # pyarrow for the batches, no pyspark

    requests = shmq.Spool.open(requests_path)
    results = shmq.Spool.open(results_path)
    inbox = requests.reader("scorer")
    dedup = Deduper()
    done = 0
    t0 = None
    while done < expected:
        try:
            view = inbox.get_arrow(copy=False, timeout=idle_s if t0 else DEADLINE_S)
        except shmq.Empty:
            break
        t0 = t0 or time.monotonic()
        with view:  # zero-copy over the spool; the frame is pinned until the block ends
            batch = view.batch
            if dedup.seen(arrow_stamp(batch)):  # a retried task's duplicate batch
                continue
            factor = pc.add(pc.divide(pc.cast(pc.remainder(batch["user"], 7), "double"), 10.0), 1.0)
            scores = pc.round(pc.multiply(batch["amount"], factor), 3)
            ids = batch["id"].to_pylist()
            out = [json.dumps({"id": i, "score": s, "sidecar_pid": os.getpid()}).encode()
                   for i, s in zip(ids, scores.to_pylist())]
        results.put_many(out)
        done += len(out)
    busy = time.monotonic() - t0 if t0 else 0.0
    print(f"  sidecar {os.getpid()} (columnar): scored {done} requests in {busy:.2f} s since the "
          f"first batch arrived, dropped {dedup.duplicates} duplicate batches", flush=True)
    inbox.close()
    requests.close()
    results.close()


def main(columnar=False):
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    tmp = tempfile.mkdtemp(prefix="shmq-spark-example-", dir="/dev/shm")
    req_path, res_path = os.path.join(tmp, "requests"), os.path.join(tmp, "results")
    # block: Spark's writers wait for the sidecar instead of overwriting unscored rows,
    # and the sidecar waits for the streaming query.  Register both named readers
    # before anything is written, so nothing is missed or overwritten.
    shmq.Spool.create(req_path, capacity="4MiB", on_full="block").reader("scorer").close()
    shmq.Spool.create(res_path, capacity="4MiB", on_full="block").reader("spark-results").close()
    side = mp.get_context("spawn").Process(target=sidecar_columnar if columnar else sidecar,
                                           args=(req_path, res_path, ROWS))
    side.start()
    spark = q = None
    ok = False
    try:
        from pyspark.sql import SparkSession

        from shmq.spark import register

        t0 = time.monotonic()
        spark = (SparkSession.builder.master("local[2]").appName("shmq-spark-pipeline")
                 .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
                 .config("spark.sql.shuffle.partitions", "2").getOrCreate())
        spark.sparkContext.setLogLevel("ERROR")
        register(spark)  # the "shmq" data source
        print(f"Spark local[2] up in {time.monotonic() - t0:.1f} s; spools in {tmp}")

        # 1. The streaming query that reads results back (JSON frames -> typed columns).
        results = (spark.readStream.format("shmq").option("path", res_path)
                   .option("readerName", "spark-results")  # starts at its committed position
                   .schema("seq long, timestamp timestamp, id long, score double, sidecar_pid int")
                   .load())
        q = (results.writeStream.format("memory").queryName("scores")
             .option("checkpointLocation", os.path.join(tmp, "checkpoint"))
             .trigger(processingTime="500 milliseconds").start())

        # 2. The Spark job: each task appends its partition to this host's "requests" spool.
        t1 = time.monotonic()
        requests = (spark.range(ROWS, numPartitions=2)
                    .selectExpr("id", "round(rand(7) * 100, 2) as amount", "cast(id % 97 as int) as user"))
        encoding = "arrow" if columnar else "json"
        requests.write.format("shmq").option("path", req_path).option("encoding", encoding) \
            .mode("append").save()
        t2 = time.monotonic()
        print(f"Spark job wrote {ROWS} rows as {encoding} frames in {t2 - t1:.2f} s (2 tasks; the "
              "first job of a session also starts Spark's Python workers)")

        # 3. Wait for the whole loop to come back through the streaming query.
        got = 0
        while time.monotonic() - t1 < DEADLINE_S:
            if q.exception() is not None:
                raise RuntimeError(f"streaming query failed: {q.exception()}")
            got = spark.sql("select count(*) from scores").first()[0]
            if got >= ROWS:
                break
            time.sleep(0.25)
        t3 = time.monotonic()
        print(f"streaming query had all {got} results {t3 - t2:.2f} s after the job finished "
              "(micro-batches every 0.5 s)")
        stats = spark.sql("select count(distinct id) n, min(seq) first, max(seq) last, "
                          "round(avg(score), 2) avg_score from scores").first()
        print(f"  {stats.n} distinct ids, result seqs {stats.first}..{stats.last}, "
              f"average score {stats.avg_score}")
        for r in spark.sql("select id, score from scores order by score desc limit 3").collect():
            print(f"  top: id {r.id} score {r.score}")
        ok = got == ROWS and stats.n == ROWS
    finally:
        if q is not None:
            q.stop()
        if spark is not None:
            spark.stop()
        side.join(60)
        if side.is_alive():
            side.kill()
            side.join(5)
        for path in (req_path, res_path):
            try:
                with shmq.Spool.open(path) as sp:
                    readers = ", ".join(f"'{r.name}' at {r.position} (lag {r.lag})" for r in sp.readers())
                    print(f"  {os.path.basename(path)} spool: {sp.next_seq} frames; named readers {readers}")
            finally:
                shmq.Spool.destroy(path)
        shutil.rmtree(tmp, ignore_errors=True)
    print("spools destroyed; " + ("every request came back exactly once" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(columnar="--columnar" in sys.argv[1:]))
