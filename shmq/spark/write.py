"""Writing: ``df.write`` and ``df.writeStream`` append each task's rows to its host's spool.

Rows are encoded (raw value, JSON, pickle, or one Arrow IPC frame per
batch), optionally stamped (:mod:`shmq.dedupe`), and appended in atomic
``put_many`` chunks.  At least once: a retried task writes its rows again.
"""

from __future__ import annotations

import base64
import datetime as _dt
import decimal
import json
import logging
import pickle
import socket
import uuid
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Mapping, Optional

import pyarrow as pa
from pyspark.sql.datasource import DataSourceArrowWriter, DataSourceStreamWriter, WriterCommitMessage

from ..dedupe import ARROW_STAMP_KEY, STAMP_BYTES, STAMP_FIELD, STAMP_LAST, STAMP_MAGIC, STAMP_STRUCT, Stamp
from .options import WriterOptions, open_spool

try:  # PySpark >= 4.1: the streaming sink can take Arrow batches too
    from pyspark.sql.datasource import DataSourceStreamArrowWriter as _StreamWriterBase
except ImportError:  # pragma: no cover
    _StreamWriterBase = DataSourceStreamWriter  # type: ignore[misc,assignment]

log = logging.getLogger("shmq.spark")

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


def record_lists(batches: Iterable[Any], opts: WriterOptions) -> Iterator[Any]:
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


def encode_list(recs: Iterable[Any], opts: WriterOptions) -> list[bytes]:
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
        pack, w, a = STAMP_STRUCT.pack, int(writer, 16), min(attempt, 0xFFFF)
        out = [pack(STAMP_MAGIC, w, batch, part, a, 0, row0 + k) + p
               for k, p in enumerate(encode_list(recs, opts))]
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
        for recs in record_lists(batches, opts):
            yield encode_list(recs, opts)
        return
    row = 0
    pending = None
    for recs in record_lists(batches, opts):
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
    sp = open_spool(opts.path, opts.options, create=opts.create)
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
    for b in record_lists(batches, opts):
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

    def __init__(self, options: Mapping[str, str], schema: Any) -> None:
        self.opts = WriterOptions(options, schema)
        self.writer_id = uuid.uuid4().hex[:16]  # one id per write job (created on the driver)

    def write(self, iterator: Iterator[Any]) -> ShmqCommitMessage:
        return _write_task(self.opts, iterator, self.writer_id, streaming=False)

    def commit(self, messages: list[Optional[WriterCommitMessage]]) -> None:
        _log_commit(messages, f"write {self.writer_id} to {self.opts.path}")

    def abort(self, messages: list[Optional[WriterCommitMessage]]) -> None:
        _log_abort(messages, f"write {self.writer_id} to {self.opts.path}")


class ShmqStreamWriter(_StreamWriterBase):
    """``df.writeStream.format("shmq")``: like :class:`ShmqWriter`, per micro-batch."""

    def __init__(self, options: Mapping[str, str], schema: Any) -> None:
        self.opts = WriterOptions(options, schema)
        self.writer_id = uuid.uuid4().hex[:16]  # replaced by the query id inside tasks

    def write(self, iterator: Iterator[Any]) -> ShmqCommitMessage:
        return _write_task(self.opts, iterator, self.writer_id, streaming=True)

    def commit(self, messages: list[Optional[WriterCommitMessage]], batchId: int) -> None:
        _log_commit(messages, f"micro-batch {batchId} to {self.opts.path}")

    def abort(self, messages: list[Optional[WriterCommitMessage]], batchId: int) -> None:
        _log_abort(messages, f"micro-batch {batchId} to {self.opts.path}")
