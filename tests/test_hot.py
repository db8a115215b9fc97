"""The hot region of a fixed ring (shmq/engine/write.c, hot_place; docs/format.md,
"The hot region of a fixed ring"): while its consumers keep up, a fixed block/error
ring reuses its first 8 MiB (or 2 batches) instead of striding through all of its
memory; a consumer that falls behind gets the whole ring as before.
"""

import threading

import numpy as np
import pytest

import shmq
from shmq import _format as F

from conftest import bound

RING = 32 << 20
HOT = 8 << 20
FRAME = 128 << 10  # 2 * FRAME < HOT: the hot region is HOT


def _offset(sp):
    return sp.mapping.ctl[F.W_NEXT_POS] % RING


def _payload(i):
    return i.to_bytes(8, "little") * (FRAME // 8)


@pytest.mark.parametrize("on_full", ["block", "error"])
def test_a_ring_whose_reader_keeps_up_reuses_its_hot_region(make_spool, on_full):
    sp = make_spool(capacity=RING, on_full=on_full)
    r = sp.reader("r")
    top = 0
    for i in range(600):  # 75 MiB through a 32 MiB ring
        sp.put(_payload(i))
        assert r.get(timeout=bound(10)).data == _payload(i)
        top = max(top, _offset(sp))
    assert top <= HOT + FRAME + F.FRAME_BYTES  # never past the hot region (and the batch ending it)
    assert sp.mapping.ctl[F.W_NEXT_POS] > 2 * RING  # yet 75 MiB went through
    r.close()


def test_a_reader_that_falls_behind_gets_the_whole_ring_then_the_writer_comes_back(make_spool):
    sp = make_spool(capacity=RING, on_full="block")
    r = sp.reader("r")
    for i in range(8):  # warm: a few hot laps
        sp.put(_payload(i))
        r.get(timeout=bound(10))
    n = 100  # 12.5 MiB of backlog: more than the hot region, less than the ring
    for i in range(n):
        sp.put(_payload(i))
    assert _offset(sp) > HOT + FRAME  # the backlog took the ring beyond the hot region
    for i in range(n):
        assert r.get(timeout=bound(10)).data == _payload(i)  # nothing lost or torn
    assert r.lost == 0
    for i in range(300):  # caught up: back to the hot region within a lap
        sp.put(_payload(i))
        r.get(timeout=bound(10))
    assert _offset(sp) <= HOT + FRAME + F.FRAME_BYTES
    r.close()


def test_overwrite_rings_stay_sequential(make_spool):
    sp = make_spool(capacity=RING, on_full="overwrite")
    r = sp.reader("r")
    top = 0
    for i in range(300):
        sp.put(_payload(i))
        r.get(timeout=bound(10))
        top = max(top, _offset(sp))
    assert top > RING - 2 * FRAME  # the whole ring
    r.close()


def test_a_pinned_frame_at_the_lap_start_keeps_the_writer_out(make_spool):
    sp = make_spool(capacity=RING, on_full="block")
    r = sp.reader("r")
    arr = np.arange(FRAME // 8, dtype=np.int64)
    for _ in range(150):  # a few laps of the hot region
        sp.put_array(arr)
        r.get_array()
    prev = _offset(sp)
    while True:  # until a put starts a lap
        sp.put_array(arr)
        r.get_array()
        if _offset(sp) < prev:
            break
        prev = _offset(sp)
    r.seek(sp.next_seq - 1)  # back to that frame, at the lap's start
    with r.get_array(copy=False) as v:  # ... pinned
        for _ in range(90):  # the writer passes the hot region: it may not wrap onto the pin
            sp.put_array(arr * 2)
            got = r.get_array()
            assert np.array_equal(got, arr * 2)
        assert np.array_equal(v.array, arr)  # the pinned frame was never overwritten
        assert _offset(sp) > HOT
    r.close()


def test_threads_put_and_get_through_the_hot_region_in_order(make_spool):
    sp = make_spool(capacity=RING, on_full="block")
    r = sp.reader("r")
    n, errors = 2000, []

    def produce():
        try:
            with shmq.Spool.open(sp.path) as w:
                for i in range(n):
                    w.put(_payload(i)[: 1000 + i % 7 * 5000])
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=produce)
    t.start()
    for i in range(n):
        assert r.get(timeout=bound(30)).data == _payload(i)[: 1000 + i % 7 * 5000]
    t.join(bound(30))
    assert not errors and r.lost == 0
    r.close()
