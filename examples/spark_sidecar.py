"""A Spark job calling a model loaded once on the host, in a sidecar service.

The sidecar is a plain Python process (no Spark): ``shmq.Service("...")``
with 2 worker processes, each loading a numpy "model" (a weight vector)
once.  The Spark job (``local[2]``) hands each Arrow batch of its rows to
the sidecar with ``shmq.spark.call_sidecar`` and gets the scores back in
the same job: the model is never loaded in Spark's Python workers.  The
service lives in a temporary directory under /dev/shm, removed at the end.

Run: python examples/spark_sidecar.py   (needs pyspark, pyarrow, pandas and Java)
"""

import multiprocessing as mp
import os
import shutil
import signal
import sys
import tempfile

import numpy as np

import shmq

ROWS = 20_000
FEATURES = 4
_model = None


def load_model():
    """The expensive part, done once per sidecar worker process."""
    global _model
    if _model is None:
        _model = {"weights": np.array([0.5, -1.0, 2.0, 0.25]), "bias": 1.0, "pid": os.getpid()}
    return _model


def score(batch):
    """The handler: an Arrow batch of features in, an Arrow batch of scores out."""
    import pyarrow as pa

    m = load_model()
    x = np.column_stack([batch.column(f"f{i}").to_numpy() for i in range(FEATURES)])
    y = x @ m["weights"] + m["bias"]
    return pa.record_batch({"id": batch.column("id"), "score": y,
                            "sidecar_pid": np.full(len(y), m["pid"], dtype=np.int64)})


def sidecar(path):
    shmq.Service(path).serve(score, workers=2)  # until SIGTERM


def main():
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession

    import shmq.spark

    d = tempfile.mkdtemp(prefix="shmq-sidecar-", dir="/dev/shm")
    path = os.path.join(d, "scorer")
    shmq.Service(path).close()  # create the service's request queue
    side = mp.get_context("fork").Process(target=sidecar, args=(path,))
    side.start()
    spark = (SparkSession.builder.master("local[2]").appName("shmq-sidecar")
             .config("spark.ui.enabled", "false").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    try:
        df = spark.range(0, ROWS, numPartitions=4).selectExpr(
            "id", *[f"cast(id % {7 + i} as double) as f{i}" for i in range(FEATURES)])
        scored = shmq.spark.call_sidecar(df, path, "id long, score double, sidecar_pid long",
                                         batch_rows=2000)
        rows = scored.collect()
        ids = sorted(r.id for r in rows)
        assert ids == list(range(ROWS)), "every row answered exactly once"
        w = np.array([0.5, -1.0, 2.0, 0.25])
        for r in rows[:100]:
            expect = sum(w[i] * (r.id % (7 + i)) for i in range(FEATURES)) + 1.0
            assert abs(r.score - expect) < 1e-9
        pids = sorted({r.sidecar_pid for r in rows})
        print(f"{len(rows)} rows scored by the sidecar's workers {pids} "
              f"(model loaded {len(pids)} times on this host, never in Spark's workers)")
        print("first rows:", [(r.id, round(r.score, 3)) for r in sorted(rows)[:3]])
    finally:
        spark.stop()
        os.kill(side.pid, signal.SIGTERM)
        side.join(60)
        shmq.Service.destroy(path)
        shutil.rmtree(d, ignore_errors=True)
        print("sidecar stopped, service removed")


if __name__ == "__main__":
    main()
