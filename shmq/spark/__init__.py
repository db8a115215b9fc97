"""shmq as a PySpark data source named ``"shmq"`` (PySpark 4.x Python Data Source API).

Import it explicitly (``import shmq`` never does) and register it once per
session::

    import shmq.spark
    shmq.spark.register(spark)

    df.write.format("shmq").option("path", "/dev/shm/shmq/requests").mode("append").save()
    df.writeStream.format("shmq").option("path", ...).option("checkpointLocation", ...).start()
    spark.readStream.format("shmq").option("path", ...).option("readerName", "spark").load()
    spark.read.format("shmq").option("path", ...).load()

Spools are host-local.  A write task appends its partition to the spool at
``path`` *on the host it runs on* (one spool per executor host, consumed by
a sidecar there).  A read is planned on the driver from the driver host's
spool, so its tasks must run on the driver host: every input partition
carries the driver's hostname and a task elsewhere fails with
:class:`WrongHost` instead of reading another host's unrelated spool.

Writes are at-least-once: a retried task writes its rows again.  Every
frame can carry a *stamp* (writer id, batch id, partition, attempt, row
index) so consumers recognise those duplicates; see :class:`Stamp` and
docs/spark.md for the byte format.  :class:`Stamp` and :class:`Deduper`
live in :mod:`shmq.dedupe`, which needs no pyspark (re-exported here).
Streaming reads are exactly-once into Spark with a checkpoint: offsets are
spool sequence numbers ``{"seq": n}``.

The package: :mod:`.options` (option parsing, errors), :mod:`.read`
(partitions, batch and stream readers), :mod:`.write` (encoding, stamping,
write tasks), :mod:`.sidecar` (:func:`call_sidecar`: a DataFrame's batches
answered by the host's :class:`shmq.Service`); this module holds the data
source itself.
"""

from __future__ import annotations

try:
    import pyarrow  # noqa: F401
    from pyspark.sql import SparkSession
    from pyspark.sql.datasource import DataSource
    from pyspark.sql.types import StructType
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("shmq.spark needs PySpark >= 4.0 and pyarrow: pip install 'shmq[spark]'") from exc

from ..dedupe import (
    ARROW_STAMP_KEY, STAMP_BYTES, STAMP_FIELD, STAMP_LAST, STAMP_MAGIC, Deduper, Stamp,
    arrow_stamp, pop_stamp, split_stamp,
)
from .options import DataLoss, ReaderOptions, WriterOptions, WrongHost
from .read import (
    BASE_SCHEMA, READER_BUSY_WAIT_S, STAMP_DDL, ShmqBatchReader, ShmqPartition, ShmqStreamReader,
)
from .sidecar import call_sidecar
from .write import ShmqCommitMessage, ShmqStreamWriter, ShmqWriter, encode_list, record_lists

__all__ = [
    "register", "ShmqDataSource", "Stamp", "split_stamp", "pop_stamp", "arrow_stamp", "Deduper",
    "ShmqCommitMessage",
    "ShmqPartition", "WrongHost", "DataLoss", "STAMP_MAGIC", "STAMP_BYTES", "STAMP_DDL", "NAME",
    "STAMP_LAST", "STAMP_FIELD", "ARROW_STAMP_KEY", "BASE_SCHEMA", "READER_BUSY_WAIT_S",
    "ShmqBatchReader", "ShmqStreamReader", "ShmqWriter", "ShmqStreamWriter", "ReaderOptions",
    "WriterOptions", "encode_list", "record_lists", "call_sidecar",
]

NAME = "shmq"


class ShmqDataSource(DataSource):
    """The ``"shmq"`` data source; see the module docstring and docs/spark.md."""

    @classmethod
    def name(cls) -> str:
        return NAME

    def schema(self) -> StructType:
        return BASE_SCHEMA

    def reader(self, schema: StructType) -> ShmqBatchReader:
        return ShmqBatchReader(self.options, schema)

    def streamReader(self, schema: StructType) -> ShmqStreamReader:
        return ShmqStreamReader(self.options, schema)

    def writer(self, schema: StructType, overwrite: bool) -> ShmqWriter:
        if overwrite:
            raise ValueError("shmq spools are append-only: use mode('append')")
        return ShmqWriter(self.options, schema)

    def streamWriter(self, schema: StructType, overwrite: bool) -> ShmqStreamWriter:
        if overwrite:
            raise ValueError("shmq spools are append-only: use outputMode('append')")
        return ShmqStreamWriter(self.options, schema)


def register(spark: SparkSession) -> type[ShmqDataSource]:
    """Register the ``"shmq"`` data source with a SparkSession; returns the data source class."""
    spark.dataSource.register(ShmqDataSource)
    return ShmqDataSource
