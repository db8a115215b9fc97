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
docs/spark.md for the byte format.  Streaming reads are exactly-once into
Spark with a checkpoint: offsets are spool sequence numbers ``{"seq": n}``.
"""

from __future__ import annotations

import base64
import datetime as _dt
import decimal
import json
import logging
import pickle
import socket
import struct
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterator, Optional

from . import _format as F
from .errors import Empty, FrameLost, ReaderBusy, ShmqError
from .spool import Spool

try:
    import pyarrow as pa
    from pyspark.sql.datasource import (
        DataSource,
        DataSourceArrowWriter,
        DataSourceReader,
        DataSourceStreamReader,
        DataSourceStreamWriter,
        InputPartition,
        WriterCommitMessage,
    )
    from pyspark.sql import types as T
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("shmq.spark needs PySpark >= 4.0 and pyarrow: pip install 'shmq[spark]'") from exc

try:  # PySpark >= 4.1: the streaming sink can take Arrow batches too
    from pyspark.sql.datasource import DataSourceStreamArrowWriter as _StreamWriterBase
except ImportError:  # pragma: no cover
    _StreamWriterBase = DataSourceStreamWriter

try:  # PySpark >= 4.2: read limits (admission control) and Trigger.AvailableNow
    from pyspark.sql.streaming.datasource import (
        ReadAllAvailable, ReadMaxRows, ReadMinRows, SupportsTriggerAvailableNow,
    )
except ImportError:  # pragma: no cover
    ReadAllAvailable = ReadMaxRows = ReadMinRows = None

    class SupportsTriggerAvailableNow:  # stand-in: older PySpark never calls it
        pass

__all__ = [
    "register", "ShmqDataSource", "Stamp", "split_stamp", "pop_stamp", "arrow_stamp", "Deduper",
    "ShmqCommitMessage",
    "ShmqPartition", "WrongHost", "DataLoss", "STAMP_MAGIC", "STAMP_BYTES", "STAMP_DDL", "NAME",
]

log = logging.getLogger("shmq.spark")

NAME = "shmq"
#: How long a query waits for its named reader to be released by a previous
#: run of the query that is still shutting down.
READER_BUSY_WAIT_S = 15

# --- stamps ------------------------------------------------------------------
#
# The "prefix" stamp: 40 bytes in front of the payload, little-endian:
#   magic 8s  b"\x93SHMQst\x01" (0x93 never starts UTF-8, JSON or a pickle)
#   writer Q  first 64 bits of the streaming query id / batch write job id
#   batch  q  micro-batch id (-1 for a batch write)
#   part   i  Spark partition id
#   attempt H Spark task attempt number (saturates at 65535)
#   flags  H  bit 0: the last frame this task attempt wrote
#   row    Q  row index within the task's partition
# (Kept here rather than in _format: it is the Spark layer's envelope, not
# part of the spool format; the spool never looks inside payloads.)

STAMP_MAGIC = b"\x93SHMQst\x01"
_STAMP = struct.Struct("<8sQqiHHQ")
STAMP_BYTES = _STAMP.size
assert STAMP_BYTES == 40
STAMP_LAST = 0x1
STAMP_FIELD = "_shmq"  # the JSON/pickle stamp's key


@dataclass(frozen=True)
class Stamp:
    """Where a frame written by the Spark sink came from.

    ``key`` is the same for every copy of one logical row: a retried task
    (or a replayed micro-batch after a restart, which keeps its query id
    and batch id) writes the same rows under the same key with another
    ``attempt``.  Row indexes are stable only if the partition's content
    and order are deterministic; otherwise deduplicate per task attempt
    (``task``), using ``last`` to know that an attempt is complete.
    """

    writer: str  # 16 hex digits
    batch: int
    partition: int
    attempt: int
    row: int
    last: bool = False
    rows: int = 1  # rows in the frame (Arrow frames carry many; ``row`` is the first)

    @property
    def key(self):
        """``(writer, batch, partition, row)``: equal for duplicates of one row."""
        return (self.writer, self.batch, self.partition, self.row)

    @property
    def task(self):
        """``(writer, batch, partition)``: the logical task (all its attempts)."""
        return (self.writer, self.batch, self.partition)

    def to_json(self) -> dict:
        d = {"w": self.writer, "b": self.batch, "p": self.partition, "a": self.attempt, "i": self.row}
        if self.rows != 1:
            d["n"] = self.rows
        if self.last:
            d["last"] = True
        return d

    @classmethod
    def from_json(cls, d) -> "Stamp":
        return cls(str(d["w"]), int(d["b"]), int(d["p"]), int(d["a"]), int(d["i"]),
                   bool(d.get("last", False)), int(d.get("n", 1)))

    def pack(self) -> bytes:
        return _STAMP.pack(STAMP_MAGIC, int(self.writer, 16), self.batch, self.partition,
                           min(self.attempt, 0xFFFF), STAMP_LAST if self.last else 0, self.row)


def split_stamp(data):
    """Return ``(Stamp or None, payload)`` for a frame's bytes.

    Understands the 40-byte prefix stamp (``stamp="prefix"``); for JSON or
    pickle frames stamped in a field, decode the frame and use
    :meth:`Stamp.from_json` on its ``"_shmq"`` entry (see :func:`pop_stamp`).
    The payload is a zero-copy memoryview slice when a prefix is removed.
    """
    if len(data) >= STAMP_BYTES and data[:8] == STAMP_MAGIC:
        _m, writer, batch, part, attempt, flags, row = _STAMP.unpack_from(data)
        return (Stamp(f"{writer:016x}", batch, part, attempt, row, bool(flags & STAMP_LAST)),
                memoryview(data)[STAMP_BYTES:])
    return None, data


def pop_stamp(record):
    """Remove and return the :class:`Stamp` of a decoded JSON/pickle row dict (None if unstamped)."""
    d = record.pop(STAMP_FIELD, None) if isinstance(record, dict) else None
    return Stamp.from_json(d) if d else None


ARROW_STAMP_KEY = b"shmq.stamp"  # Arrow frames: the stamp is schema metadata


def arrow_stamp(table):
    """The :class:`Stamp` of an Arrow frame (``Reader.get_arrow()``), or None."""
    meta = table.schema.metadata or {}
    raw = meta.get(ARROW_STAMP_KEY)
    return Stamp.from_json(json.loads(raw)) if raw else None


class Deduper:
    """Recognise rows a retried Spark task wrote twice, by stamp key.

    ``seen(stamp)`` is True for a key seen before (drop that frame).  Keeps
    the most recent ``max_keys`` keys: size it to cover the longest
    stretch over which a retry can land (a few micro-batches).
    """

    def __init__(self, max_keys=1_000_000):
        self._keys = OrderedDict()
        self._max = max_keys
        self.duplicates = 0

    def seen(self, stamp) -> bool:
        if stamp is None:
            return False
        k = stamp.key
        if k in self._keys:
            self.duplicates += 1
            return True
        self._keys[k] = None
        if len(self._keys) > self._max:
            self._keys.popitem(last=False)
        return False


# --- errors ------------------------------------------------------------------


class WrongHost(ShmqError):
    """A read task ran on another host than the driver whose spool it must read."""


class DataLoss(ShmqError):
    """Frames a query still needed were overwritten (``failOnDataLoss=true``)."""


# --- options -----------------------------------------------------------------

_TRUE = ("true", "1", "yes")
_FALSE = ("false", "0", "no")


def _bool(options, key, default):
    v = options.get(key)
    if v is None:
        return default
    s = str(v).strip().lower()
    if s in _TRUE:
        return True
    if s in _FALSE:
        return False
    raise ValueError(f"option {key!r} must be true or false, not {v!r}")


def _int(options, key, default, minimum=0):
    v = options.get(key)
    if v is None:
        return default
    try:
        n = int(str(v).strip())
    except ValueError:
        raise ValueError(f"option {key!r} must be an integer, not {v!r}") from None
    if n < minimum:
        raise ValueError(f"option {key!r} must be >= {minimum}, not {n}")
    return n


def _float_or_none(options, key):
    v = options.get(key)
    if v is None or str(v).strip().lower() in ("", "none", "inf"):
        return None
    try:
        x = float(v)
    except ValueError:
        raise ValueError(f"option {key!r} must be a number of seconds, not {v!r}") from None
    if x < 0:
        raise ValueError(f"option {key!r} must be >= 0")
    return x


def _offset_option(options, key, words):
    """'earliest'/'latest'/'committed' (those in ``words``), a seq, or '{"seq": n}'."""
    v = options.get(key)
    if v is None:
        return None
    s = str(v).strip()
    if s.lower() in words:
        return s.lower()
    try:
        if s.startswith("{"):
            n = json.loads(s)["seq"]
        else:
            n = int(s)
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError
        return n
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"option {key!r} must be one of {', '.join(words)}, a seq, "
                         f"or '{{\"seq\": n}}', not {v!r}") from None


def _path(options):
    path = options.get("path")
    if not path:
        raise ValueError("the shmq data source needs a spool: .option('path', '/dev/shm/shmq/NAME') "
                         "(or .save(path) / .load(path))")
    return str(path)


def _open_spool(path, options=None, create=False, reading=False):
    """Open (or, with ``create``, create) the spool at ``path`` on this host."""
    try:
        return Spool.open(path)
    except FileNotFoundError:
        if reading:
            raise FileNotFoundError(f"no shmq spool at {path!r} on host {socket.gethostname()} "
                                    "(the driver's host, where shmq reads are planned)") from None
        if not create:
            raise FileNotFoundError(
                f"no shmq spool at {path!r} on host {socket.gethostname()}: create it on every "
                "host first (e.g. by the sidecar that consumes it), or set option create=true") from None
    opts = options or {}
    return Spool.create(path, capacity=opts.get("capacity") or "64MiB",
                        on_full=opts.get("onFull") or "overwrite", exist_ok=True)


# --- schema ------------------------------------------------------------------

BASE_SCHEMA = T.StructType([
    T.StructField("seq", T.LongType(), False),
    T.StructField("timestamp", T.TimestampType(), False),
    T.StructField("value", T.BinaryType(), True),
])

#: The Spark type of a ``_shmq`` column that receives frame stamps (field or prefix).
STAMP_DDL = "struct<w:string,b:bigint,p:int,a:int,i:bigint,last:boolean,n:bigint>"


def _coercer(dt):
    """A function turning a JSON value into what Spark expects for type ``dt`` (None on failure)."""
    if isinstance(dt, (T.TimestampType, T.TimestampNTZType)):
        ntz = isinstance(dt, T.TimestampNTZType)

        def ts(v):
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                d = _dt.datetime.fromtimestamp(v, _dt.timezone.utc)
            else:
                d = _dt.datetime.fromisoformat(str(v).replace("Z", "+00:00"))
            if ntz:
                return d.replace(tzinfo=None)
            return d if d.tzinfo else d.replace(tzinfo=_dt.timezone.utc)
        return ts
    if isinstance(dt, T.DateType):
        return lambda v: _dt.date.fromisoformat(str(v)[:10])
    if isinstance(dt, T.DecimalType):
        return lambda v: decimal.Decimal(str(v))
    if isinstance(dt, T.BinaryType):
        return lambda v: base64.b64decode(v) if isinstance(v, str) else bytes(v)
    if isinstance(dt, T.StringType):
        return lambda v: v if isinstance(v, str) else json.dumps(v)
    if isinstance(dt, (T.LongType, T.IntegerType, T.ShortType, T.ByteType)):
        return lambda v: int(v) if not isinstance(v, bool) else None
    if isinstance(dt, (T.DoubleType, T.FloatType)):
        return float
    if isinstance(dt, T.BooleanType):
        return lambda v: v if isinstance(v, bool) else None
    if isinstance(dt, T.ArrayType):
        el = _coercer(dt.elementType)
        return lambda v: [_safe(el, x) for x in v]
    if isinstance(dt, T.MapType):
        val = _coercer(dt.valueType)
        return lambda v: {k: _safe(val, x) for k, x in v.items()}
    if isinstance(dt, T.StructType):
        fields = [(f.name, _coercer(f.dataType)) for f in dt.fields]
        return lambda v: {n: _safe(c, v.get(n)) for n, c in fields}
    return lambda v: v


def _safe(fn, v):
    if v is None:
        return None
    try:
        return fn(v)
    except Exception:  # permissive: a value of the wrong shape reads as null
        return None



def _plan_columns(schema):
    """``[(kind, name, arg)]`` for each output column (kinds: seq, timestamp, value, str, stamp, json)."""
    plan = []
    for f in schema.fields:
        if f.name == "seq":
            plan.append(("seq", f.name, None))
        elif f.name == "timestamp":
            plan.append(("timestamp", f.name, None))
        elif f.name == "value":
            plan.append(("str" if isinstance(f.dataType, T.StringType) else "value", f.name, None))
        elif f.name == STAMP_FIELD:
            plan.append(("stamp", f.name, _coercer(f.dataType)))
        else:
            plan.append(("json", f.name, _coercer(f.dataType)))
    return plan


def _arrow_fast_schema(schema):
    """The Arrow schema Spark expects, if ``schema`` is only frame columns of their natural types."""
    natural = {"seq": T.LongType, "timestamp": T.TimestampType, "value": (T.BinaryType, T.StringType)}
    for f in schema.fields:
        if f.name not in natural or not isinstance(f.dataType, natural[f.name]):
            return None
    try:
        from pyspark.sql.pandas.types import to_arrow_schema

        try:
            return to_arrow_schema(schema, timezone="UTC")
        except TypeError:  # older signature
            return to_arrow_schema(schema)
    except Exception:
        return None


# --- reading -------------------------------------------------------------------


@dataclass
class ShmqPartition(InputPartition):
    """Frames ``[start, end)`` of the spool at ``path`` on ``host`` (picklable).

    ``spool_id`` identifies the spool file instance planned against (a
    recreated spool at the same path has another); ``pos`` is the byte
    position of ``start`` found by the driver (a hint that spares the task
    a walk from the oldest frame); ``lost_from`` is where frames lost
    before planning were already counted up to.
    """

    host: str
    path: str
    spool_id: str
    start: int
    end: int
    pos: Optional[int]
    index: int
    fail_on_data_loss: bool
    lost_from: int


def _spool_id(sp):
    geo = getattr(sp, "_geo", None) or {}
    return f"{geo.get('sem_prefix', '')}:{geo.get('created_ns', '')}"


def _position_of(sp, seq):
    """Byte position of frame ``seq`` (None if unknown).  Uses the spool's walk hint internals."""
    try:
        if seq >= sp.next_seq:
            return None
        return sp._locate(seq)
    except (FrameLost, AttributeError):
        return None


def _reader_at(sp, seq, pos):
    """An anonymous reader whose next frame is ``seq`` (raises FrameLost if it was overwritten)."""
    if pos is not None:
        # A valid (seq, pos) pair from the same spool instance: _locate starts there
        # instead of walking from the oldest frame (O(frames resident) in Python).
        sp._locate_hint = (seq, pos)
    return sp.reader(start=seq)


def _split(start, end, parts):
    n = end - start
    k = max(1, min(parts, n))
    bounds = [start + n * i // k for i in range(k + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(k) if bounds[i] < bounds[i + 1]]


def _plan_partitions(sp, start, end, num_partitions, fail_on_data_loss, lost_from, where):
    """Input partitions for frames ``[start, end)``; checks and counts frames already lost."""
    first = sp.first_seq
    if start < first:
        gap_end = min(first, end)
        if fail_on_data_loss:
            raise DataLoss(_loss_message(sp.path, start, first, where))
        start = gap_end
    if start >= end:
        return []
    host = socket.gethostname()
    sid = _spool_id(sp)
    out = []
    for i, (a, b) in enumerate(_split(start, end, num_partitions)):
        out.append(ShmqPartition(host, sp.path, sid, a, b, _position_of(sp, a), i,
                                 fail_on_data_loss, max(lost_from, a)))
    return out


def _loss_message(path, start, first, where):
    return (f"shmq: frames {start}..{first - 1} of {path} were overwritten before {where} read "
            f"them ({first - start} frames lost). The spool is too small for the lag, or its "
            "writers do not wait for this reader: use on_full='block' with option readerName "
            "(the named reader holds writers back), a bigger capacity, or a faster trigger. "
            "Set option failOnDataLoss=false to skip lost frames and count them instead.")


def _check_host(part):
    here = socket.gethostname()
    if part.host != here:
        raise WrongHost(
            f"shmq: this read task runs on host {here!r}, but spool {part.path} was planned on "
            f"the driver's host {part.host!r}. Spools are host-local: a shmq read (streaming "
            "or batch) must run its tasks on the driver host (local mode, or pin executors "
            "there); on a cluster, consume each host's spool with a sidecar on that host.")


def _read_partition(part, schema, arrow_schema) -> Iterator:
    """Yield Arrow record batches (or row tuples) for one partition; runs in a Spark task."""
    _check_host(part)
    sp = _open_spool(part.path, reading=True)
    try:
        if part.spool_id and _spool_id(sp) != part.spool_id:
            raise DataLoss(f"shmq: spool {part.path} was recreated after this batch was planned "
                           f"(frames {part.start}..{part.end - 1} are gone)")
        try:
            r = _reader_at(sp, part.start, part.pos)
        except FrameLost:
            if part.fail_on_data_loss:
                raise DataLoss(_loss_message(part.path, part.start, sp.first_seq, "a Spark task")) from None
            r = sp.reader(start="earliest")
        plan = _plan_columns(schema)
        delivered = 0
        seq = r.position
        while seq < part.end:
            try:
                frames = r.get_many(max_frames=min(4096, part.end - seq), block=False)
            except Empty:
                break  # nothing below part.end is left (the spool was reset)
            if frames[0][0] != seq and part.fail_on_data_loss:  # overwritten while we read
                raise DataLoss(_loss_message(part.path, seq, frames[0][0], "a Spark task"))
            if frames[-1][0] >= part.end:
                frames = [f for f in frames if f[0] < part.end]
            seq = r.position
            if frames:
                delivered += len(frames)
                yield from _emit(frames, plan, schema, arrow_schema)
        r.close()
        # Frames below lost_from were counted by the driver when it planned this batch.
        lost = part.end - part.start - delivered - max(0, min(part.lost_from, part.end) - part.start)
        if lost > 0:
            log.warning("shmq: skipped %d overwritten frames of %s in seq range %d..%d "
                        "(failOnDataLoss=false)", lost, part.path, part.start, part.end - 1)
    finally:
        sp.close()


_EPOCH = _dt.datetime(1970, 1, 1, tzinfo=_dt.timezone.utc)


def _payload(data):
    """The frame's bytes without a prefix stamp."""
    if data[:8] == STAMP_MAGIC and len(data) >= STAMP_BYTES:
        return data[STAMP_BYTES:]
    return data


def _emit(frames, plan, schema, arrow_schema):
    """Turn frames into one Arrow batch (frame columns only) or row tuples."""
    if arrow_schema is not None:
        cols = []
        for kind, _name, _arg in plan:
            if kind == "seq":
                cols.append(pa.array([f[0] for f in frames], pa.int64()))
            elif kind == "timestamp":
                cols.append(pa.array([f[1] // 1000 for f in frames], pa.int64()))
            elif kind == "value":
                cols.append(pa.array([_payload(f[2]) for f in frames], pa.binary()))
            else:  # "str"
                cols.append(pa.array([_payload(f[2]).decode("utf-8", "replace") for f in frames],
                                     pa.string()))
        cols = [c.cast(t.type) if c.type != t.type else c for c, t in zip(cols, arrow_schema)]
        yield pa.RecordBatch.from_arrays(cols, schema=arrow_schema)
        return
    needs_json = any(k in ("json", "stamp") for k, _n, _a in plan)
    for seq, ts, data in frames:
        stamp, payload = split_stamp(data)
        obj = None
        if needs_json:
            try:
                obj = json.loads(bytes(payload))
            except ValueError:
                obj = None  # permissive: not JSON, decoded columns are null
            if not isinstance(obj, dict):
                obj = {}
        row = []
        for kind, name, arg in plan:
            if kind == "seq":
                row.append(seq)
            elif kind == "timestamp":
                row.append(_EPOCH + _dt.timedelta(microseconds=ts // 1000))
            elif kind == "value":
                row.append(bytes(payload))
            elif kind == "str":
                row.append(bytes(payload).decode("utf-8", "replace"))
            elif kind == "stamp":
                d = stamp.to_json() if stamp else obj.get(name)
                if isinstance(d, dict):
                    d = {"last": False, "n": 1, **d}
                row.append(_safe(arg, d))
            else:
                row.append(_safe(arg, obj.get(name)))
        yield tuple(row)


class _ReaderOptions:
    def __init__(self, options, streaming):
        self.path = _path(options)
        self.num_partitions = _int(options, "numPartitions", 1, minimum=1)
        self.fail_on_data_loss = _bool(options, "failOnDataLoss", True)
        self.reader_name = options.get("readerName") or None
        self.max_frames = _int(options, "maxFramesPerTrigger", 0, minimum=1) or None
        default_start = "committed" if (streaming and self.reader_name) else ("latest" if streaming else "earliest")
        words = ("earliest", "latest", "committed") if streaming else ("earliest",)
        self.starting = _offset_option(options, "startingOffsets", words) or default_start
        if self.starting == "committed" and not self.reader_name:
            raise ValueError("startingOffsets=committed needs option readerName (the named reader "
                             "whose committed position to start from)")
        self.ending = None if streaming else (_offset_option(options, "endingOffsets", ("latest",)) or "latest")


class ShmqBatchReader(DataSourceReader):
    """``spark.read.format("shmq")``: the frames in the ring when the query is planned."""

    def __init__(self, options, schema):
        self.opts = _ReaderOptions(options, streaming=False)
        self.schema = schema

    def partitions(self):
        o = self.opts
        sp = _open_spool(o.path, reading=True)
        try:
            start = sp.first_seq if o.starting == "earliest" else o.starting
            end = sp.next_seq if o.ending == "latest" else min(o.ending, sp.next_seq)
            parts = _plan_partitions(sp, start, end, o.num_partitions, o.fail_on_data_loss,
                                     start, "this batch read")
        finally:
            sp.close()
        # An empty ring still needs one (empty) partition for Spark.
        return parts or [ShmqPartition(socket.gethostname(), o.path, "", 0, 0, None, 0, False, 0)]

    def read(self, partition):
        if partition.start >= partition.end:
            return iter(())
        return _read_partition(partition, self.schema, _arrow_fast_schema(self.schema))


class ShmqStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """``spark.readStream.format("shmq")``: offsets are spool seqs, ``{"seq": n}``.

    The offset methods run on the driver (one long-lived Python process per
    query); ``read`` runs in the tasks.  The spool and the named reader are
    opened lazily: Spark also instantiates this class just to ship ``read``.
    """

    def __init__(self, options, schema):
        self.opts = _ReaderOptions(options, streaming=True)
        self.schema = schema
        self._sp = None
        self._named = None
        self._target = None  # Trigger.AvailableNow: never read past this seq
        self._last_end = None  # for PySpark < 4.2, which calls latestOffset() bare
        self._lost_counted_to = 0
        self.lost = 0

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_sp"] = state["_named"] = None
        return state

    # -- driver side ----------------------------------------------------------

    def _spool(self):
        if self._sp is None:
            self._sp = _open_spool(self.opts.path, reading=True)
        return self._sp

    def _named_reader(self, start="earliest"):
        if self._named is None and self.opts.reader_name:
            sp = self._spool()
            deadline = time.monotonic() + READER_BUSY_WAIT_S
            while True:
                try:
                    self._named = sp.reader(self.opts.reader_name, start=start, auto_commit=False)
                    break
                except ReaderBusy:
                    # A previous run of this query may still be shutting down.
                    if time.monotonic() > deadline:
                        raise ReaderBusy(
                            f"shmq: named reader {self.opts.reader_name!r} of {self.opts.path} is "
                            "attached by another live process; two queries cannot share a "
                            "readerName") from None
                    time.sleep(0.2)
        return self._named

    def initialOffset(self):
        o = self.opts
        sp = self._spool()
        if o.reader_name:
            start = o.starting if o.starting != "committed" else "earliest"
            r = self._named_reader(start=start)
            if o.starting == "committed":
                seq = r.committed
            else:
                r.seek(o.starting)
                r.commit()
                seq = r.position
        elif o.starting == "earliest":
            seq = sp.first_seq
        elif o.starting == "latest":
            seq = sp.next_seq
        else:
            if o.starting > sp.next_seq:
                raise ValueError(f"startingOffsets seq {o.starting} is beyond the next seq "
                                 f"{sp.next_seq} of {o.path}")
            seq = o.starting
        self._last_end = seq
        return {"seq": seq}

    def _seq_of(self, offset):
        try:
            seq = offset["seq"]
            if isinstance(seq, bool) or not isinstance(seq, int) or seq < 0:
                raise TypeError
            return seq
        except (TypeError, KeyError):
            raise ValueError(f"shmq: not a shmq offset: {offset!r} (expected {{\"seq\": n}}); "
                             "was this checkpoint written by another source?") from None

    def _check_start(self, seq, sp):
        """Fail on (or skip and count) frames below ``seq``'s range that were overwritten."""
        nxt = sp.next_seq
        if seq > nxt:
            raise DataLoss(
                f"shmq: the query's offset {seq} is beyond the next seq {nxt} of {sp.path}: the "
                "spool was recreated or reset since the checkpoint was written. Start the query "
                "with a new checkpointLocation.")
        first = sp.first_seq
        if seq < first:
            if self.opts.fail_on_data_loss:
                raise DataLoss(_loss_message(sp.path, seq, first, "the streaming query"))
            self._count_lost(max(seq, self._lost_counted_to), first)
            return first
        return seq

    def _count_lost(self, a, b):
        if b <= a:
            return
        self._lost_counted_to = b
        self.lost += b - a
        log.warning("shmq: skipping %d overwritten frames (%d..%d) of %s; %d lost so far "
                    "(failOnDataLoss=false)", b - a, a, b - 1, self.opts.path, self.lost)
        r = self._named_reader()
        if r is not None:
            # Add to the named reader's durable loss counter (spool stats / `shmq readers`).
            r._count_lost(b - a)
            r._flush_stats()

    def latestOffset(self, start=None, limit=None):
        sp = self._spool()
        if start is None:  # PySpark < 4.2: no admission control API, track the start ourselves
            start = {"seq": self._last_end if self._last_end is not None else sp.first_seq}
            limit = self.getDefaultReadLimit()
        seq = self._check_start(self._seq_of(start), sp)
        # Spark asks for the next offsets only once every batch ending at `start` has
        # been written to the sink (and recorded in the commit log), so the named
        # reader may move there now rather than at commit(), one batch later: with
        # on_full="block" that late commit could leave writers blocked on a full ring
        # while Spark waits for new data before it commits.
        self._advance_named(seq)
        end = sp.next_seq
        if self._target is not None:
            end = min(end, max(self._target, seq))
        if ReadMaxRows is not None and isinstance(limit, ReadMaxRows):
            end = min(end, seq + limit.max_rows)
        elif ReadMinRows is not None and isinstance(limit, ReadMinRows):
            if end - seq < limit.min_rows:
                return start
        elif isinstance(limit, int):  # PySpark < 4.2 fallback above
            end = min(end, seq + limit)
        if end == seq:
            return start  # nothing new: tell Spark the offset did not move
        self._last_end = end
        return {"seq": end}

    def getDefaultReadLimit(self):
        if self.opts.max_frames:
            return ReadMaxRows(self.opts.max_frames) if ReadMaxRows is not None else self.opts.max_frames
        return ReadAllAvailable() if ReadAllAvailable is not None else None

    def reportLatestOffset(self):
        return {"seq": self._spool().next_seq}

    def prepareForTriggerAvailableNow(self):
        self._target = self._spool().next_seq

    def partitions(self, start, end):
        sp = self._spool()
        s, e = self._seq_of(start), self._seq_of(end)
        if s >= e:
            return []
        first = sp.first_seq
        if s < first and not self.opts.fail_on_data_loss:
            self._count_lost(max(s, self._lost_counted_to), min(first, e))
        return _plan_partitions(sp, s, e, self.opts.num_partitions, self.opts.fail_on_data_loss,
                                max(self._lost_counted_to, s), "the streaming query")

    def commit(self, end):
        """Persist the named reader at ``end`` (Spark calls this one batch late)."""
        self._advance_named(self._seq_of(end))

    def _advance_named(self, seq):
        """Move the named reader's committed position forward to ``seq`` (never back)."""
        r = self._named_reader()
        if r is None or seq <= r.committed:
            return
        try:
            r.seek(seq)
        except FrameLost:
            r.seek("earliest")  # already overwritten: the oldest frame is as far as it goes
        except ValueError:
            log.warning("shmq: cannot commit %s at seq %d (beyond its next seq %d)",
                        self.opts.path, seq, self._spool().next_seq)
            return
        r.commit()

    def stop(self):
        if self._named is not None:
            self._named.close()
            self._named = None
        if self._sp is not None:
            self._sp.close()
            self._sp = None

    # -- task side ------------------------------------------------------------

    def read(self, partition):
        return _read_partition(partition, self.schema, _arrow_fast_schema(self.schema))


# --- writing -------------------------------------------------------------------


@dataclass
class ShmqCommitMessage(WriterCommitMessage):
    """What one write task appended: ``count`` frames (``rows`` rows), seqs in ``[first_seq, next_seq)``.

    Each chunk (up to ``batchFrames`` frames) is one atomic, contiguous
    ``put_many``; other writers' frames may sit between chunks.
    """

    host: str
    path: str
    writer: str
    batch: int
    partition: int
    attempt: int
    first_seq: Optional[int]
    next_seq: Optional[int]
    count: int
    bytes: int
    rows: int = 0  # rows written (== count, except with encoding=arrow: a frame per batch)


_ENCODINGS = ("value", "json", "pickle", "arrow")
_STAMPS = ("auto", "none", "field", "prefix")


class _WriterOptions:
    def __init__(self, options, schema):
        self.path = _path(options)
        names = {f.name: f.dataType for f in schema.fields}
        enc = (options.get("encoding") or "auto").lower()
        if enc == "auto":
            enc = "value" if isinstance(names.get("value"), (T.BinaryType, T.StringType)) else "json"
        if enc not in _ENCODINGS:
            raise ValueError(f"option encoding must be one of auto, {', '.join(_ENCODINGS)}, not {enc!r}")
        if enc == "value" and not isinstance(names.get("value"), (T.BinaryType, T.StringType)):
            raise ValueError("encoding=value needs a 'value' column of type binary or string "
                             f"(columns: {', '.join(names) or 'none'}); use encoding=json or pickle")
        stamp = (options.get("stamp") or "auto").lower()
        if stamp not in _STAMPS:
            raise ValueError(f"option stamp must be one of {', '.join(_STAMPS)}, not {stamp!r}")
        if stamp == "auto":
            stamp = "none" if enc == "value" else "field"
        if stamp == "field" and enc == "value":
            raise ValueError("stamp=field needs encoding json, pickle or arrow (a raw value has no "
                             "fields); use stamp=prefix to stamp raw values")
        if stamp == "prefix" and enc == "arrow":
            raise ValueError("stamp=prefix would break Arrow IPC frames: arrow frames are stamped "
                             "in their schema metadata (stamp=field)")
        self.encoding = enc
        self.stamp = stamp
        self.create = _bool(options, "create", False)
        self.options = {"capacity": options.get("capacity"), "onFull": options.get("onFull")}
        self.put_timeout = _float_or_none(options, "putTimeout")
        self.batch_frames = _int(options, "batchFrames", 1000, minimum=1)
        self.codec = {"value": F.CODEC_RAW, "json": F.CODEC_JSON, "pickle": F.CODEC_PICKLE,
                      "arrow": F.CODEC_ARROW}[enc]
        if enc == "value" and isinstance(names["value"], T.StringType):
            self.codec = F.CODEC_UTF8


def _json_default(o):
    if isinstance(o, (_dt.datetime, _dt.date, _dt.time)):
        return o.isoformat()
    if isinstance(o, decimal.Decimal):
        return str(o)  # exact; read back into a DecimalType column
    if isinstance(o, (bytes, bytearray, memoryview)):
        return base64.b64encode(bytes(o)).decode("ascii")
    if isinstance(o, _dt.timedelta):
        return o.total_seconds()
    raise TypeError(f"cannot encode {type(o).__name__} as JSON")


def _make_json_dumps():
    """A compact JSON encoder, built once (json.dumps rebuilds its C encoder per call)."""
    try:
        from json.encoder import c_make_encoder, encode_basestring

        if c_make_encoder is None:
            raise ImportError
        enc = c_make_encoder(None, _json_default, encode_basestring, None, ":", ",", False, False, True)
        join = "".join
        return lambda obj: join(enc(obj, 0))
    except (ImportError, TypeError):  # another Python implementation
        return json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, default=_json_default).encode


_dumps_json = _make_json_dumps()


def _task_identity(writer_id, streaming):
    """``(writer id, batch id, partition, attempt)`` of the running Spark task."""
    from pyspark import TaskContext

    tc = TaskContext.get()
    if tc is None:  # called outside Spark (tests, tools)
        return writer_id, -1, 0, 0
    batch = -1
    if streaming:
        qid = tc.getLocalProperty("sql.streaming.queryId")
        if qid:
            writer_id = uuid.UUID(qid).hex[:16]  # stable across restarts from one checkpoint
        b = tc.getLocalProperty("streaming.sql.batchId")
        batch = int(b) if b is not None else -1
    return writer_id, batch, tc.partitionId(), tc.attemptNumber()


_ROWS_PER_LIST = 4096  # rows grouped per list when Spark hands us Rows, not Arrow batches


def _record_lists(batches, opts):
    """Lists of records (raw value bytes, or dicts) from Arrow batches or Spark Rows."""
    rows = []
    for b in batches:
        if isinstance(b, pa.RecordBatch):
            if opts.encoding == "arrow":
                yield b
            elif opts.encoding == "value":
                col = b.column(b.schema.get_field_index("value"))
                if pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
                    col = col.cast(pa.binary() if pa.types.is_string(col.type) else pa.large_binary())
                yield col.to_pylist()
            else:
                yield b.to_pylist(maps_as_pydicts="lossy")
            continue
        # a pyspark Row (PySpark < 4.1 streaming writer)
        if opts.encoding == "arrow":
            rows.append(b.asDict(recursive=True))
            if len(rows) >= _ROWS_PER_LIST:
                yield pa.RecordBatch.from_pylist(rows)
                rows = []
            continue
        if opts.encoding == "value":
            v = b["value"]
            rows.append(v.encode("utf-8") if isinstance(v, str) else v)
        else:
            rows.append(b.asDict(recursive=True))
        if len(rows) >= _ROWS_PER_LIST:
            yield rows
            rows = []
    if rows:
        yield pa.RecordBatch.from_pylist(rows) if opts.encoding == "arrow" else rows


def _encode_list(recs, opts):
    """Payloads for records, unstamped."""
    if opts.encoding == "value":
        return [b"" if v is None else v for v in recs]
    if opts.encoding == "json":
        return [_dumps_json(r).encode("utf-8") for r in recs]
    return [pickle.dumps(r, protocol=5) for r in recs]


def _encode_stamped(recs, opts, ident, row0, last):
    """Payloads for records stamped as rows ``row0..``; the final one flagged if ``last``."""
    writer, batch, part, attempt = ident
    n = len(recs)
    if opts.stamp == "prefix":
        pack, w, a = _STAMP.pack, int(writer, 16), min(attempt, 0xFFFF)
        out = [pack(STAMP_MAGIC, w, batch, part, a, 0, row0 + k) + p
               for k, p in enumerate(_encode_list(recs, opts))]
        if last and n:
            out[-1] = pack(STAMP_MAGIC, w, batch, part, a, STAMP_LAST, row0 + n - 1) + out[-1][STAMP_BYTES:]
        return out
    if opts.encoding == "json":
        # The stamp is appended as text: the same JSON as a "_shmq" dict entry, without
        # building and encoding a dict per row (half the cost of the row itself).
        head = f'"{STAMP_FIELD}":{{"w":"{writer}","b":{batch},"p":{part},"a":{attempt},"i":'
        out = []
        for k, r in enumerate(recs):
            t = _dumps_json(r)
            tail = "," + head if len(t) > 2 else head
            end = ',"last":true}}' if last and k == n - 1 else "}}"
            out.append((t[:-1] + tail + str(row0 + k) + end).encode("utf-8"))
        return out
    out = []
    for k, r in enumerate(recs):  # pickle: the stamp is a "_shmq" entry of the row dict
        st = {"w": writer, "b": batch, "p": part, "a": attempt, "i": row0 + k}
        if last and k == n - 1:
            st["last"] = True
        r[STAMP_FIELD] = st
        out.append(pickle.dumps(r, protocol=5))
    return out


def _payload_lists(batches, opts, ident):
    """Encoded payload lists; with stamps, one list of look-ahead so the last row says so."""
    if opts.stamp == "none":
        for recs in _record_lists(batches, opts):
            yield _encode_list(recs, opts)
        return
    row = 0
    pending = None
    for recs in _record_lists(batches, opts):
        if not recs:
            continue
        if pending is not None:
            yield _encode_stamped(pending, opts, ident, row, last=False)
            row += len(pending)
        pending = recs
    if pending is not None:
        yield _encode_stamped(pending, opts, ident, row, last=True)


def _chunks(payloads, max_frames, max_bytes):
    """Split a payload list into put_many batches of at most ``max_frames`` / ``max_bytes``."""
    i, n = 0, len(payloads)
    while i < n:
        chunk = payloads[i:i + max_frames]
        if sum(map(len, chunk)) > max_bytes:
            size, k = 0, 0
            for k, p in enumerate(chunk):
                size += len(p)
                if size > max_bytes and k:
                    break
            else:
                k = len(chunk)
            chunk = chunk[:k]
        yield chunk
        i += len(chunk)


def _write_task(opts, batches, writer_id, streaming):
    """Append this task's rows to this host's spool; return the commit message.

    Rows go in ``put_many`` chunks of up to ``batchFrames`` frames (and a
    quarter of the ring, at most 8 MiB): each chunk is atomic and contiguous.
    """
    ident = _task_identity(writer_id, streaming)
    sp = _open_spool(opts.path, opts.options, create=opts.create)
    first = nxt = None
    count = nbytes = 0
    max_bytes = min(max(sp.capacity // 4, 1), 8 << 20)
    try:
        if opts.encoding == "arrow":
            first, nxt, count, nbytes, rows = _write_arrow(sp, opts, batches, ident, max_bytes)
            writer, batch, part, attempt = ident
            return ShmqCommitMessage(socket.gethostname(), opts.path, writer, batch, part, attempt,
                                     first, nxt, count, nbytes, rows)
        for payloads in _payload_lists(batches, opts, ident):
            for chunk in _chunks(payloads, opts.batch_frames, max_bytes):
                s = sp.put_many(chunk, timeout=opts.put_timeout, codec=opts.codec)
                if first is None:
                    first = s
                nxt = s + len(chunk)
                count += len(chunk)
                nbytes += sum(map(len, chunk))
    finally:
        sp.close()
    writer, batch, part, attempt = ident
    return ShmqCommitMessage(socket.gethostname(), opts.path, writer, batch, part, attempt,
                             first, nxt, count, nbytes, count)


def _arrow_pieces(batches, opts, max_bytes):
    """Spark's Arrow batches, each cut into slices that fit a quarter of the ring."""
    for b in _record_lists(batches, opts):
        if not b.num_rows:
            continue
        # An Arrow frame holds a whole batch; cut big ones so each fits a quarter ring.
        per = max(1, min(b.num_rows, b.num_rows * max_bytes // max(b.nbytes, 1)))
        for off in range(0, b.num_rows, per):
            yield b.slice(off, per)


def _write_arrow(sp, opts, batches, ident, max_bytes):
    """One Arrow IPC frame per (cut) batch; the stamp goes into the schema metadata."""
    writer, batch, part, attempt = ident
    first = nxt = None
    count = nbytes = row = 0
    pending = None
    pieces = _arrow_pieces(batches, opts, max_bytes)
    while True:
        piece = next(pieces, None)
        if pending is not None:
            b = pending
            if opts.stamp == "field":
                st = Stamp(writer, batch, part, attempt, row, last=piece is None, rows=b.num_rows)
                meta = dict(b.schema.metadata or {})
                meta[ARROW_STAMP_KEY] = json.dumps(st.to_json()).encode()
                b = b.replace_schema_metadata(meta)
            s = sp.put_arrow(b, timeout=opts.put_timeout)
            if first is None:
                first = s
            nxt = s + 1
            count += 1
            nbytes += b.nbytes
            row += b.num_rows
        if piece is None:
            return first, nxt, count, nbytes, row
        pending = piece


def _log_commit(messages, what):
    done = [m for m in messages if m is not None]
    frames = sum(m.count for m in done)
    rows = sum(m.rows for m in done)
    hosts = sorted({m.host for m in done})
    log.info("shmq: %s committed %d rows in %d frames from %d tasks on %s", what, rows, frames,
             len(done), ", ".join(hosts))


def _log_abort(messages, what):
    done = [m for m in messages if m is not None and m.count]
    if done:
        ranges = "; ".join(f"{m.host}:{m.path} seqs {m.first_seq}..{m.next_seq - 1} "
                           f"(partition {m.partition})" for m in done)
        log.warning("shmq: %s aborted; frames already appended stay in the spools (at-least-once; "
                    "consumers can drop them by stamp): %s", what, ranges)


class ShmqWriter(DataSourceArrowWriter):
    """``df.write.format("shmq")``: each task appends its partition to its host's spool."""

    def __init__(self, options, schema):
        self.opts = _WriterOptions(options, schema)
        self.writer_id = uuid.uuid4().hex[:16]  # one id per write job (created on the driver)

    def write(self, iterator):
        return _write_task(self.opts, iterator, self.writer_id, streaming=False)

    def commit(self, messages):
        _log_commit(messages, f"write {self.writer_id} to {self.opts.path}")

    def abort(self, messages):
        _log_abort(messages, f"write {self.writer_id} to {self.opts.path}")


class ShmqStreamWriter(_StreamWriterBase):
    """``df.writeStream.format("shmq")``: like :class:`ShmqWriter`, per micro-batch."""

    def __init__(self, options, schema):
        self.opts = _WriterOptions(options, schema)
        self.writer_id = uuid.uuid4().hex[:16]  # replaced by the query id inside tasks

    def write(self, iterator):
        return _write_task(self.opts, iterator, self.writer_id, streaming=True)

    def commit(self, messages, batchId):
        _log_commit(messages, f"micro-batch {batchId} to {self.opts.path}")

    def abort(self, messages, batchId):
        _log_abort(messages, f"micro-batch {batchId} to {self.opts.path}")


# --- the data source ------------------------------------------------------------


class ShmqDataSource(DataSource):
    """The ``"shmq"`` data source; see the module docstring and docs/spark.md."""

    @classmethod
    def name(cls):
        return NAME

    def schema(self):
        return BASE_SCHEMA

    def reader(self, schema):
        return ShmqBatchReader(self.options, schema)

    def streamReader(self, schema):
        return ShmqStreamReader(self.options, schema)

    def writer(self, schema, overwrite):
        if overwrite:
            raise ValueError("shmq spools are append-only: use mode('append')")
        return ShmqWriter(self.options, schema)

    def streamWriter(self, schema, overwrite):
        if overwrite:
            raise ValueError("shmq spools are append-only: use outputMode('append')")
        return ShmqStreamWriter(self.options, schema)


def register(spark):
    """Register the ``"shmq"`` data source with a SparkSession; returns the data source class."""
    spark.dataSource.register(ShmqDataSource)
    return ShmqDataSource
