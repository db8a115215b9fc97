"""Columnar frames: numpy arrays and Arrow record batches, read zero-copy.

A numpy frame (codec "numpy") is::

    u32 descriptor length, u32 reserved, descriptor (JSON: dtype descr, shape),
    zero padding to a multiple of 8, the array's bytes (C order)

An Arrow frame (codec "arrow") is one Arrow IPC *stream* (schema + one record
batch per put), so any Arrow implementation can read it.

``copy=False`` returns a :class:`PinnedView`: a read-only view straight into
the mapping whose frame is *pinned*: writers do not overwrite it (they wait,
in every ``on_full`` mode, or raise ``Full`` after their timeout) until the
view is released (``with``, ``release()``, or garbage collection).  Pins
live in the spool's reader table with an fcntl liveness lock, so the pins
of a process that dies are released by the next writer that needs the room.

``seq`` stays per frame (per batch): a batch of 1,000 records is one frame
with one seq, so ``lost``, ``stats()`` and the CLI count batches.  Per-record
seqs would cost a 32-byte header per record (a third of a 100-byte record)
or a second numbering the lock-free readers could not check cheaply.

Layers: this module sits above the parts that carry bytes and never calls
back into the facade.  ``Spool.put_array`` takes its encoding
(:func:`encode_array`) to the core's put, ``Spool.put_arrow`` and
``put_many`` of records hand it the spool's writer
(:class:`shmq.writer.Writer`), and ``Reader.get_array`` the bytes it took
(and the spool's pins and ring): the waiting, the cursor and the locks stay
the spool's and the reader's, and this module only encodes, decodes and
pins.  It imports neither spool nor reader.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from . import _core
from . import _format as F
from .errors import Empty, ShmqError
from .writer import Deferred

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer

    from .pins import Pins
    from .ring import Ring
    from .writer import Writer

__all__ = ["PinnedView", "encode_array", "decode_array", "decode_numpy", "decode_arrow", "private_copy",
           "put_records", "put_arrow", "view_of", "records_run", "peek_dtype", "join_records"]

_HEAD = struct.Struct("<II")
_HEADS: dict[tuple[np.dtype[Any], tuple[int, ...]], bytes] = {}  # (dtype, shape) -> encoded header: JSON costs ~10 us, batches repeat
# descriptor bytes -> (dtype, shape, data offset, item count, payload size)
_DESCS: dict[bytes, tuple[np.dtype[Any], tuple[int, ...], int, int, int]] = {}


def encode_array(arr: npt.NDArray[Any]) -> tuple[bytes, Any]:
    """Frame segments for ``arr``: ``(header, data)``; the data is not copied if contiguous.

    :raises TypeError: not an array, or an object dtype (it would need pickling).
    """
    if not isinstance(arr, np.ndarray):
        raise TypeError(f"put_array() takes a numpy array, not {type(arr).__name__}")
    if arr.dtype.hasobject:
        raise TypeError(f"dtype {arr.dtype} holds Python objects; put_array() moves raw bytes only "
                        "(use shmq.Queue, which pickles, or convert the column)")
    if not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr)  # one extra copy, documented
    key = (arr.dtype, arr.shape)
    head = _HEADS.get(key)
    if head is None:
        desc = json.dumps({"descr": np.lib.format.dtype_to_descr(arr.dtype),
                           "shape": list(arr.shape)}).encode()
        head = _HEAD.pack(len(desc), 0) + desc
        head += bytes(F.align(len(head)) - len(head))
        if len(_HEADS) > 256:
            _HEADS.clear()
        _HEADS[key] = head
    if not arr.size:
        return head, b""
    if arr.dtype.kind in "biufc":  # numbers export their bytes as they are
        return head, arr
    # as bytes: some dtypes (datetime64, ...) do not export the buffer protocol
    return head, memoryview(arr.reshape(-1).view(np.uint8))  # type: ignore[arg-type,unused-ignore]


def private_copy(data: Any) -> bool:
    """Whether ``data`` is a reader's own writable copy of a numpy or out-of-band
    payload (a ``bytearray``, or from 4 MiB a memoryview over a ``_core.LargeCopy``),
    rather than a view of the mapping or someone else's buffer: objects rebuilt
    over it may keep it and write to it."""
    return type(data) is bytearray or (type(data) is memoryview and type(data.obj) is _core.LargeCopy)


def decode_numpy(buf: ReadableBuffer) -> npt.NDArray[Any]:
    """:func:`decode_array` of a frame's payload as a reader took it: writable over a
    private copy (:func:`private_copy`), read-only over the mapping."""
    return decode_array(buf, writable=private_copy(buf))


def decode_array(buf: ReadableBuffer, writable: bool = False) -> npt.NDArray[Any]:
    """The array stored in a numpy frame's payload ``buf`` (a view over it, no copy).

    :raises shmq.ShmqError: not a numpy frame payload, or inconsistent sizes.
    """
    mv = memoryview(buf)
    if len(mv) < _HEAD.size:
        raise ShmqError("numpy frame too short")
    n, _r = _HEAD.unpack_from(mv)
    raw = bytes(mv[_HEAD.size:_HEAD.size + n])
    parsed = _DESCS.get(raw)
    if parsed is None:
        try:
            desc = json.loads(raw)
            d = desc["descr"]
            dtype = np.lib.format.descr_to_dtype([tuple(x) for x in d] if isinstance(d, list) else d)
            shape = tuple(int(x) for x in desc["shape"])
        except (ValueError, KeyError, TypeError) as exc:
            raise ShmqError(f"numpy frame with a corrupt descriptor: {exc}") from None
        if any(x < 0 for x in shape):
            raise ShmqError(f"numpy frame with a negative dimension in its shape {shape}")
        if dtype.hasobject:  # object pointers from shared memory: never (docs/security.md)
            raise ShmqError("numpy frame with an object dtype: refused (frames carry no pointers)")
        if len(_DESCS) > 256:
            _DESCS.clear()
        off = F.align(_HEAD.size + n)
        count = math.prod(shape)  # Python ints (np.prod takes 4 us of a 12 us view)
        parsed = _DESCS[raw] = (dtype, shape, off, count, off + count * dtype.itemsize)
    dtype, shape, off, count, size = parsed
    if size != len(mv):
        raise ShmqError("numpy frame: descriptor and payload sizes disagree")
    arr = np.frombuffer(mv, dtype=dtype, count=count, offset=off)
    if len(shape) != 1:
        arr = arr.reshape(shape)
    if not writable:
        arr.flags.writeable = False
    return arr


class PinnedView:
    """A zero-copy view into a spool; its frame cannot be overwritten until released.

    Use as a context manager, or call :meth:`release`.  ``obj`` is the numpy
    array (read-only) or the pyarrow object.  After release, using ``obj``
    is undefined (the bytes may be overwritten): copy what you keep.  The
    one exception: a reader lapped in overwrite mode gets the frame after
    its loss from the core's get, copied, and then the view is over that
    private copy (nothing pinned; release only drops it).
    """

    __slots__ = ("obj", "seq", "_pins", "_pos", "_view", "__weakref__")
    _pins: Pins | None

    def __init__(self, obj: Any, seq: int, pins: Pins, pos: int | None, view: Any) -> None:
        # pos None: over a private copy (nothing pinned); pins: the spool's (shmq.pins.Pins)
        self.obj, self.seq, self._pins, self._pos, self._view = obj, seq, pins, pos, view

    @property
    def array(self) -> Any:
        return self.obj

    @property
    def batch(self) -> Any:
        return self.obj

    def release(self) -> None:
        """Unpin the frame (idempotent)."""
        if self._pins is not None:
            pins, self._pins = self._pins, None
            self.obj = None
            if self._pos is None:
                return  # a copy: nothing to unpin
            try:
                self._view.release()
            except BufferError:
                pass  # still referenced (e.g. by Arrow arrays the caller kept): drop ours only
            pins.unpin(self._pos)

    def __enter__(self) -> PinnedView:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:
        try:
            self.release()
        except Exception:
            pass

    def __repr__(self) -> str:
        state = "released" if self._pins is None else "pinned" if self._pos is not None else "copied"
        return f"<shmq.PinnedView seq={self.seq} {state}>"


# --- writing: into the spool's writer (shmq.writer.Writer, a part below the facade) ---
# ``timeout`` is the validated one (0: do not wait for room; None: forever).


def put_records(writer: Writer, arr: npt.NDArray[Any], timeout: float | None, *,
                max_frame_bytes: int | None = None) -> int:
    """Append a structured (or any 1-d) array as consecutive frames of whole records, atomically.

    Frames hold at most ``max_frame_bytes`` of records (default: a quarter of
    the ring); returns the first seq.
    """
    if not isinstance(arr, np.ndarray) or arr.ndim != 1:
        raise TypeError("put_many() of records takes a 1-d numpy array")
    limit = max_frame_bytes or max(arr.dtype.itemsize, writer.ring_bytes // 4)
    per = max(1, limit // max(1, arr.dtype.itemsize))
    parts = tuple(encode_array(arr[i:i + per]) for i in range(0, max(len(arr), 1), per))
    return writer.append(parts, timeout, F.CODEC_NUMPY)


def _arrow() -> Any:
    try:
        import pyarrow as pa
    except ImportError:  # optional dependency
        raise ImportError("Arrow frames need pyarrow: pip install 'shmq[spark]' or pyarrow") from None
    return pa


#: Recent schemas and their streams' fixed part: [(schema, bytes of a stream of no batches, or
#: -1 if its streams carry more than their messages: measured on every put)].  A few, as a
#: producer may alternate schemas.
_STREAM_BASES: list[tuple[Any, int]] = []
_STREAM_BASES_MAX = 8


def _stream_size(pa: Any, schema: Any, batches: list[Any], write: Callable[[Any], None]) -> int:
    """The exact size of the IPC stream ``write`` writes.  A stream is the schema message,
    one message per batch and an end marker, unless the schema has dictionaries (their
    batches travel too).  Which of the two a schema's streams are is found once, on its
    first put of a batch: a mock write (6 us for 10 columns) against the sum of the
    messages (1 us), which serves from then on when they agree."""
    base = next((b for s, b in _STREAM_BASES if s is schema or s.equals(schema, check_metadata=True)), None)
    if base is not None and base >= 0:
        return base + sum(pa.ipc.get_record_batch_size(b) for b in batches)
    mock = pa.MockOutputStream()  # measures the IPC size without copying data
    write(mock)
    size = mock.size()
    if base is None and batches:  # a stream of no batches writes no dictionaries: it tells nothing
        empty = pa.MockOutputStream()
        with pa.ipc.new_stream(empty, schema):
            pass
        summed = empty.size() + sum(pa.ipc.get_record_batch_size(b) for b in batches)
        if len(_STREAM_BASES) >= _STREAM_BASES_MAX:
            del _STREAM_BASES[0]
        _STREAM_BASES.append((schema, empty.size() if summed == size else -1))
    return size


# A stream of one batch of plain columns (fixed-width, byte-aligned, no slice offsets) is
# its messages, then each column's buffers padded to 8 bytes (its validity bitmap if it
# has nulls, then its data), then the end marker.  Its messages depend only on the schema,
# the row count and the bitmaps' sizes, but for each column's null count, so once
# pyarrow's writer has written a stream of that layout, and the stream checked to be
# exactly that, shmq writes the next ones itself: the messages (the null counts written
# in), then the buffers as segments of one core put, which skips pyarrow's writer's own
# work per batch (docs/columnar.md has the figures).

#: Recent layouts: [(schema, rows, the size of each column's validity bitmap (0: it has no
#: nulls, so the stream has none) or None if no column has nulls, the stream's bytes
#: before the first buffer or None: its streams are not that (pyarrow's writer writes
#: them), the zero bytes that follow each buffer (None where it needs none) or None if no
#: buffer needs any, where the messages hold the first column's null count (None: no nulls))].
Layout = tuple[Any, int, tuple[int, ...] | None, bytes | None, tuple[memoryview | None, ...] | None, int | None]
_LAYOUTS: list[Layout] = []
_LAYOUTS_MAX = 8
_ZEROS = memoryview(bytes(8))
_CONTINUATION = b"\xff\xff\xff\xff"  # what every message of a stream starts with
_EOS = _CONTINUATION + bytes(4)  # the end-of-stream marker: continuation, length 0
_NULL_COUNT = struct.Struct("<q")  # a FieldNode is (length, null_count), little-endian int64s


#: Recent schemas and the byte width of each of their columns, or None when shmq never
#: writes their batches itself (nested, dictionary, variable-width or bit-packed columns,
#: or more than a put has segments for): looking at a schema's types costs about 1.3 us
#: a column, so it is done once.
_SCHEMA_WIDTHS: list[tuple[Any, tuple[int, ...] | None]] = []


def _widths(pa: Any, schema: Any) -> tuple[int, ...] | None:
    """The byte width of each column of ``schema`` if all are plain, else None (remembered)."""
    for s, widths in _SCHEMA_WIDTHS:
        if s is schema or s.equals(schema):
            return widths
    types = [field.type for field in schema]
    plain = 2 * len(types) + 2 <= _core.MAX_SEGMENTS and all(  # messages, buffers and pads, end marker
        not t.num_fields and not pa.types.is_dictionary(t) and pa.types.is_primitive(t) and not t.bit_width % 8
        for t in types)
    found = tuple(t.bit_width // 8 for t in types) if plain else None
    if len(_SCHEMA_WIDTHS) >= _LAYOUTS_MAX:
        del _SCHEMA_WIDTHS[0]
    _SCHEMA_WIDTHS.append((schema, found))
    return found


def _plain_buffers(pa: Any, schema: Any, batches: list[Any]) -> tuple[list[Any], tuple[int, ...] | None,
                                                                     tuple[int, ...] | None] | None:
    """A single batch of plain columns: its buffers in stream order (each column's validity
    bitmap if it has nulls, then its data), each column's bitmap size (0: no nulls) and
    each column's null count, both None when no column has nulls; None when the data is
    not that (pyarrow's writer writes the stream)."""
    if len(batches) != 1:
        return None
    widths = _widths(pa, schema)
    if widths is None:
        return None
    batch = batches[0]
    rows = batch.num_rows
    if rows == 0:
        return None
    try:
        bufs = batch.to_struct_array().buffers()  # [struct validity, (validity, data) per column]
    except (AttributeError, pa.ArrowException):  # an older pyarrow, a type without one
        return None
    if bufs[0] is not None or len(bufs) != 1 + 2 * len(widths):
        return None
    data = bufs[2::2]
    for width, buf in zip(widths, data):
        if buf is None or buf.size != rows * width:  # a larger buffer is a slice or has spare room (offset 0 iff equal)
            return None
    bitmaps = bufs[1::2]
    if not any(bitmaps):
        return data, None, None
    if any(v is not None and v.size * 8 < rows for v in bitmaps):
        return None
    # A bitmap of a column without nulls is not in the stream (pyarrow's writer leaves it out).
    counts = tuple(0 if v is None else _core.count_zero_bits(v, rows) for v in bitmaps)
    if not any(counts):
        return data, None, None
    stream: list[Any] = []
    for v, n, buf in zip(bitmaps, counts, data):
        if n:
            stream.append(v)
        stream.append(buf)
    if 2 * len(stream) + 2 > _core.MAX_SEGMENTS:  # messages, buffers and pads, end marker
        return None
    return stream, tuple(v.size if n else 0 for v, n in zip(bitmaps, counts)), counts


def _layout(schema: Any, rows: int, bitmaps: tuple[int, ...] | None) -> Layout | None:
    """The remembered layout of ``rows`` rows of ``schema`` (metadata included) with these
    bitmaps, or None."""
    return next((e for e in _LAYOUTS
                 if e[1] == rows and e[2] == bitmaps and (e[0] is schema or e[0].equals(schema, check_metadata=True))),
                None)


def _learn_layout(pa: Any, schema: Any, rows: int, bitmaps: tuple[int, ...] | None, counts: tuple[int, ...] | None,
                  view: memoryview, bufs: list[Any]) -> None:
    """Remember the messages of the stream pyarrow wrote into ``view`` if the stream is
    exactly them, then ``bufs`` each padded to 8 zero bytes, then the end marker, and (if
    a column has nulls) the messages hold the columns' FieldNodes exactly once; else
    remember that this layout's streams are not that."""
    written = pa.py_buffer(view)
    prefix = pads = counts_at = None
    at = 0
    for _ in range(2):  # the schema message, then the batch's: continuation, length, metadata
        if view[at:at + 4] != _CONTINUATION:
            break
        schema_end, at = at, at + 8 + int.from_bytes(view[at + 4:at + 8], "little")
    else:
        pos, same = at, True
        for b in bufs:
            end = pos + b.size
            pad = -b.size % 8
            same = same and written.slice(pos, b.size).equals(b) and view[end:end + pad] == bytes(pad)
            pos = end + pad
        if counts is not None and same:
            # The batch message's vector of FieldNodes (length, null count), one a column.
            nodes = b"".join(struct.pack("<qq", rows, n) for n in counts)
            message = bytes(view[schema_end:at])
            found = message.find(nodes)
            same = found >= 0 and message.find(nodes, found + 1) < 0
            counts_at = schema_end + found + 8
        if same and pos + 8 == len(view) and view[pos:] == _EOS:
            prefix = bytes(view[:at])
            # each buffer's size is the layout's (_plain_buffers checks rows * width; bitmaps' are in the key)
            each = tuple(_ZEROS[:-b.size % 8] if b.size % 8 else None for b in bufs)
            pads = each if any(p is not None for p in each) else None
        else:
            counts_at = None
    if len(_LAYOUTS) >= _LAYOUTS_MAX:
        del _LAYOUTS[0]
    _LAYOUTS.append((schema, rows, bitmaps, prefix, pads, counts_at))


def put_arrow(writer: Writer, data: Any, timeout: float | None) -> int:
    """Append a pyarrow RecordBatch or Table as one Arrow IPC stream frame."""
    pa = _arrow()
    if isinstance(data, pa.Table):
        batches = data.to_batches()
        schema = data.schema
    elif isinstance(data, pa.RecordBatch):
        batches, schema = [data], data.schema
    else:
        raise TypeError(f"put_arrow() takes a pyarrow RecordBatch or Table, not {type(data).__name__}")

    plain = _plain_buffers(pa, schema, batches)
    known = None
    if plain is not None:
        bufs, bitmaps, counts = plain
        known = _layout(schema, batches[0].num_rows, bitmaps)
        if known is not None and known[3] is not None:
            prefix: bytes | bytearray = known[3]
            at = known[5]
            if counts is not None and at is not None:  # the learnt stream's null counts, this batch's written in
                prefix = bytearray(prefix)
                for i, n in enumerate(counts):
                    if n:
                        _NULL_COUNT.pack_into(prefix, at + 16 * i, n)
            pads = known[4]
            if pads is None:
                segments = (prefix, *bufs, _EOS)
            else:
                parts: list[Any] = [prefix]
                for b, pad in zip(bufs, pads):
                    parts.append(b)
                    if pad is not None:
                        parts.append(pad)
                parts.append(_EOS)
                segments = tuple(parts)
            return writer.append((segments,), timeout, F.CODEC_ARROW)

    def write(sink: Any) -> None:
        with pa.ipc.new_stream(sink, schema) as writer:
            for b in batches:
                writer.write_batch(b)

    size = _stream_size(pa, schema, batches, write)

    def fill(view: memoryview) -> None:  # under the writer lock: the IPC stream goes straight into the ring
        sink = pa.FixedSizeBufferWriter(pa.py_buffer(view))
        write(sink)
        if sink.tell() != size:
            raise ShmqError(f"Arrow IPC size changed while writing ({sink.tell()} != {size})")
        if plain is not None and known is None:
            _learn_layout(pa, schema, batches[0].num_rows, plain[1], plain[2], view, plain[0])

    return writer.append((Deferred(size, fill),), timeout, F.CODEC_ARROW)


#: Recent schema messages read, as [(the message's bytes, the schema)]: a stream whose
#: schema message is one of them is not parsed for its schema again (about 6 us).
_SCHEMAS_READ: list[tuple[bytes, Any]] = []


def decode_arrow(buf: ReadableBuffer) -> Any:
    """The pyarrow Table of an Arrow IPC stream, over ``buf``'s memory (no copy).

    A stream of one record batch whose schema message was read before (the same bytes)
    reads only its batch's message; any other stream (several batches, dictionaries, a
    schema not seen, bytes that do not parse that way) is read by pyarrow's stream
    reader, whose verdict on a corrupt frame stands.

    :raises shmq.ShmqError: not an Arrow IPC stream pyarrow can read.
    """
    pa = _arrow()
    data = pa.py_buffer(buf)
    table = _one_batch(pa, data)
    if table is not None:
        return table
    try:
        return pa.ipc.open_stream(data).read_all()
    except (pa.ArrowException, ValueError, OSError) as exc:  # pyarrow's IO errors are OSErrors
        raise ShmqError(f"corrupt Arrow frame: {exc}") from None


def _one_batch(pa: Any, data: Any) -> Any:
    """The Table of ``data`` if it is a remembered schema's message, one record batch's
    message and the end marker, exactly; else None."""
    view = memoryview(data).cast("B")  # pyarrow's buffers are signed chars
    size = len(view)
    if size < 16 or view[:4] != _CONTINUATION:
        return None
    at = 8 + int.from_bytes(view[4:8], "little")  # past the schema message
    if at + 16 > size:
        return None
    head = view[:at].tobytes()
    for known, schema in _SCHEMAS_READ:
        if known == head:
            break
    else:
        try:
            schema = pa.ipc.read_schema(data)
        except (pa.ArrowException, ValueError, OSError):
            return None
        if len(_SCHEMAS_READ) >= _LAYOUTS_MAX:
            del _SCHEMAS_READ[0]
        _SCHEMAS_READ.append((head, schema))
    try:
        msg = pa.ipc.read_message(data.slice(at))
        if msg.type != "record batch":
            return None
        end = at + 8 + int.from_bytes(view[at + 4:at + 8], "little") + msg.body.size
        if end + 8 != size or view[end:] != _EOS:
            return None
        return pa.Table.from_batches([pa.ipc.read_record_batch(msg, schema)], schema)
    except (pa.ArrowException, ValueError, OSError):
        return None


# --- reading: what a reader took (the reader waits, moves its cursor, holds its locks) ---


def view_of(pins: Pins, seq: int, payload: Any, codec: int, pos: int | None, copy: bool, want: int,
            decode: Callable[[Any], Any]) -> Any:
    """A frame a reader took, decoded by ``decode``: over a private copy, or (``copy=False``)
    a :class:`PinnedView` holding the pin the reader took at ``pos`` (None: a copy, as a
    reader lapped in overwrite mode gets: a view all the same, pinning nothing, so the
    caller's code holds).

    :raises shmq.ShmqError: the frame is not of codec ``want`` (it was consumed).
    """
    try:
        if codec != want:
            name = F.CODEC_NAMES.get(codec, codec)
            raise ShmqError(f"frame {seq} is a {name} frame, not {F.CODEC_NAMES[want]} "
                            "(it was consumed; read mixed spools with get())")
        obj = decode(payload)
    except BaseException:
        if pos is not None:
            pins.unpin(pos)  # nothing will release a view we never return
        raise
    if pos is None and copy:
        return obj
    return PinnedView(obj, seq, pins, pos, payload)


def join_records(parts: list[npt.NDArray[Any]]) -> npt.NDArray[Any]:
    """One array of the record runs a reader took (no copy for one)."""
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def records_run(ring: Ring, seq: int, pos: int, max_frames: int,
                dtype: np.dtype[Any] | None) -> tuple[npt.NDArray[Any], int, int] | None:
    """Copy the run of plain numpy frames at cursor ``(seq, pos)`` of ``ring`` into one array:
    ``(array, seq, pos)`` past the run (where the reader moves its cursor), or None if
    there is none (or it was overwritten while copying).

    Lock-free like the engine's reads: views over the mapping are concatenated
    (the one copy), then FIRST_POS is re-checked against the run's start.
    """
    nxt = ring.next_seq
    arrays: list[npt.NDArray[Any]] = []
    start = None
    while len(arrays) < max_frames and seq < nxt:
        hit = ring.frame_at(seq, pos)
        if hit is None or hit.codec != F.CODEC_NUMPY:
            break
        try:
            arr = decode_array(ring.payload(hit))
        except ShmqError:
            break
        if dtype is None:
            dtype = arr.dtype
        elif arr.dtype != dtype:
            break
        if start is None:
            start = hit.pos
        arrays.append(arr.reshape(-1))
        seq, pos = seq + 1, hit.pos + hit.stored
    if not arrays:
        return None
    out = np.concatenate(arrays) if len(arrays) > 1 else arrays[0].copy()
    if not ring.still_there(start):  # overwritten while copying: take the slow path
        return None
    return out, seq, pos


def peek_dtype(ring: Ring, seq: int, pos: int) -> np.dtype[Any]:
    """dtype of the numpy frame at cursor ``(seq, pos)``, without consuming it.

    :raises shmq.Empty: no frame there yet, or not a numpy frame.
    """
    if seq >= ring.next_seq:
        raise Empty
    hit = ring.header_at(ring.frame_pos(pos))
    if hit is None or hit.seq != seq or hit.codec != F.CODEC_NUMPY:
        raise Empty
    return _dtype_of(ring.payload(hit))


def _dtype_of(mv: memoryview) -> np.dtype[Any]:
    """dtype from a numpy frame's descriptor alone (the data is not touched)."""
    try:
        n, _r = _HEAD.unpack_from(mv)
        desc = json.loads(bytes(mv[_HEAD.size:_HEAD.size + n]))
        d = desc["descr"]
        return np.lib.format.descr_to_dtype([tuple(x) for x in d] if isinstance(d, list) else d)
    except (ValueError, KeyError, TypeError, struct.error):
        raise Empty from None

