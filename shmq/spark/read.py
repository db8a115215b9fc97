"""Reading: ``spark.read`` and ``spark.readStream`` from the driver host's spool.

Partitions are planned on the driver (seq ranges ``[start, end)`` with the
byte position of ``start`` as a hint); tasks check they run on the driver's
host, read their range with an anonymous reader and emit Arrow batches (frame
columns only) or rows (JSON columns decoded permissively).
"""

from __future__ import annotations

import base64
import datetime as _dt
import decimal
import json
import logging
import socket
import time
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Optional, Sequence

import pyarrow as pa
from pyspark.sql import types as T
from pyspark.sql.datasource import DataSourceReader, DataSourceStreamReader, InputPartition

from ..dedupe import STAMP_BYTES, STAMP_FIELD, STAMP_MAGIC, split_stamp
from ..errors import Empty, FrameLost, ReaderBusy
from .options import DataLoss, ReaderOptions, WrongHost, open_spool

try:  # PySpark >= 4.2: read limits (admission control) and Trigger.AvailableNow
    from pyspark.sql.streaming.datasource import (
        ReadAllAvailable, ReadMaxRows, ReadMinRows, SupportsTriggerAvailableNow,
    )
except ImportError:  # pragma: no cover
    ReadAllAvailable = ReadMaxRows = ReadMinRows = None  # type: ignore[misc,assignment]

    class SupportsTriggerAvailableNow:  # type: ignore[no-redef]  # stand-in: older PySpark never calls it
        pass

log = logging.getLogger("shmq.spark")

#: How long a query waits for its named reader to be released by a previous
#: run of the query that is still shutting down.
READER_BUSY_WAIT_S = 15

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
    geo = getattr(sp, "geometry", None) or {}
    return f"{geo.get('sem_prefix', '')}:{geo.get('created_ns', '')}"


def _position_of(sp, seq):
    """Byte position of frame ``seq`` (None if unknown); it becomes the ring's walk hint."""
    try:
        if seq >= sp.next_seq:
            return None
        return sp.ring.locate(seq)
    except (FrameLost, AttributeError):
        return None


def _reader_at(sp, seq, pos):
    """An anonymous reader whose next frame is ``seq`` (raises FrameLost if it was overwritten)."""
    if pos is not None:
        # A valid (seq, pos) pair from the same spool instance: _locate starts there
        # instead of walking from the oldest frame (O(frames resident) in Python).
        sp.ring.locate_hint = (seq, pos)
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
    sp = open_spool(part.path, reading=True)
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


class ShmqBatchReader(DataSourceReader):
    """``spark.read.format("shmq")``: the frames in the ring when the query is planned."""

    def __init__(self, options: Mapping[str, str], schema: T.StructType) -> None:
        self.opts = ReaderOptions(options, streaming=False)
        self.schema = schema

    def partitions(self) -> Sequence[InputPartition]:
        o = self.opts
        sp = open_spool(o.path, reading=True)
        try:
            start = sp.first_seq if o.starting == "earliest" else o.starting
            end = sp.next_seq if o.ending == "latest" else min(o.ending, sp.next_seq)
            parts = _plan_partitions(sp, start, end, o.num_partitions, o.fail_on_data_loss,
                                     start, "this batch read")
        finally:
            sp.close()
        # An empty ring still needs one (empty) partition for Spark.
        return parts or [ShmqPartition(socket.gethostname(), o.path, "", 0, 0, None, 0, False, 0)]

    def read(self, partition: InputPartition) -> Iterator[Any]:
        if partition.start >= partition.end:  # type: ignore[attr-defined]  # a ShmqPartition
            return iter(())
        return _read_partition(partition, self.schema, _arrow_fast_schema(self.schema))


class ShmqStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """``spark.readStream.format("shmq")``: offsets are spool seqs, ``{"seq": n}``.

    The offset methods run on the driver (one long-lived Python process per
    query); ``read`` runs in the tasks.  The spool and the named reader are
    opened lazily: Spark also instantiates this class just to ship ``read``.
    """

    def __init__(self, options: Mapping[str, str], schema: T.StructType) -> None:
        self.opts = ReaderOptions(options, streaming=True)
        self.schema = schema
        self._sp: Any = None
        self._named: Any = None
        self._target: int | None = None  # Trigger.AvailableNow: never read past this seq
        self._last_end: int | None = None  # for PySpark < 4.2, which calls latestOffset() bare
        self._lost_counted_to = 0
        self.lost = 0

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_sp"] = state["_named"] = None
        return state

    # -- driver side ----------------------------------------------------------

    def _spool(self):
        if self._sp is None:
            self._sp = open_spool(self.opts.path, reading=True)
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

    def initialOffset(self) -> dict[str, int]:
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
            r.count_lost(b - a)
            r.flush_stats()

    def latestOffset(self, start: dict[str, int] | None = None, limit: Any = None) -> dict[str, int]:
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

    def getDefaultReadLimit(self) -> Any:
        if self.opts.max_frames:
            return ReadMaxRows(self.opts.max_frames) if ReadMaxRows is not None else self.opts.max_frames
        return ReadAllAvailable() if ReadAllAvailable is not None else None

    def reportLatestOffset(self) -> dict[str, int]:
        return {"seq": self._spool().next_seq}

    def prepareForTriggerAvailableNow(self) -> None:
        self._target = self._spool().next_seq

    def partitions(self, start: dict[str, int], end: dict[str, int]) -> Sequence[InputPartition]:
        sp = self._spool()
        s, e = self._seq_of(start), self._seq_of(end)
        if s >= e:
            return []
        first = sp.first_seq
        if s < first and not self.opts.fail_on_data_loss:
            self._count_lost(max(s, self._lost_counted_to), min(first, e))
        return _plan_partitions(sp, s, e, self.opts.num_partitions, self.opts.fail_on_data_loss,
                                max(self._lost_counted_to, s), "the streaming query")

    def commit(self, end: dict[str, int]) -> None:
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

    def stop(self) -> None:
        if self._named is not None:
            self._named.close()
            self._named = None
        if self._sp is not None:
            self._sp.close()
            self._sp = None

    # -- task side ------------------------------------------------------------

    def read(self, partition: InputPartition) -> Iterator[Any]:
        return _read_partition(partition, self.schema, _arrow_fast_schema(self.schema))
