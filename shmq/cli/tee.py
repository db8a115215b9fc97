"""``shmq tee SRC DST``: copy a spool into another, live, exactly once across restarts
(kvspool's kvsp-tee).

The tee reads SRC through a durable named reader and appends to DST.  The
crash window is between "the frames are in DST" and "the reader's position
is committed in SRC": a tee killed there would copy the same frames again.
A :class:`~shmq.cli.ledger.Ledger` next to DST closes it: on start the
reader is moved past what DST already holds.
"""

from __future__ import annotations

import os
import signal
import sys
import time

from .. import _format as F
from ..errors import Empty, FrameLost, ShmqError
from .args import positive_arg
from .base import EXIT_OK, EXIT_USAGE, CliError, open_spool, resolve
from .fmt import print_json
from .ledger import Ledger, codec_runs, state_path


class Tee:
    """Copies SRC (through ``reader``) into DST exactly once."""

    def __init__(self, src, dst, name, batch=1024):
        self.src, self.dst, self.name, self.batch = src, dst, name, batch
        self.ledger = Ledger(dst, state_path(dst.path, "tee", name), f"{src.path}#{name}")
        self.copied = 0
        self.recovered = None

    def recover(self, reader):
        """Move ``reader`` past what DST already holds; return a note (or None)."""
        src_next, note = self.ledger.recover()
        if src_next is None:
            self.ledger.src_next = reader.position
        elif src_next > reader.position:
            try:
                reader.seek(src_next)
            except FrameLost:  # overwritten in SRC meanwhile: counted as lost by the reader
                reader.seek("earliest")
            reader.commit()
            note = (note + "; " if note else "") + f"reader moved to seq {reader.position}"
        return note

    def run(self, reader, timeout=None, stop=lambda: False):
        """Copy until ``stop()``, or ``timeout`` seconds without a frame.  Returns frames
        lost in SRC (overwritten before the tee read them)."""
        from ..dump import record_at

        lost0 = reader.lost
        idle = time.monotonic()
        while not stop():
            left = 1.0 if timeout is None else timeout - (time.monotonic() - idle)
            try:
                frames = reader.get_many(self.batch, timeout=max(0.0, min(1.0, left)))
            except Empty:
                if timeout is not None and time.monotonic() - idle >= timeout:
                    break
                continue
            idle = time.monotonic()
            items = []
            for f in frames:
                try:
                    codec = record_at(self.src, f.seq).codec
                except ShmqError:
                    codec = None  # overwritten since it was read: the bytes are good, not the tag
                items.append((f.seq, F.CODEC_RAW if codec is None else codec, f.data))
            for codec, datas, after in codec_runs(items):
                self.ledger.append(codec, datas, after)
                self.copied += len(datas)
            reader.commit()
        return reader.lost - lost0


def cmd_tee(a) -> int:
    src_path, dst_path = resolve(a.src), resolve(a.dst)
    if src_path == dst_path:
        raise CliError("SRC and DST are the same spool", EXIT_USAGE)
    name = a.name or f"tee-{os.path.basename(dst_path)}"[:F.NAME_MAX_BYTES]
    src = open_spool(src_path)
    dst = reader = None
    stopping = []
    try:
        dst = open_spool(dst_path)
        reader = src.reader(name, auto_commit=False, start=a.start)
        tee = Tee(src, dst, name, batch=a.batch)
        tee.recovered = tee.recover(reader)
        if tee.recovered and not a.quiet:
            print(f"shmq tee: recovered: {tee.recovered}", file=sys.stderr)
        if not a.quiet and not a.json:
            print(f"shmq tee: {src_path} -> {dst_path} as reader {name!r} from seq "
                  f"{reader.position}", file=sys.stderr, flush=True)
        signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
        try:
            lost = tee.run(reader, timeout=a.timeout, stop=lambda: bool(stopping))
        except KeyboardInterrupt:
            lost = reader.lost
    finally:
        if reader is not None:
            reader.close()
        if dst is not None:
            dst.close()
        src.close()
    summary = {"src": src_path, "dst": dst_path, "reader": name, "copied": tee.copied,
               "lost": lost, "recovered": tee.recovered}
    if a.json:
        print_json(summary)
    elif not a.quiet:
        print(f"copied {tee.copied:,} frame(s) from {src_path} to {dst_path}"
              + (f"; {lost:,} overwritten in SRC before the tee read them" if lost else ""))
    return EXIT_OK


def register(add):
    """Add ``tee`` to the ``shmq`` parser."""
    p = add("tee", "copy a spool into another, live, exactly once across restarts",
            description="Read SRC through a durable named reader (--name, default "
            "tee-DSTNAME) and append every frame, with its codec tag, to DST, until Ctrl-C, "
            "SIGTERM or --timeout seconds without a frame.  A restarted tee resumes where "
            "it stopped, and a tee killed at any point never copies a frame twice nor skips "
            "one (a state file .DST.tee.NAME.json next to DST records each append; DST "
            "must have no other writer).  Frames get new seqs and timestamps in DST.")
    p.add_argument("src", metavar="SRC")
    p.add_argument("dst", metavar="DST")
    p.add_argument("--name", metavar="NAME", help="the named reader on SRC (default tee-DSTNAME)")
    p.add_argument("--start", choices=("earliest", "latest"), default="earliest",
                   help="where a new reader starts (default earliest)")
    p.add_argument("--batch", type=positive_arg(int), default=1024, metavar="N",
                   help="frames per append (default 1024)")
    p.add_argument("--timeout", type=positive_arg(float), metavar="S",
                   help="stop after S seconds without a new frame")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("-q", "--quiet", action="store_true", help="print nothing")
    p.set_defaults(func=cmd_tee)
