"""The spool's parts through their public methods: ring I/O, the reader table, pins,
the write path and the waiting helpers (what reader, columnar, workqueue, dump and
the CLI build on)."""

import asyncio
import time

import pytest

import shmq
from shmq import _core
from shmq import _format as F
from shmq import waiting
from shmq.ring import HeaderHit, header_at, raw_header_at
from shmq.writer import Deferred


# --- ring ---------------------------------------------------------------------


def test_header_at_and_payload_describe_a_committed_frame(make_spool):
    sp = make_spool(capacity=8192)
    sp.put(b"hello", codec=F.CODEC_UTF8)
    hit = sp.ring.header_at(sp.ring.first_pos)
    assert type(hit) is HeaderHit
    seq, pos, stored, length, ts, crc, flags, codec = hit  # still a tuple, in this order
    assert hit._fields == ("seq", "pos", "stored", "length", "ts", "crc", "flags", "codec")
    assert (hit.seq, hit.pos, hit.stored, hit.length, hit.ts, hit.crc, hit.flags,
            hit.codec) == (seq, pos, stored, length, ts, crc, flags, codec)
    assert (seq, length, codec, flags & F.FLAG_PAD) == (0, 5, F.CODEC_UTF8, 0)
    assert stored == F.frame_stored_bytes(5) and ts > 0
    assert bytes(sp.ring.payload(hit)) == b"hello"
    assert sp.ring.frame_at(0, pos) == hit
    assert sp.ring.frame_at(1, pos) is None  # another frame's header
    # the module function is the same decoder (fsck uses it on a bare mapping)
    assert header_at(sp.mapping.mm, sp.ring.base, sp.ring.size, pos) == hit


def test_header_at_refuses_out_of_bounds_lengths(make_spool):
    sp = make_spool(capacity=8192)
    sp.put(b"x" * 10)
    o = sp.ring.base
    F.FRAME.pack_into(sp.mapping.mm, o, 0, 1 << 20, 10, 1, 0, 0, 0, 0)  # stored > ring
    assert sp.ring.header_at(0) is None
    assert sp.ring.frame_at(0, 0) is None
    # the unchecked decoder (fsck's, to report the bad lengths) still decodes it
    raw = raw_header_at(sp.mapping.mm, o, sp.ring.size, 0)
    assert type(raw) is HeaderHit and (raw.seq, raw.pos, raw.stored, raw.length) == (0, 0, 1 << 20, 10)


def test_header_decoders_refuse_a_ring_outside_the_buffer(make_spool):
    sp = make_spool(capacity=8192)
    size = sp.ring.size
    for base in (2**64 - size, 2**64 - 8):  # base + size wraps: would pass the buffer bound
        with pytest.raises(ValueError, match="overflow"):
            header_at(sp.mapping.mm, base, size, 0)
        with pytest.raises(ValueError, match="overflow"):
            _core.frame_at(sp.mapping.mm, base, size, 0, 0)
    with pytest.raises(ValueError, match="does not hold"):
        header_at(sp.mapping.mm, len(sp.mapping.mm), size, 0)


def test_header_decoders_follow_the_short_tail_skip(make_spool):
    sp = make_spool(capacity=8192)
    sp.put(b"x")
    size, tail = sp.ring.size, sp.ring.size - F.FRAME_BYTES + 8  # fewer than a header's bytes left
    for pos in (tail, size + tail):
        hit = raw_header_at(sp.mapping.mm, sp.ring.base, size, pos)
        assert hit.pos == pos - pos % size + size and hit.seq == 0  # the header at offset 0
        assert header_at(sp.mapping.mm, sp.ring.base, size, pos) == hit


def test_frame_pos_skips_the_padding_before_a_wrapped_frame(make_spool):
    sp = make_spool(capacity=4096)
    sp.put(b"a" * 4000)  # leaves a tail too short for the next frame
    r = sp.reader()
    r.get(timeout=1)
    sp.put(b"b" * 100)  # evicts the first frame, padded tail, wraps to 0
    seq, pos = r.cursor()
    assert pos % sp.capacity != 0  # the cursor sits at the pad
    fpos = sp.ring.frame_pos(pos)
    assert fpos % sp.capacity == 0
    hit = sp.ring.frame_at(seq, pos)
    assert hit is not None and bytes(sp.ring.payload(hit)) == b"b" * 100


def test_frame_at_walks_at_most_three_pads(make_spool):
    sp = make_spool(capacity=8192)
    o, stored = sp.ring.base, F.frame_stored_bytes(8)
    for k in range(4):  # four pads in a row, then data frame 7
        F.FRAME.pack_into(sp.mapping.mm, o + 64 * k, 7, 64, 0, 1, 0, F.FLAG_PAD, 0, 0)
    F.FRAME.pack_into(sp.mapping.mm, o + 256, 7, stored, 8, 1, 0, 0, F.CODEC_RAW, 0)
    hit = sp.ring.frame_at(7, 64)  # three pads, then the frame
    assert hit is not None and (hit.seq, hit.pos, hit.length) == (7, 256, 8)
    assert hit == sp.ring.header_at(256)
    assert sp.ring.frame_at(7, 0) is None  # a fourth pad: not a sane ring
    assert sp.ring.frame_at(8, 64) is None  # past the pads, another frame's header


def test_set_flags_touches_only_the_flags(make_spool):
    sp = make_spool(capacity=8192)
    sp.put(b"payload")
    hit = sp.ring.header_at(0)
    sp.ring.set_flags(hit, F.FLAG_SUPERSEDED)
    after = sp.ring.header_at(0)
    assert after.flags == hit.flags | F.FLAG_SUPERSEDED
    assert after._replace(flags=hit.flags) == hit
    assert bytes(sp.ring.payload(after)) == b"payload"


def test_locate_read_and_cursor_for(make_spool):
    sp = make_spool(capacity=8192)
    for i in range(5):
        sp.put(bytes([i]) * 8)
    pos = sp.ring.locate(3)
    frame, nseq, npos, lost, codec = sp.ring.read(3, pos)
    assert (frame.seq, frame.data, nseq, lost, codec) == (3, b"\x03" * 8, 4, 0, F.CODEC_RAW)
    assert sp.ring.cursor_for(3) == (3, pos)
    assert sp.ring.cursor_for("earliest") == sp.ring.first_cursor() == (0, 0)
    assert sp.ring.cursor_for("latest") == (5, sp.ring.next_pos)
    with pytest.raises(shmq.FrameLost):
        sp.ring.locate(5)
    with pytest.raises(ValueError):
        sp.ring.cursor_for(6)
    with pytest.raises(ValueError):
        sp.ring.cursor_for("middle")


def test_check_cursor_refuses_a_cursor_past_the_end(make_spool):
    sp = make_spool(capacity=8192)
    sp.put(b"x")
    sp.ring.check_cursor("r", 1, sp.ring.next_pos)  # at the end: fine
    with pytest.raises(shmq.SpoolFormatError, match="beyond the ring's end"):
        sp.ring.check_cursor("r", 2, 0)


def test_still_there_follows_eviction(make_spool):
    sp = make_spool(capacity=4096)
    sp.put(b"a" * 1000)
    assert sp.ring.still_there(0)
    for _ in range(4):
        sp.put(b"b" * 1000)
    assert not sp.ring.still_there(0)


# --- reader table -------------------------------------------------------------------


def test_slot_table_attach_find_remove(make_spool):
    sp = make_spool(capacity=8192)
    sp.put(b"x")
    i = sp.slots.attach("audit", F.SLOT_READER, "latest")
    assert sp.slots.find("audit") == i and sp.slots.name(i) == "audit"
    assert sp.slots.cursor(i) == (1, sp.ring.next_pos)
    assert sp.slots.attach("audit", F.SLOT_READER, "earliest") == i  # found, not re-created
    with pytest.raises(shmq.ShmqError, match="named reader"):
        sp.slots.attach("audit", F.SLOT_GROUP, "earliest")
    with pytest.raises(ValueError):
        sp.slots.attach("", F.SLOT_READER, "earliest")
    with pytest.raises(TypeError):
        sp.slots.attach(3, F.SLOT_READER, "earliest")
    assert [s.name for s in sp.slots.stats()] == ["audit"]
    sp.slots.remove("audit")
    assert sp.slots.find("audit") is None
    with pytest.raises(KeyError):
        sp.slots.remove("audit")


def test_slot_table_hold_is_reference_counted(make_spool):
    sp = make_spool(capacity=8192)
    i = sp.slots.attach("g", F.SLOT_GROUP, "earliest")
    assert sp.slots.hold(i, exclusive=False) and sp.slots.hold(i, exclusive=False)
    assert sp.slots.holds(i) == 2 and sp.slots.alive(i)
    with pytest.raises(shmq.ReaderBusy):
        sp.slots.remove("g")
    sp.slots.let_go(i)
    assert sp.slots.alive(i)
    sp.slots.let_go(i)
    assert sp.slots.holds(i) == 0 and not sp.slots.alive(i)
    sp.slots.remove("g")


def test_slot_floor_is_the_slowest_named_cursor(make_spool):
    sp = make_spool(capacity=8192, on_full="block")
    for _ in range(3):
        sp.put(b"x")
    assert sp.slots.floor(F.S_SEQ) is None
    a, b = sp.reader("a"), sp.reader("b")
    a.get(timeout=1)
    a.get(timeout=1)
    b.get(timeout=1)
    assert sp.slots.floor(F.S_SEQ) == 1
    a.close()
    b.close()


# --- pins ------------------------------------------------------------------------


def test_pins_hold_a_frame_against_eviction(make_spool):
    sp = make_spool(capacity=4096)
    sp.put(b"p" * 1000)
    got = sp.pins.read(0, 0)
    assert got is not None
    view, codec, fpos, npos = got
    assert bytes(view) == b"p" * 1000 and codec == F.CODEC_RAW and npos > fpos
    assert sp.pins.held == {fpos: 1} and sp.pins.floor(None) == fpos
    with pytest.raises(shmq.Full):
        for _ in range(5):
            sp.put(b"q" * 1000, timeout=0.05)  # overwrite mode waits for the pin, then Full
    assert bytes(view) == b"p" * 1000
    view.release()
    sp.pins.unpin(fpos)
    assert sp.pins.held == {} and sp.pins.floor(None) == F.NO_PIN  # the slot stays, empty
    sp.put(b"q" * 1000, timeout=1)  # room again


def test_pins_read_refuses_a_gone_frame(make_spool):
    sp = make_spool(capacity=4096)
    sp.put(b"a" * 1000)
    for _ in range(4):
        sp.put(b"b" * 1000)
    assert sp.pins.read(0, 0) is None
    assert sp.pins.held == {}


# --- writer ------------------------------------------------------------------------


def test_writer_append_takes_every_kind_of_item_in_one_batch(make_spool):
    sp = make_spool(capacity=8192, checksum=True)

    def fill(view):
        view[:] = b"four"

    batch = [b"one", (b"tw", b"o"), memoryview(b"three"), Deferred(4, fill), bytearray(b"five")]
    assert sp.writer.append(batch, None, F.CODEC_RAW) == 0
    assert [f.data for f in sp.reader(verify=True).get_many(10)] == [
        b"one", b"two", b"three", b"four", b"five"]


@pytest.mark.parametrize("checksum", [False, True])
def test_writer_writes_given_timestamps_before_the_commit(make_spool, checksum):
    sp = make_spool(capacity=8192, checksum=checksum)
    seq = sp.writer.append([b"a", b"b"], None, F.CODEC_RAW, timestamps=[111, 222])
    r = sp.reader(verify=checksum)
    assert [(f.seq, f.timestamp_ns) for f in r.get_many(5)] == [(seq, 111), (seq + 1, 222)]
    assert sp.stats().last_put_ns > 222  # the statistics count the put itself
    with pytest.raises(ValueError, match="one u64"):
        sp.writer.append([b"a", b"b"], None, F.CODEC_RAW, timestamps=[1])
    with pytest.raises(ValueError, match="one u64"):
        sp.writer.append([b"a"], None, F.CODEC_RAW, timestamps=[-1])
    assert sp.next_seq == seq + 2


def test_writer_deferred_payload_is_filled_under_the_lock(make_spool):
    sp = make_spool(capacity=8192, checksum=True)
    seen = []

    def fill(view):
        seen.append((len(view), view.readonly, sp.ring.ctl[F.W_LOCK_HOLDER] != 0))
        view[:] = b"0123456789"

    sp.writer.append((Deferred(10, fill),), None, F.CODEC_RAW)
    assert seen == [(10, False, True)]
    assert sp.reader(verify=True).get(timeout=1).data == b"0123456789"


def test_deferred_checks_its_arguments():
    with pytest.raises(TypeError, match="callable"):
        Deferred(3, b"not callable")
    with pytest.raises(ValueError, match=">= 0"):
        Deferred(-1, print)
    d = Deferred(nbytes=3, fill=print)
    assert (d.nbytes, d.fill) == (3, print)


@pytest.mark.parametrize("where", ["fill", "before_commit"])
@pytest.mark.parametrize("policy", ["overwrite", "block"])
def test_a_raising_callout_aborts_the_batch_cleanly(make_spool, where, policy):
    """fill() or before_commit() raising under the writer lock: nothing published, the
    lock released, the exception propagated; the ring stays consistent (fsck-clean)
    even when room was made by evicting everything, and the next put works."""
    from shmq.verify import verify

    sp = make_spool(capacity=8192, on_full=policy)
    r = sp.reader("r") if policy == "block" else None
    sp.put(b"a" * 3000)
    sp.put(b"b" * 3000)  # NEXT_POS 6080: a 4000-byte frame wraps after a pad, evicting both
    if r is not None:
        r.get_many(10, timeout=1)
    calls = []

    def boom(*args):
        calls.append(args)
        raise KeyError("callout failed")

    if where == "fill":
        items, kw = [b"x" * 8, Deferred(4000, boom)], {}
    else:
        items, kw = [b"x" * 8, b"y" * 4000], {"before_commit": boom}
    with pytest.raises(KeyError, match="callout failed"):
        sp.writer.append(items, None, F.CODEC_RAW, **kw)
    assert len(calls) == 1
    if where == "before_commit":
        assert calls[0][0] == 2 and len(calls[0][1]) == 2  # (first seq, positions)
    assert sp.next_seq == 2 and sp.ring.ctl[F.W_LOCK_HOLDER] == 0
    rep = verify(sp.path)
    assert rep.ok, rep.problems
    assert sp.put(b"after") == 2  # placed anew: the aborted batch left nothing behind
    got = (r or sp.reader(start="earliest")).get_many(10, timeout=1)
    assert [f.data for f in got][-1:] == [b"after"]
    assert verify(sp.path).ok


def test_a_put_from_inside_a_callout_is_refused_not_deadlocked(make_spool):
    sp = make_spool(capacity=8192)
    errors = []

    def fill(view):
        for attempt in (lambda: sp.put(b"inner"), lambda: sp.put_many([b"i"]),
                        lambda: sp.reserve(4)):
            try:
                attempt()
            except RuntimeError as exc:
                errors.append(str(exc))
        view[:] = b"outer"

    sp.put_many([Deferred(5, fill)])
    assert len(errors) == 3 and all("deadlock" in e for e in errors)
    assert [f.data for f in sp.reader(start="earliest").get_many(5)] == [b"outer"]


def test_closing_the_spool_inside_a_callout_aborts_the_batch(make_spool):
    sp = make_spool(capacity=8192)
    sp.put(b"first")

    def fill(view):
        view[:] = b"12345"
        try:
            sp.close()
        except BufferError:
            pass  # the core holds the mapping until the batch is over

    with pytest.raises((ValueError, BufferError)):
        sp.put_many([Deferred(5, fill)])
    again = shmq.Spool.open(sp.path)
    try:
        assert again.next_seq == 1 and again.ring.ctl[F.W_LOCK_HOLDER] == 0
        assert again.put(b"next") == 1
    finally:
        again.close()


@pytest.mark.parametrize("checksum", [False, True])
def test_writer_sync_puts_are_plain_puts_msynced(make_spool, checksum):
    sp = make_spool(capacity=8192, checksum=checksum, sync=True)
    assert sp.put(b"a" * 5000) == 0
    assert sp.put_many([b"b" * 2000, (b"c" * 1000, b"d" * 1000)]) == 1  # wraps: two spans
    assert [f.data for f in sp.reader(start="earliest", verify=checksum).get_many(5)] == [
        b"b" * 2000, b"c" * 1000 + b"d" * 1000]


def test_writer_errors(make_spool):
    sp = make_spool(capacity=4096, on_full="error")
    with pytest.raises(shmq.TooLarge):
        sp.writer.append([b"x" * 5000], None, F.CODEC_RAW)
    with pytest.raises(shmq.TooLarge, match="maxsize"):
        sp.writer.append([b"a", b"b"], None, F.CODEC_RAW, max_backlog=1)
    sp.reader("slow")
    sp.writer.append([b"x" * 3000], None, F.CODEC_RAW)
    with pytest.raises(shmq.Full, match="on_full='error'"):
        sp.writer.append([b"y" * 3000], 0, F.CODEC_RAW)
    assert sp.next_seq == 1  # the refused batch left nothing behind


def test_room_marker_moves_when_a_reader_advances(make_spool):
    sp = make_spool(capacity=8192, on_full="block")
    sp.put(b"x")
    r = sp.reader("r")
    before = sp.writer.room_marker()
    r.get(timeout=1)
    assert sp.writer.room_marker() != before


# --- waiting -------------------------------------------------------------------------


@pytest.mark.parametrize("block,timeout,want", [(True, None, None), (True, 1.5, 1.5),
                                                 (False, 3, 0), (False, None, 0)])
def test_check_block_timeout(block, timeout, want):
    assert waiting.check_block_timeout(block, timeout) == want


@pytest.mark.parametrize("bad,exc", [("1", TypeError), (True, TypeError), (float("nan"), ValueError),
                                     (-1, ValueError)])
def test_check_block_timeout_refuses(bad, exc):
    with pytest.raises(exc):
        waiting.check_block_timeout(True, bad)


class _FakeLock:
    recovery_timeout = 0.01

    def __init__(self):
        self.recoveries = 0

    def recover_if_dead(self):
        self.recoveries += 1


def test_retry_stuck_recovers_until_the_call_succeeds():
    lock, calls = _FakeLock(), []

    def call(wait):
        calls.append(wait)
        return -1 if len(calls) < 3 else "done"

    assert waiting.retry_stuck(call, lock, None, lambda out: out == -1, None) == "done"
    assert lock.recoveries == 2 and calls == [0.01] * 3


def test_retry_stuck_counts_a_fast_paths_stuck_result_as_its_first_call():
    """A caller that made the first call itself (waiting first_look) and found the lock
    stuck hands that result over: the loop recovers at once, then retries with the
    whole recovery timeout's wait, as after its own first call."""
    lock, calls = _FakeLock(), []
    lock.recovery_timeout = 0.2

    def call(wait):
        calls.append(wait)
        return "done"

    assert waiting.first_look(lock) == min(0.2, waiting.FIRST_LOOK_S)
    assert waiting.retry_stuck(call, lock, None, lambda out: out == -1, None, -1) == "done"
    assert lock.recoveries == 1 and calls == [0.2]
    # a first result that is not stuck is returned without any call
    assert waiting.retry_stuck(call, lock, None, lambda out: out == -1, None, "had") == "had"
    assert calls == [0.2]


def test_retry_stuck_gives_up_at_the_limit():
    lock = _FakeLock()

    def timed_out():
        raise TimeoutError("stuck")

    with pytest.raises(TimeoutError):
        waiting.retry_stuck(lambda wait: -1, lock, time.monotonic() + 0.05, lambda out: out == -1,
                            timed_out)


def test_retry_async_returns_once_the_attempt_succeeds(make_spool):
    sp = make_spool(capacity=8192)
    r = sp.reader()

    async def main():
        task = asyncio.ensure_future(waiting.retry_async(
            lambda: r.get(block=False), shmq.Empty, sp.data_bell, lambda: r.available, 5))
        await asyncio.sleep(0)
        sp.put(b"late")
        return await asyncio.wait_for(task, 10)

    assert asyncio.run(main()).data == b"late"


def test_retry_async_raises_the_last_error_after_the_timeout(make_spool):
    sp = make_spool(capacity=8192)
    r = sp.reader()
    with pytest.raises(shmq.Empty):
        asyncio.run(waiting.retry_async(lambda: r.get(block=False), shmq.Empty, sp.data_bell,
                                        lambda: r.available, 0.05))


# --- lease table (the work queue's records) -----------------------------------------------


def test_lease_table_grant_owned_due_and_free(make_spool):
    from shmq.leases import LeaseTable

    sp = make_spool(capacity=8192, leases=8)
    reg = sp.lease_region()
    try:
        t = LeaseTable(reg, sp.ring.ctl, 4)
        i = t.take_free()
        assert i == 0 and list(t.in_use()) == [0]
        t.fill(i, 7, 640, 123, max_attempts=2)
        now = 1_000_000_000_000
        got = t.grant(i, now, 5.0, sp.holder)
        assert got[:4] == (0, 7, 1, 123) and got[5] == now + 5_000_000_000
        t.owned(i, got[4], msg_id=7)
        with pytest.raises(shmq.LeaseLost):
            t.owned(i, got[4] + 1)
        assert t.due(now, False, 8) == ([], now + 5_000_000_000, False)
        assert t.due(now + 6_000_000_000, False, 8)[0] == [(7, 0)]  # expired
        assert t.due(now, False, 7)[2]  # a record at the take cursor: a taker died granting it
        assert not t.out_of_attempts(i)
        t.grant(i, now, 5.0, sp.holder)
        assert t.out_of_attempts(i)
        assert t.oldest(9, 900) == (7, 640) and t.at_or_after(7) == [(7, 640)]
        t.free(i)
        assert t.oldest(9, 900) == (9, 900) and t.take_free() == 0
    finally:
        reg.release()


@pytest.mark.parametrize("how", ["abandon", "drop"])
def test_an_abandoned_reservation_that_evicted_everything_leaves_an_empty_ring(make_spool, how):
    """Regression: a reservation placed past a pad evicts every frame and sets FIRST_POS
    at its own position; abandoned, that left FIRST_POS past NEXT_POS (fsck: "the ring
    is empty but FIRST_POS != NEXT_POS"), and a put that then fitted exactly before the
    ring's end was committed below FIRST_POS: unreadable ("cannot find the oldest
    frame").  Now the ring goes back to empty at NEXT_POS (write.c's unplace)."""
    from shmq.verify import verify

    sp = make_spool(capacity=8192)
    sp.put(b"a" * 3000)
    sp.put(b"b" * 3000)  # NEXT_POS 6064: 2128 bytes before the ring's end
    rv = sp.reserve(4000)  # a pad at 6064, the frame at 8192: both frames evicted
    if how == "abandon":
        rv.abandon()
    else:
        del rv  # dropped without commit: abandoned
    assert verify(sp.path).ok
    assert sp.put(b"z" * 2096) == 2  # exactly the 2128 bytes left
    assert [(f.seq, len(f.data)) for f in sp.reader(start="earliest").get_many(5, block=False)] == [
        (2, 2096)]
    assert verify(sp.path).ok
