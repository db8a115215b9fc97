"""Arrow frames: the IPC stream to the byte, the batches shmq writes without pyarrow's
writer (plain columns, with or without nulls), the batches read without its stream
reader, corrupt frames."""

import numpy as np
import pytest

import shmq


def test_arrow_roundtrip_nulls_and_nested(make_spool):
    pa = pytest.importorskip("pyarrow")
    sp = make_spool(capacity="4MiB")
    table = pa.table({
        "i": pa.array([1, None, 3], pa.int64()),
        "s": ["a", None, "ccc"],
        "l": [[1, 2], None, []],
        "st": [{"x": 1.5, "y": "p"}, None, {"x": None, "y": "q"}],
        "m": pa.array([[("k", 1)], None, []], pa.map_(pa.string(), pa.int32())),
    })
    sp.put_arrow(table)
    sp.put_arrow(table.to_batches()[0])
    r = sp.reader()
    assert r.get_arrow(timeout=1).equals(table)
    with r.get_arrow(copy=False, timeout=1) as v:
        assert v.batch.equals(table)
    with pytest.raises(TypeError):
        sp.put_arrow({"not": "arrow"})


def put_each(pa, monkeypatch, sp, puts):
    """put_arrow each of ``puts``: [(its seq, whether pyarrow's writer wrote it)]."""
    new_stream = pa.ipc.new_stream
    calls = []
    monkeypatch.setattr(pa.ipc, "new_stream", lambda *a, **k: calls.append(1) or new_stream(*a, **k))
    done = []
    for d in puts:
        before = len(calls)
        done.append((sp.put_arrow(d), len(calls) > before))
    return done


def ipc_stream(data):
    """pyarrow's own IPC stream of a RecordBatch or Table, as bytes."""
    import pyarrow as pa
    sink = pa.BufferOutputStream()
    batches = data.to_batches() if isinstance(data, pa.Table) else [data]
    with pa.ipc.new_stream(sink, data.schema) as w:
        for b in batches:
            w.write_batch(b)
    return sink.getvalue().to_pybytes()


def test_arrow_frames_are_exactly_the_ipc_stream_whatever_the_schema(make_spool):
    # put_arrow sizes a frame by summing messages once a schema's first put has
    # checked that sum against a measured stream: dictionaries (their batches
    # travel too), schemas differing in metadata only, streams of no batches and
    # more schemas than it remembers must each still be framed to the byte.
    pa = pytest.importorskip("pyarrow")
    sp = make_spool(capacity="4MiB")

    plain = pa.record_batch({"a": pa.array([1, 2, 3], pa.int64()), "s": ["x", None, "zz"]})
    tagged = plain.replace_schema_metadata({"k": "a value that makes the schema message longer"})
    field_meta = pa.record_batch([plain.column(0)], schema=pa.schema([pa.field("a", pa.int64(), metadata={"u": "m"})]))
    dict_schema = pa.schema([pa.field("d", pa.dictionary(pa.int8(), pa.string()))])
    dicts = [pa.record_batch([pa.array(words).dictionary_encode()], schema=dict_schema)
             for words in (["p", "q", "p"], ["a much longer word", "r"])]
    many = [pa.record_batch({f"c{i}": pa.array(range(i + 1), pa.int32())}) for i in range(12)]
    puts = [plain, plain, pa.Table.from_batches([plain, plain]), tagged, plain, field_meta,
            pa.Table.from_batches([], schema=dict_schema), *dicts, dicts[0],
            pa.Table.from_batches([], schema=plain.schema), *many, plain, *many]
    seqs = [sp.put_arrow(d) for d in puts]
    r = sp.reader()
    for seq, data in zip(seqs, puts):
        frame = sp.read_at(seq)
        assert bytes(frame.data) == ipc_stream(data), seq
        got = r.get_arrow(timeout=1)
        want = data if isinstance(data, pa.Table) else pa.Table.from_batches([data])
        assert got.equals(want) and got.schema.metadata == want.schema.metadata


def test_plain_batches_are_written_without_pyarrows_writer_and_are_still_the_ipc_stream(make_spool, monkeypatch):
    # A batch of plain columns (fixed width, no nulls, no offsets) whose layout (schema,
    # rows) pyarrow's writer has written once is written by shmq itself: the remembered
    # messages, the buffers padded to 8 bytes, the end marker.  Each frame must be the
    # IPC stream to the byte, whatever path wrote it; the rest stays pyarrow's.
    pa = pytest.importorskip("pyarrow")
    from shmq import columnar
    monkeypatch.setattr(columnar, "_LAYOUTS", [])
    monkeypatch.setattr(columnar, "_SCHEMA_WIDTHS", [])
    sp = make_spool(capacity="8MiB")

    rng = np.random.default_rng(5)
    types = [pa.int8(), pa.uint16(), pa.int32(), pa.float32(), pa.float64(), pa.date32(),
             pa.timestamp("us", tz="UTC"), pa.duration("ns"), pa.float16()]
    def plain(rows, seed):  # each column: random floats, or integers of its width viewed as its type
        cols = [pa.array(rng.random(rows).astype(f"float{t.bit_width}")) if pa.types.is_floating(t)
                else pa.array(rng.integers(-99, 100, rows).astype(f"int{t.bit_width}")).view(t) for t in types]
        return pa.record_batch(cols, names=[f"c{i}" for i in range(len(types))])
    odd = [plain(7, s) for s in range(3)]                # pads after 1-, 2-, 4-byte columns
    big = [plain(65536, s) for s in range(2)]
    wide = [pa.record_batch({f"c{i}": pa.array([i, i + 1, i + 2], pa.int64()) for i in range(n)}) for n in (31, 32)]
    wide = [wide[0], wide[0], wide[1], wide[1]]  # 32 columns: more segments than a frame has
    spare = pa.Array.from_buffers(pa.int32(), 3, [None, pa.py_buffer(np.arange(8, dtype=np.int32))])
    not_plain = [
        odd[0].slice(1, 5), odd[0].slice(1, 5),                    # offsets
        pa.record_batch({"b": pa.array([True, False, True])}),     # bits, not bytes
        pa.record_batch({"s": pa.array(["x", "yy", "zzz"])}),      # variable width
        pa.record_batch([spare], names=["spare"]),                 # a buffer with room to spare
        pa.Table.from_batches([odd[0], odd[1]]),                   # more than one batch
    ]
    puts = [*odd, *big, *wide, *not_plain, pa.Table.from_batches([odd[2]]), odd[0], *not_plain]
    seqs = put_each(pa, monkeypatch, sp, puts)
    r = sp.reader()
    for (seq, by_pyarrow), data in zip(seqs, puts):
        assert bytes(sp.read_at(seq).data) == ipc_stream(data), seq
        want = data if isinstance(data, pa.Table) else pa.Table.from_batches([data])
        assert r.get_arrow(timeout=1).equals(want), seq
    by_pyarrow = [b for _, b in seqs]
    # each plain layout's first stream is pyarrow's, the rest shmq's; everything else pyarrow's
    assert by_pyarrow[:9] == [True, False, False, True, False, True, False, True, True]
    assert all(by_pyarrow[9:9 + len(not_plain)])
    assert by_pyarrow[9 + len(not_plain):11 + len(not_plain)] == [False, False]
    assert all(by_pyarrow[11 + len(not_plain):])
    # each schema's verdict is remembered: the widths of its columns, or None (never
    # plain), and a batch of a never-plain schema is not looked into
    def remembered(schema):
        return next(w for s, w in columnar._SCHEMA_WIDTHS if s.equals(schema))
    assert [remembered(d.schema) for d in (wide[2], not_plain[2], not_plain[3])] == [None] * 3
    assert remembered(odd[0].schema) == (1, 2, 4, 4, 8, 4, 8, 8, 2)
    assert remembered(not_plain[4].schema) == (4,)  # plain types, this batch's buffer not
    assert columnar._plain_buffers(pa, not_plain[3].schema, [object()]) is None


def test_arrow_frames_of_a_known_schema_read_only_their_batch(make_spool, monkeypatch):
    # A stream of one batch whose schema message was read before is read without
    # pyarrow's stream reader; every other stream with it, and the tables are the same.
    pa = pytest.importorskip("pyarrow")
    from shmq import columnar
    monkeypatch.setattr(columnar, "_SCHEMAS_READ", [])
    sp = make_spool(capacity="4MiB")
    one = pa.record_batch({"a": pa.array([1, None, 3], pa.int64()), "s": ["x", "yy", None]})
    tagged = one.replace_schema_metadata({"k": "v"})
    dictionary = pa.record_batch({"d": pa.array(["a", "b", "a"]).dictionary_encode()})
    puts = [one, one, pa.Table.from_batches([one, one]), tagged, tagged, dictionary, dictionary,
            pa.Table.from_batches([], schema=one.schema), one.slice(1, 2)]
    for d in puts:
        sp.put_arrow(d)
    open_stream = pa.ipc.open_stream
    calls = []
    monkeypatch.setattr(pa.ipc, "open_stream", lambda *a, **k: calls.append(1) or open_stream(*a, **k))
    r = sp.reader()
    by_reader = []
    for i, d in enumerate(puts):
        before = len(calls)
        got = r.get_arrow(timeout=1, copy=bool(i % 2))
        table = got if i % 2 else got.batch
        assert table.equals(d if isinstance(d, pa.Table) else pa.Table.from_batches([d]))
        assert table.schema.metadata == d.schema.metadata
        if not i % 2:
            got.release()
        by_reader.append(len(calls) > before)
    assert by_reader == [False, False, True, False, False, True, True, True, False]
    assert len(columnar._SCHEMAS_READ) == 3  # one's, tagged's, dictionary's (read, never fast)


@pytest.mark.parametrize("copy", [True, False])
def test_a_corrupt_arrow_frame_raises_shmqerror_and_the_next_frame_reads(make_spool, copy):
    pa = pytest.importorskip("pyarrow")
    from shmq import _format as F
    sp = make_spool(capacity="4MiB")
    batch = pa.record_batch({"a": pa.array(np.arange(100, dtype=np.int64)), "b": pa.array(np.arange(100) / 7)})
    good = ipc_stream(batch)
    at = 8 + int.from_bytes(good[4:8], "little")  # the batch's message starts here
    flipped = good[:at + 20] + bytes(b ^ 0xFF for b in good[at + 20:at + 60]) + good[at + 60:]
    schema_flipped = good[:16] + bytes(b ^ 0xFF for b in good[16:40]) + good[40:]
    bad = [b"", bytes(range(256)) * 2, good[:-50], good[:at + 300], flipped, schema_flipped]
    for b in bad:
        sp.put(b, codec=F.CODEC_ARROW)
        sp.put_arrow(batch)
    r = sp.reader()
    for _ in bad:
        with pytest.raises(shmq.ShmqError, match="corrupt Arrow frame"):
            r.get_arrow(timeout=1, copy=copy)
        got = r.get_arrow(timeout=1, copy=copy)
        table = got.batch if not copy else got
        assert table.equals(pa.Table.from_batches([batch]))
        if not copy:
            got.release()
    with pytest.raises(shmq.Empty):
        r.get_arrow(timeout=0)


@pytest.mark.parametrize("nbits", [0, 1, 7, 8, 9, 63, 64, 65, 1000, 8 * 4096 + 3])
def test_count_zero_bits_counts_a_validity_bitmaps_nulls(nbits):
    from shmq import _core
    rng = np.random.default_rng(nbits)
    bits = rng.random(nbits + 13) < 0.7  # bits past nbits (set or not) are not counted
    bitmap = np.packbits(bits, bitorder="little").tobytes()
    assert _core.count_zero_bits(bitmap, nbits) == int(nbits - bits[:nbits].sum())
    assert _core.count_zero_bits(memoryview(bitmap), nbits) == int(nbits - bits[:nbits].sum())
    with pytest.raises(ValueError, match="past the buffer"):
        _core.count_zero_bits(bitmap, len(bitmap) * 8 + 1)
    with pytest.raises(TypeError):
        _core.count_zero_bits("not a buffer", 1)


def test_plain_batches_with_nulls_are_written_by_shmq_with_their_null_counts(make_spool, monkeypatch):
    # Columns with nulls add their validity bitmaps to the stream and their null counts to
    # the batch message: a layout (schema, rows, bitmap sizes) learnt from one batch is
    # written by shmq for the next ones whatever their null counts, to the byte.
    pa = pytest.importorskip("pyarrow")
    pc = pytest.importorskip("pyarrow.compute")
    from shmq import columnar
    monkeypatch.setattr(columnar, "_LAYOUTS", [])
    monkeypatch.setattr(columnar, "_SCHEMA_WIDTHS", [])
    sp = make_spool(capacity="8MiB")
    rng = np.random.default_rng(7)
    types = [pa.int8(), pa.uint16(), pa.int32(), pa.float64()]

    def batch(rows, null_in, p=0.3, all_null=()):  # columns whose index is in null_in get nulls
        cols = []
        for i, t in enumerate(types):
            values = rng.integers(0, 100, rows).astype(t.to_pandas_dtype())
            mask = (rng.random(rows) < p) if i in null_in else None
            if i in all_null:
                mask = np.ones(rows, bool)
            cols.append(pa.array(values, type=t, mask=mask))
        return pa.record_batch(cols, names=[f"c{i}" for i in range(len(types))])

    def spare_bitmap(rows):  # a validity bitmap with room to spare: a layout of its own
        valid = np.packbits(rng.random(rows) > 0.5, bitorder="little").tobytes() + b"\xff" * 56
        data = pa.py_buffer(rng.random(rows).tobytes())
        col = pa.Array.from_buffers(pa.float64(), rows, [pa.py_buffer(valid), data])
        return pa.record_batch([col], names=["x"])

    plain = batch(1000, ())
    filled = pa.record_batch([pc.fill_null(c, 0) for c in batch(1000, (0, 3)).columns], names=plain.schema.names)
    assert filled.column(0).buffers()[0] is not None and filled.column(0).null_count == 0
    puts = [
        batch(1000, (1, 3)), batch(1000, (1, 3)), batch(1000, (1, 3), p=0.9),  # one layout, other null counts
        batch(7, (0,)), batch(7, (0,)),                                      # a bitmap of one byte, padded
        batch(1000, (2,)), batch(1000, (2,), all_null=(2,)),                 # every row null
        plain, filled,                                                       # a bitmap but no nulls: no bitmap
        spare_bitmap(33), spare_bitmap(33),
    ]
    wide = pa.record_batch({f"c{i}": pa.array([i, None, 2], pa.int64()) for i in range(31)})
    puts += [wide, wide]  # a bitmap and its pad more a column: more segments than a frame has
    by_pyarrow = put_each(pa, monkeypatch, sp, puts)
    assert [b for _, b in by_pyarrow] == [True, False, False, True, False, True, False, True, False,
                                          True, False, True, True]
    r = sp.reader()
    for (seq, _), data in zip(by_pyarrow, puts):
        assert bytes(sp.read_at(seq).data) == ipc_stream(data), seq
        got = r.get_arrow(timeout=1)
        assert got.equals(pa.Table.from_batches([data])), seq
        assert [c.null_count for c in got.columns] == [c.null_count for c in data.columns]
