"""Reading frames with their codec tags, and a portable dump: ``shmq export`` / ``shmq import``.

Dump format (version 1), little-endian::

    preamble   8s magic b"SHMQDUMP", u32 version, u32 header_len
    header     header_len bytes of UTF-8 JSON: the source spool's geometry,
               its seq range at export time and its named readers/groups
    records    b"F" + u64 seq, u64 timestamp_ns, u32 length, u32 crc32(payload),
                      u16 flags, u8 codec, then ``length`` payload bytes
               (any number, in seq order; seqs may jump where frames were
               overwritten during the export)
    trailer    b"E" + u64 frames, u64 payload bytes, u64 frames lost during export

The dump is independent of the spool format version and of the ring's
geometry: it is the migration path between hosts and format versions.
A reader whose newer shmq sees a dump version it does not know refuses it
with a message.  Everything is streamed: memory use does not grow with
the dump's size.
"""

from __future__ import annotations

import errno
import io
import json
import os
import socket
import struct
import sys
import time
import zlib
from typing import NamedTuple

from . import _format as F
from .errors import Empty, FrameLost, Full, ShmqError, SpoolFormatError
from .spool import Spool
from .waiting import check_block_timeout

__all__ = ["Record", "iter_records", "record_at", "export_spool", "import_dump", "DumpError",
           "DUMP_MAGIC", "DUMP_VERSION"]

DUMP_MAGIC = b"SHMQDUMP"
DUMP_VERSION = 1
_PREAMBLE = struct.Struct("<8sII")
_FRAME_REC = struct.Struct("<QQIIHB")
_TRAILER = struct.Struct("<QQQ")
_TAG_FRAME = b"F"
_TAG_END = b"E"
#: Import writes frames in atomic batches of at most this many bytes / frames.
BATCH_BYTES = 1 << 20
BATCH_FRAMES = 1024


class DumpError(ShmqError, ValueError):
    """Not a shmq dump, a newer dump version, or a truncated/damaged dump."""

    kind = "corrupt"


class NotADump(DumpError):
    """The file is not a shmq dump at all (bad magic)."""

    kind = "not_spool"


class Record(NamedTuple):
    """A frame with its header fields: ``codec``/``flags`` are None if the header was lost."""

    seq: int
    timestamp_ns: int
    codec: int | None
    flags: int | None
    data: bytes


# --- reading frames with their codec tag ----------------------------------


def _peek(sp, seq, pos):
    """The header of frame ``seq`` at cursor ``pos`` (skipping a pad), or None."""
    return sp.ring.frame_at(seq, pos)


def _header_of(sp, seq):
    """``(codec, flags)`` of committed frame ``seq``, or ``(None, None)`` if it is gone."""
    try:
        pos = sp.ring.locate(seq)
    except (FrameLost, ShmqError):
        return None, None
    hit = sp.ring.header_at(pos)
    if hit is None or hit.seq != seq or not sp.ring.still_there(pos):
        return None, None
    return hit.codec, hit.flags


def iter_records(sp, start="earliest", stop=None, *, follow=False, timeout=None, info=None,
                 clamp=False, skip_corrupt=False):
    """Yield :class:`Record` s from ``start`` up to (not including) seq ``stop``.

    Reads through an anonymous reader (it never holds writers back and
    leaves no trace in the spool).  Without ``follow`` it stops when it
    catches up; with ``follow`` it waits for new frames (``timeout``: stop
    after that many seconds without one).  Frames overwritten before they
    were read are skipped and counted in ``info["lost"]`` if ``info`` is a
    dict.  With ``clamp``, a ``start`` seq already overwritten starts at
    the oldest frame instead of raising :class:`shmq.FrameLost`.  With
    ``skip_corrupt``, frames whose headers are damaged are skipped: the
    ring is scanned for the next frame whose header chain checks out, and
    the skipped seqs are counted in ``info["corrupt"]`` (ranges in
    ``info["corrupt_ranges"]``).

    :raises shmq.SpoolFormatError: a damaged frame (without ``skip_corrupt``).
    """
    skipped = 0
    if info is not None:
        info.setdefault("corrupt", 0)
        info.setdefault("corrupt_ranges", [])
    try:
        r = sp.reader(start=start)
    except FrameLost:
        if not clamp or not isinstance(start, int):
            raise
        r = sp.reader(start="earliest")
        skipped = max(0, r.position - start)
    except SpoolFormatError:
        if not skip_corrupt:
            raise
        # the oldest frame itself is unreadable: start from the control block's word
        r = sp.reader(start="latest")
        _resync(sp, r, sp.ring.first_seq, sp.ring.first_pos, stop, info)
    try:
        while stop is None or r.position < stop:
            hit = _peek(sp, *r.cursor())  # the header is read before the payload copy
            try:
                f = r.get(block=True, timeout=timeout) if follow else r.get(block=False)
            except Empty:
                return
            except SpoolFormatError:
                if not skip_corrupt:
                    raise
                _resync(sp, r, *r.cursor(), stop, info)
                continue
            if stop is not None and f.seq >= stop:
                return
            if hit is not None and hit.seq == f.seq and sp.ring.still_there(hit.pos):
                codec, flags = hit.codec, hit.flags  # not overwritten since we read it
            else:
                codec, flags = _header_of(sp, f.seq)
            yield Record(f.seq, f.timestamp_ns, codec, flags, bytes(f.data))
    finally:
        if info is not None:
            info["lost"] = r.lost + skipped
            info["position"] = r.position
        r.close()


def _resync(sp, r, seq, pos, stop, info):
    """Move reader ``r`` past the damaged frame ``seq`` at cursor ``pos``: to the next
    position (8-byte aligned, at most one ring ahead) holding a header with a later seq
    whose successor's header checks out too, or to the end (``stop`` or next_seq).
    Counts the skipped seqs in ``info``."""
    import numpy as np

    rg = sp.ring
    ctl = rg.ctl
    end = ctl[F.W_NEXT_SEQ] if stop is None else min(stop, ctl[F.W_NEXT_SEQ])
    ring, base = rg.size, rg.base
    words = np.frombuffer(rg.mm, dtype="<u8", count=ring // 8, offset=base)
    seqs = words[::1]  # any aligned word may be a header's seq field (its first word)
    cand = np.nonzero((seqs > seq) & (seqs < end))[0]
    here = (pos % ring) // 8
    order = cand[np.argsort((cand - here - 1) % (ring // 8))]  # nearest after pos first
    found = None
    for w in order[:4096].tolist():
        p = pos - pos % ring + w * 8
        if p <= pos:
            p += ring
        hit = rg.header_at(p)
        if hit is None or hit.pos != p or hit.seq <= seq or not rg.still_there(p):
            continue
        nxt = hit.seq + (0 if hit.flags & F.FLAG_PAD else 1)
        after = rg.header_at(p + hit.stored)
        if nxt >= ctl[F.W_NEXT_SEQ] or (after is not None and after.seq == nxt):
            found = (hit.seq, p)
            break
    del words, seqs
    new_seq, new_pos = found if found else (end, None)
    if info is not None:
        info["corrupt"] = info.get("corrupt", 0) + (new_seq - seq)
        info.setdefault("corrupt_ranges", []).append((seq, new_seq - 1))
    if new_pos is None:
        r.seek("latest")
        return
    # An anonymous reader's cursor is (seq, position): set both, as Reader.seek would.
    r.advance(new_seq, new_pos)


def record_at(sp, seq) -> Record:
    """Frame ``seq`` with its codec (``Spool.read_at``: lock-free, moves no cursor).

    :raises shmq.FrameLost: overwritten or not written yet.
    """
    f = sp.read_at(seq)
    codec, flags = _header_of(sp, seq)
    return Record(f.seq, f.timestamp_ns, codec, flags, bytes(f.data))


# --- progress -------------------------------------------------------------


class Progress:
    """A one-line progress report on ``stream`` (redrawn at most 5 times a second)."""

    def __init__(self, label, total=None, stream=None, enabled=False):
        self.label, self.total = label, total
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.frames = self.bytes = 0
        self._last = 0.0
        self._drawn = False

    def update(self, frames=1, nbytes=0):
        self.frames += frames
        self.bytes += nbytes
        if self.enabled:
            now = time.monotonic()
            if now - self._last >= 0.2:
                self._last = now
                self._draw()

    def _draw(self):
        if self.total:
            pct = min(100.0, 100.0 * self.frames / self.total)
            done = f"{self.frames:,}/{self.total:,} frames ({pct:3.0f}%)"
        else:
            done = f"{self.frames:,} frames"
        self.stream.write(f"\r{self.label}: {done}, {self.bytes / 1e6:,.1f} MB ")
        self.stream.flush()
        self._drawn = True

    def close(self):
        if self.enabled:
            self._draw()
            self.stream.write("\n")
            self.stream.flush()


# --- export ---------------------------------------------------------------


def _open_out(dest):
    if dest == "-":
        return sys.stdout.buffer, False
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    return io.BufferedWriter(io.FileIO(fd, "wb"), 1 << 20), True


def export_spool(path, dest, *, progress=False, progress_stream=None,
                 skip_corrupt=False) -> dict:
    """Write every frame of spool ``path`` and its readers' positions to ``dest``.

    ``dest`` is a file path (created, mode 0600, never overwritten) or "-"
    for stdout.  The spool is read through an anonymous reader from its
    oldest frame to the ``next_seq`` seen at the start; live writers are
    not held back, and frames they overwrite before the export reaches them
    are counted as ``lost``.  With ``skip_corrupt``, damaged frames are
    skipped and counted as ``corrupt`` (seq ranges in ``corrupt_ranges``).
    A failed export removes the partial file it created.  Returns a summary dict.

    :raises FileExistsError: ``dest`` exists.
    :raises shmq.SpoolFormatError: a damaged frame (without ``skip_corrupt``).
    """
    with Spool.open(path) as sp:
        readers = sp.readers()
        first, stop = sp.first_seq, sp.next_seq
        st = os.fstat(sp.mapping.fd)
        header = {
            "format": "shmq-dump", "version": DUMP_VERSION, "spool_format_version": F.FORMAT_VERSION,
            "source": sp.path, "host": socket.gethostname(), "exported_ns": time.time_ns(),
            "geometry": {"capacity": sp.capacity, "on_full": sp.on_full,
                         "checksum": bool(sp.checksum), "readers": sp.geometry["slot_count"],
                         "leases": sp.geometry["lease_count"], "mode": st.st_mode & 0o7777,
                         # a growable source: imported growable, starting at one segment
                         **({"capacity": sp.ring.ctl[F.W_SEGMENT], "max_capacity": sp.capacity}
                            if sp.growable else {})},
            "first_seq": first, "next_seq": stop,
            "readers": [{"name": r.name, "kind": r.kind, "position": r.position, "lost": r.lost}
                        for r in readers],
        }
        raw = json.dumps(header, sort_keys=True).encode()
        out, close = _open_out(dest)
        prog = Progress(f"exporting {sp.path}", stop - first, progress_stream, progress)
        frames = nbytes = 0
        info = {}
        ok = False
        try:
            out.write(_PREAMBLE.pack(DUMP_MAGIC, DUMP_VERSION, len(raw)) + raw)
            # from `first` itself (clamped): frames a live writer evicts before the
            # reader exists are skipped *and counted*, not silently missing
            for rec in iter_records(sp, first, stop, clamp=True, info=info,
                                    skip_corrupt=skip_corrupt):
                data = rec.data
                out.write(_TAG_FRAME + _FRAME_REC.pack(
                    rec.seq, rec.timestamp_ns, len(data), zlib.crc32(data),
                    (rec.flags or 0) & ~(F.FLAG_PAD | F.FLAG_CRC),
                    F.CODEC_RAW if rec.codec is None else rec.codec))
                out.write(data)
                frames += 1
                nbytes += len(data)
                prog.update(1, len(data))
            # Every seq in [first, stop) was exported or overwritten before the reader
            # got to it; the reader's own count can also include frames past `stop`.
            lost = max(0, stop - first - frames - info.get("corrupt", 0))
            out.write(_TAG_END + _TRAILER.pack(frames, nbytes, lost))
            out.flush()
            ok = True
        except SpoolFormatError as exc:
            raise SpoolFormatError(f"{exc}; 'shmq export --skip-corrupt' skips damaged frames"
                                   if not skip_corrupt else str(exc)) from None
        finally:
            prog.close()
            if close:
                out.close()
                if not ok:
                    os.unlink(dest)  # no partial dump left behind
    return {"source": header["source"], "dest": dest, "frames": frames, "bytes": nbytes,
            "first_seq": first, "next_seq": stop, "lost": lost,
            "corrupt": info.get("corrupt", 0),
            "corrupt_ranges": [list(x) for x in info.get("corrupt_ranges", [])],
            "readers": len(readers)}


# --- import ---------------------------------------------------------------


def _read_exact(f, n, what):
    b = f.read(n)
    if len(b) != n:
        raise DumpError(f"dump is truncated (in {what}); export it again")
    return b


def read_dump_header(f) -> dict:
    """Read and check a dump's preamble and JSON header from binary stream ``f``.

    :raises DumpError: not a dump, a newer dump version, or damaged.
    """
    pre = f.read(_PREAMBLE.size)
    if len(pre) < _PREAMBLE.size or pre[:8] != DUMP_MAGIC:
        raise NotADump("not a shmq dump (bad magic); it must come from 'shmq export'")
    _magic, version, hlen = _PREAMBLE.unpack(pre)
    if version > DUMP_VERSION:
        raise DumpError(f"dump version {version} is newer than this shmq supports "
                        f"({DUMP_VERSION}); upgrade shmq")
    if hlen > 64 << 20:
        raise DumpError(f"dump header length {hlen} is implausible: damaged dump")
    try:
        header = json.loads(_read_exact(f, hlen, "the header"))
        if not isinstance(header, dict) or header.get("format") != "shmq-dump":
            raise ValueError("wrong format field")
    except (ValueError, UnicodeDecodeError) as exc:
        raise DumpError(f"dump header is damaged ({exc})") from None
    return header


def iter_dump(f):
    """Yield ``(seq, timestamp_ns, codec, flags, data)`` from the records of ``f``;
    return the trailer's ``(frames, bytes, lost)`` (via StopIteration.value).

    :raises DumpError: damaged or truncated.
    """
    frames = nbytes = 0
    while True:
        tag = f.read(1)
        if tag == _TAG_FRAME:
            seq, ts, length, crc, flags, codec = _FRAME_REC.unpack(
                _read_exact(f, _FRAME_REC.size, f"the record after {frames} frames"))
            data = _read_exact(f, length, f"frame {seq}")
            if zlib.crc32(data) != crc:
                raise DumpError(f"dump is damaged: frame {seq} fails its checksum")
            frames += 1
            nbytes += length
            yield seq, ts, codec, flags, data
        elif tag == _TAG_END:
            tf, tb, lost = _TRAILER.unpack(_read_exact(f, _TRAILER.size, "the trailer"))
            if (tf, tb) != (frames, nbytes):
                raise DumpError(f"dump is damaged: the trailer counts {tf} frames, "
                                f"{frames} were read")
            return tf, tb, lost
        elif not tag:
            raise DumpError(f"dump is truncated after {frames} frames (no trailer); "
                            "export it again")
        else:
            raise DumpError(f"dump is damaged: unknown record tag {tag!r} after {frames} frames")


def import_dump(src, path, *, capacity=None, on_full=None, mode=None, append=False,
                keep_timestamps=True, timeout=10.0, progress=False, progress_stream=None) -> dict:
    """Load a dump (file path or "-" for stdin) into spool ``path``.

    Without ``append`` a new spool is created with the source's geometry
    (``capacity``/``on_full``/``mode`` override it; mode defaults to 0600; a
    growable source gives a growable spool with the same ceiling);
    with ``append`` the frames go after the existing ones of ``path``.
    Frames get new seqs, in order; codec tags are kept and so are the
    timestamps unless ``keep_timestamps`` is false.  Named readers and
    groups are then registered at the new seq of the frame they were
    about to read (``lost`` counts restored); in append mode a name that
    already exists is left as it is.  Returns a summary dict.

    :raises DumpError: not a dump, newer, damaged or truncated.
    :raises FileExistsError: ``path`` exists (without ``append``).
    :raises shmq.Full: the target spool ran out of room (``block``/``error`` policy).
    """
    from ._mapping import resolve_path

    path = resolve_path(path)
    if not append and os.path.lexists(path):
        raise FileExistsError(errno.EEXIST, "already exists; refusing to overwrite it", path)
    f = sys.stdin.buffer if src == "-" else open(src, "rb")
    try:
        header = read_dump_header(f)
        geo = header.get("geometry", {})
        wanted = header.get("readers", [])
        if append:
            sp = Spool.open(path)
            return _load_into(sp, f, header, wanted, append, keep_timestamps, timeout,
                              progress, progress_stream)
        # Built under a temporary name and linked into place at the end, so a failure
        # (a damaged dump, no room, Ctrl-C) leaves nothing at ``path``.
        tmp = os.path.join(os.path.dirname(path),
                           f".{os.path.basename(path)}.{os.getpid()}.importing")
        ceiling = geo.get("max_capacity")
        if ceiling is not None and capacity is not None:
            ceiling = max(F.parse_size(capacity), int(ceiling))
        sp = Spool.create(
                tmp, capacity=capacity or geo.get("capacity", "64MiB"), max_capacity=ceiling,
                on_full=on_full or geo.get("on_full", "overwrite"),
                mode=0o600 if mode is None else mode,
                readers=max(int(geo.get("readers", F.DEFAULT_SLOTS)), len(wanted), 1),
                leases=int(geo.get("leases", F.DEFAULT_LEASES)),
                checksum=bool(geo.get("checksum", True)))
        try:
            summary = _load_into(sp, f, header, wanted, append, keep_timestamps, timeout,
                                 progress, progress_stream, shown=path)
            os.link(tmp, path)  # atomic publish; never replaces a file created meanwhile
        finally:
            _drop_name(tmp, path)
        summary["path"] = path
        return summary
    finally:
        if f is not sys.stdin.buffer:
            f.close()


def _same_file(a, b):
    try:
        x, y = os.stat(a), os.stat(b)
    except OSError:
        return None
    return (x.st_dev, x.st_ino) == (y.st_dev, y.st_ino)


def _drop_name(tmp, path):
    """After an import: drop the temporary name; if the spool was not published
    at ``path`` (a failure), remove it with its semaphores."""
    if not os.path.lexists(tmp):
        return
    if _same_file(tmp, path):
        os.unlink(tmp)  # published: the spool lives on under ``path``
    else:
        Spool.destroy(tmp)


def _load_into(sp, f, header, wanted, append, keep_timestamps, timeout, progress,
               progress_stream, shown=None):
    try:
        return _load(sp, f, header, wanted, append, keep_timestamps, timeout,
                     Progress(f"importing into {shown or sp.path}",
                              max(0, header.get("next_seq", 0) - header.get("first_seq", 0)),
                              progress_stream, progress), shown or sp.path)
    finally:
        sp.close()


def _load(sp, f, header, wanted, append, keep_timestamps, timeout, prog, shown):
    positions = sorted({r["position"] for r in wanted})
    mapped = {}
    k = 0
    frames = nbytes = 0
    batch, codec, size = [], None, 0
    limit = min(BATCH_BYTES, sp.capacity // 2)
    skipped_flags = 0
    first_new = None

    def flush():
        nonlocal k, frames, nbytes, batch, size, first_new
        if not batch:
            return
        datas = [b[4] for b in batch]
        try:
            if keep_timestamps:  # the exported times are written before the commit
                seq0 = sp.writer.append(datas, check_block_timeout(True, timeout), batch[0][2],
                                        timestamps=[b[1] for b in batch])
            else:
                seq0 = sp.put_many(datas, timeout=timeout, codec=batch[0][2])
        except Full:
            if append:
                raise Full(f"{shown} is full after importing {frames} frames (they stay in "
                           "it): make room, or import into a new spool") from None
            raise Full(f"{shown} would be full after {frames} frames (nothing was created): "
                       "import with a larger --capacity or --on-full overwrite") from None
        if first_new is None:
            first_new = seq0
        for j, b in enumerate(batch):
            while k < len(positions) and positions[k] <= b[0]:
                mapped[positions[k]] = seq0 + j
                k += 1
        payload = sum(len(d) for d in datas)
        frames += len(batch)
        nbytes += payload
        prog.update(len(batch), payload)
        batch, size = [], 0

    gen = iter_dump(f)
    try:
        while True:
            try:
                rec = next(gen)
            except StopIteration as stop:
                trailer = stop.value
                break
            seq, ts, c, flags, data = rec
            if flags & ~(F.FLAG_PAD | F.FLAG_CRC):
                skipped_flags += 1
            need = F.frame_stored_bytes(len(data))
            if batch and (c != codec or size + need > limit or len(batch) >= BATCH_FRAMES):
                flush()
            codec = c
            batch.append(rec)
            size += need
        flush()
    finally:
        prog.close()
    end = sp.next_seq
    for p in positions[k:]:
        mapped[p] = end
    restored, kept = [], []
    existing = {r.name for r in sp.readers()}
    for rd in wanted:
        name, group = rd["name"], rd.get("kind") == "group"
        if name in existing:
            kept.append(name)
            continue
        start = mapped.get(rd["position"], end)
        if start < sp.first_seq:
            start = "earliest"  # overwritten in a smaller target ring
        r = sp.reader(name, group=group, start=start)
        r.close()
        i = sp.slots.find(name)
        if i is not None and rd.get("lost"):
            sp.slots.set_word(i, F.S_LOST, int(rd["lost"]))
        restored.append({"name": name, "kind": rd.get("kind", "reader"),
                         "source_position": rd["position"], "position": _position(sp, name)})
    return {"path": sp.path, "frames": frames, "bytes": nbytes,
            "first_seq": first_new if first_new is not None else end,
            "next_seq": end, "source": header.get("source"), "source_lost": trailer[2],
            "readers": restored, "readers_kept": kept, "flags_dropped": skipped_flags,
            "appended": bool(append)}


def _position(sp, name):
    for r in sp.readers():
        if r.name == name:
            return r.position
    return None
