"""shmq.verify: fsck of healthy, damaged, stale-locked and live spools; repair never touches frames."""

import json
import os
import time

import pytest

import shmq
from shmq import _format as F
from shmq.cli import main
from shmq.repair import repair
from shmq.verify import verify

from conftest import bound


def _fill(sp, n, size=lambda i: i % 97):
    for i in range(n):
        sp.put(bytes([i % 256]) * size(i))


def _ring_bytes(sp):
    return bytes(sp.mapping.mm[sp.ring.base:sp.ring.base + sp.ring.size])


def _dead_pid():
    # A bare fork, not a start method: all that is wanted is a pid that was ours and is gone.
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return pid


def _take_lock_as_dead(sp):
    """Take the writer semaphore and record a holder that no longer exists."""
    sp.writer_lock.sem.acquire()
    sp.ring.ctl[F.W_LOCK_HOLDER] = _dead_pid() | (12345 << 32)


def _offset(sp, seq):
    return sp.ring.base + sp.ring.locate(seq) % sp.ring.size


# --- healthy spools ---------------------------------------------------------


def test_empty_spool_is_clean(make_spool):
    sp = make_spool(capacity="64KiB")
    rep = verify(sp.path)
    assert rep.ok and rep.problems == [] and rep.frames_checked == 0
    assert (rep.first_seq, rep.next_seq) == (0, 0)


def test_healthy_wrapped_spool_checks_every_frame_and_crc(make_spool):
    sp = make_spool(capacity="8KiB", checksum=True)
    r = sp.reader("named")
    g = sp.reader("grp", group=True)
    for i in range(400):
        sp.put(bytes([i % 256]) * (i % 200))
        if i % 5 == 0:
            r.get()
            g.get()
    rep = verify(sp.path)
    assert rep.ok, rep.problems
    assert rep.frames_checked == sp.next_seq - sp.first_seq > 10
    assert rep.crc_verified == rep.frames_checked
    assert rep.readers_checked == 2
    assert {d["name"] for d in rep.readers} == {"named", "grp"}
    assert all(d["alive"] for d in rep.readers)  # attached through `sp`
    json.dumps(rep.as_dict())  # serializable
    r.close()
    g.close()


def test_padding_is_checked(make_spool):
    sp = make_spool(capacity=4096)
    for _ in range(30):
        sp.put(b"x" * 300)  # 336-byte frames: the 4096-byte ring ends with a pad
    rep = verify(sp.path)
    assert rep.ok, rep.problems
    assert rep.pads_checked >= 1


def test_walk_crosses_a_short_tail(make_spool):
    # 16 bytes before the ring's end hold no header: the walk skips them (as
    # ring.header_at does), and a cursor left there points at the next frame.
    sp = make_spool(capacity=4096, checksum=True)
    sp.put(b"a" * 2008)
    sp.put(b"b" * 2008)  # ends at ring offset 4080
    r = sp.reader("named", start="latest")
    assert r.cursor() == (2, 4080)
    sp.put(b"c" * 8)  # wraps to offset 0, evicting frame 0
    assert (sp.ring.first_seq, sp.ring.first_pos) == (1, 2040)
    rep = verify(sp.path)
    assert rep.ok, rep.problems
    assert (rep.frames_checked, rep.crc_verified, rep.pads_checked) == (2, 2, 0)
    assert rep.warnings == [] and rep.damaged_slots == {}


def test_reader_behind_oldest_is_a_note_not_a_problem(make_spool):
    sp = make_spool(capacity=4096)
    sp.reader("slow").close()
    _fill(sp, 200, size=lambda i: 64)
    rep = verify(sp.path)
    assert rep.ok, rep.problems
    assert any("behind the oldest frame" in n for n in rep.notes)


def test_no_checksum_spool_verifies_nothing_but_walks(make_spool):
    sp = make_spool(capacity="64KiB", checksum=False)
    _fill(sp, 50)
    rep = verify(sp.path)
    assert rep.ok and rep.frames_checked == 50 and rep.crc_verified == 0


def test_verify_is_read_only(make_spool):
    sp = make_spool(capacity="64KiB")
    _fill(sp, 50)
    with open(sp.path, "rb") as f:
        before = f.read()
    verify(sp.path)
    with open(sp.path, "rb") as f:
        assert f.read() == before


# --- damaged frames ---------------------------------------------------------------


def test_corrupt_frame_seq_reported_precisely(make_spool):
    sp = make_spool(capacity="64KiB")
    _fill(sp, 20)
    sp.mapping.mm[_offset(sp, 7)] ^= 0x55  # seq field of frame 7
    rep = verify(sp.path)
    assert not rep.ok
    assert any("expected frame 7" in p and "frames 7..19 cannot be reached" in p
               for p in rep.problems), rep.problems
    assert rep.frames_checked == 7


def test_corrupt_frame_length_reported(make_spool):
    sp = make_spool(capacity="64KiB")
    _fill(sp, 10)
    o = _offset(sp, 3)
    sp.mapping.mm[o + 8:o + 12] = (10**9).to_bytes(4, "little")  # stored length
    rep = verify(sp.path)
    assert any("frame 3" in p and "out of bounds" in p for p in rep.problems), rep.problems


def test_crc_mismatch_reported_and_walk_goes_on(make_spool):
    sp = make_spool(capacity="64KiB", checksum=True)
    _fill(sp, 10, size=lambda i: 50)
    sp.mapping.mm[_offset(sp, 4) + F.FRAME_BYTES + 10] ^= 0xFF
    rep = verify(sp.path)
    assert [p for p in rep.problems if "CRC mismatch" in p and "frame 4" in p]
    assert rep.frames_checked == 10 and rep.crc_verified == 9


def test_repair_never_rewrites_frames(make_spool):
    sp = make_spool(capacity="64KiB", checksum=True)
    _fill(sp, 10, size=lambda i: 50)
    sp.mapping.mm[_offset(sp, 4) + F.FRAME_BYTES] ^= 0xFF
    before = _ring_bytes(sp)
    rep = repair(sp.path)
    assert not rep.ok and rep.repaired == []
    assert _ring_bytes(sp) == before


def test_bad_padding_reported(make_spool):
    sp = make_spool(capacity=4096)
    for _ in range(30):
        sp.put(b"x" * 300)
    # find a pad in the ring and shorten it
    pos = sp.ring.ctl[F.W_FIRST_POS]
    for _ in range(30):
        hit = sp.ring.header_at(pos)
        if hit[6] & F.FLAG_PAD:
            break
        pos = hit[1] + hit[2]
    else:
        pytest.skip("no pad resident")
    o = sp.ring.base + hit[1] % sp.ring.size
    sp.mapping.mm[o + 12:o + 16] = (1).to_bytes(4, "little")  # pad "length" must be 0
    rep = verify(sp.path)
    assert any("padding" in p and "length 1" in p for p in rep.problems), rep.problems


# --- control words, geometry, foreign files -----------------------------------------


def test_corrupt_control_words_reported(make_spool):
    sp = make_spool(capacity="64KiB")
    _fill(sp, 3)
    sp.ring.ctl[F.W_FIRST_SEQ] = 99
    rep = verify(sp.path)
    assert any("FIRST_SEQ 99 > NEXT_SEQ 3" in p for p in rep.problems), rep.problems
    sp.ring.ctl[F.W_FIRST_SEQ] = 0
    assert verify(sp.path).ok


def test_damaged_geometry_is_a_problem_not_a_crash(make_spool):
    sp = make_spool(capacity="64KiB")
    path = sp.path
    old = sp.mapping.mm[40]
    sp.mapping.mm[40] = old ^ 0xFF
    try:
        rep = verify(path)
        assert not rep.ok and "checksum mismatch" in rep.problems[0]
        assert repair(path).repaired == []
    finally:
        sp.mapping.mm[40] = old  # so the fixture can destroy it (and its semaphores)


def test_foreign_file_raises(spool_path):
    with open(spool_path, "wb") as f:
        f.write(b"hello, not a spool" * 500)
    with pytest.raises(shmq.SpoolFormatError, match="not a shmq spool"):
        verify(spool_path)
    with pytest.raises(shmq.SpoolFormatError):
        repair(spool_path)


def test_missing_raises(spool_dir):
    with pytest.raises(FileNotFoundError):
        verify(os.path.join(spool_dir, "nope"))


def test_symlink_refused(make_spool, spool_dir):
    sp = make_spool()
    link = os.path.join(spool_dir, "link")
    os.symlink(sp.path, link)
    with pytest.raises(shmq.ShmqError, match="symbolic link"):
        verify(link)
    os.unlink(link)


# --- writer lock ---------------------------------------------------------------------


def test_stale_writer_lock_detected_and_repaired(make_spool):
    sp = make_spool(capacity="64KiB")
    _fill(sp, 5)
    _take_lock_as_dead(sp)
    token, breaks = sp.ring.ctl[F.W_LOCK_TOKEN], sp.ring.ctl[F.W_LOCK_BREAKS]
    rep = verify(sp.path)
    assert rep.stale_writer_lock
    assert any("writer lock" in p and "dead" in p for p in rep.problems), rep.problems
    rep = repair(sp.path)
    assert rep.ok, rep.problems
    assert any("broke the writer lock" in a for a in rep.repaired)
    assert sp.ring.ctl[F.W_LOCK_TOKEN] == token + 1
    assert sp.ring.ctl[F.W_LOCK_BREAKS] == breaks + 1
    assert sp.ring.ctl[F.W_LOCK_HOLDER] == 0 and sp.writer_lock.sem.value == 1
    sp.writer_lock.recovery_timeout = 60  # were the lock still stale, the put would wait this long
    t = time.monotonic()
    assert sp.put(b"after repair", timeout=bound(120)) == 5
    assert time.monotonic() - t < 30  # no lock-recovery wait
    assert sp.read_at(5).data == b"after repair"


def _die_holding_writer_lock(path):
    sp = shmq.Spool.open(path)
    sp.writer_lock.acquire()
    os._exit(0)


def test_writer_killed_holding_lock(make_spool, ctx):
    sp = make_spool(capacity="64KiB")
    _fill(sp, 3)
    p = ctx.Process(target=_die_holding_writer_lock, args=(sp.path,))
    p.start()
    p.join(bound(30))
    assert p.exitcode == 0
    assert main(["fsck", sp.path]) == 1
    assert main(["fsck", "--repair", sp.path]) == 0
    assert main(["fsck", sp.path]) == 0
    assert sp.put(b"x", timeout=0.5) == 3


def test_orphan_lock_without_holder_repaired(make_spool):
    sp = make_spool(capacity="64KiB")
    sp.writer_lock.sem.acquire()  # taken, never recorded: a writer killed right after sem_wait
    rep = verify(sp.path)
    assert rep.orphan_writer_lock and not rep.ok
    rep = repair(sp.path)
    assert rep.ok, rep.problems
    assert sp.put(b"x", timeout=0.5) == 0


def test_live_holder_is_not_a_problem(make_spool):
    sp = make_spool(capacity="64KiB")
    sp.writer_lock.acquire()
    try:
        rep = verify(sp.path)
        assert rep.ok, rep.problems
        assert any("held by live pid" in n for n in rep.notes)
        rep = repair(sp.path)  # must not break a live holder's lock
        assert rep.repaired == [] and sp.ring.ctl[F.W_LOCK_HOLDER]
    finally:
        sp.writer_lock.release()


def test_next_pos_lag_after_writer_death_repaired(make_spool):
    """A writer killed between storing NEXT_SEQ and NEXT_POS."""
    sp = make_spool(capacity="64KiB")
    _fill(sp, 5, size=lambda i: 40)
    end = sp.ring.ctl[F.W_NEXT_POS]
    _take_lock_as_dead(sp)
    sp.ring.ctl[F.W_NEXT_POS] = end - F.frame_stored_bytes(40)  # NEXT_POS not stored yet
    rep = verify(sp.path)
    assert any("past NEXT_POS" in p for p in rep.problems), rep.problems
    rep = repair(sp.path)
    assert rep.ok, (rep.problems, rep.repaired)
    assert sp.ring.ctl[F.W_NEXT_POS] == end
    assert sp.put(b"y" * 40, timeout=0.5) == 5
    assert [sp.read_at(s).data for s in (4, 5)] == [bytes([4]) * 40, b"y" * 40]


def test_semaphore_value_above_one_repaired(make_spool):
    sp = make_spool(capacity="64KiB")
    sp.writer_lock.sem.release()  # value 2: two writers could enter
    rep = verify(sp.path)
    assert any("semaphore value is 2" in p for p in rep.problems)
    rep = repair(sp.path)
    assert rep.ok and sp.writer_lock.sem.value == 1


# --- reader table --------------------------------------------------------------------


def test_reader_cursor_beyond_end_reset_to_earliest(make_spool):
    sp = make_spool(capacity="64KiB")
    sp.reader("r").close()
    _fill(sp, 10)
    w = sp.slots.find("r") * F.SLOT_WORDS
    sp.slots.words[w + F.S_SEQ] = 10**9
    rep = verify(sp.path)
    assert any("'r'" in p and "beyond the ring's end" in p for p in rep.problems)
    before = _ring_bytes(sp)
    rep = repair(sp.path)
    assert rep.ok, rep.problems
    assert _ring_bytes(sp) == before
    r = sp.reader("r")
    assert r.get(timeout=1).seq == 0
    r.close()


def test_reader_cursor_inconsistent_position(make_spool):
    sp = make_spool(capacity="64KiB")
    sp.reader("r").close()
    _fill(sp, 10, size=lambda i: 40)
    w = sp.slots.find("r") * F.SLOT_WORDS
    sp.slots.words[w + F.S_SEQ] = 3
    sp.slots.words[w + F.S_POS] = sp.ring.locate(3) + 8  # mid-header
    rep = verify(sp.path)
    assert any("does not point at frame 3" in p for p in rep.problems), rep.problems
    assert repair(sp.path).ok
    assert sp.slots.words[w + F.S_SEQ] == 0


def test_half_committed_cursor_is_a_warning(make_spool):
    """Position stored, seq not yet (reader killed between its two stores)."""
    sp = make_spool(capacity="64KiB")
    sp.reader("r").close()
    _fill(sp, 10, size=lambda i: 40)
    w = sp.slots.find("r") * F.SLOT_WORDS
    sp.slots.words[w + F.S_SEQ] = 3
    sp.slots.words[w + F.S_POS] = sp.ring.locate(4)
    rep = verify(sp.path)
    assert rep.ok, rep.problems
    assert any("self-heals" in x for x in rep.warnings)


def test_invalid_slot_state_freed(make_spool):
    sp = make_spool(capacity="64KiB")
    sp.reader("a").close()
    sp.reader("b").close()
    sp.slots.words[1 * F.SLOT_WORDS + F.S_STATE] = 9
    rep = verify(sp.path)
    assert any("slot 1 has invalid state 9" in p for p in rep.problems)
    rep = repair(sp.path)
    assert rep.ok
    assert [r.name for r in sp.readers()] == ["a"]


def test_undecodable_name_freed(make_spool):
    sp = make_spool(capacity="64KiB")
    sp.reader("a").close()
    off = sp.geometry["slot_offset"] + F.NAME_OFFSET
    sp.mapping.mm[off:off + 3] = b"\x02\xff\xfe"
    rep = verify(sp.path)
    assert any("undecodable name" in p for p in rep.problems)
    assert repair(sp.path).ok
    assert sp.readers() == []


def _die_holding_group_lock(path):
    sp = shmq.Spool.open(path)
    g = sp.reader("grp", group=True)
    g._lock.acquire()
    os._exit(0)


def test_stale_group_lock_repaired(make_spool, ctx):
    sp = make_spool(capacity="64KiB")
    sp.reader("grp", group=True).close()
    _fill(sp, 3)
    p = ctx.Process(target=_die_holding_group_lock, args=(sp.path,))
    p.start()
    p.join(bound(30))
    rep = verify(sp.path)
    assert rep.stale_group_locks and any("group lock" in x for x in rep.problems)
    rep = repair(sp.path)
    assert rep.ok, rep.problems
    g = sp.reader("grp", group=True)
    g._lock.recovery_timeout = 60  # were the group lock still stale, get would wait this long
    t = time.monotonic()
    assert g.get(timeout=bound(120)).seq == 0
    assert time.monotonic() - t < 30  # no recovery wait
    g.close()


# --- live spools --------------------------------------------------------------------


def _write_for(path, seconds):
    sp = shmq.Spool.open(path)
    end = time.monotonic() + seconds
    i = 0
    while time.monotonic() < end:
        sp.put(bytes(i % 250))
        i += 1
    sp.close()


def test_verify_live_overwriting_spool_reports_no_false_problems(make_spool, ctx):
    sp = make_spool(capacity="16KiB")
    sp.reader("slow").close()
    p = ctx.Process(target=_write_for, args=(sp.path, 1.5))
    p.start()
    try:
        deadline = time.monotonic() + 1.2
        runs = 0
        while time.monotonic() < deadline:
            rep = verify(sp.path)
            assert rep.ok, rep.problems
            runs += 1
    finally:
        p.join(bound(30))
    assert runs >= 1
    assert verify(sp.path).ok
