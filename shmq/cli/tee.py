"""``shmq tee SRC DST``: copy a spool into another, live, exactly once across restarts
(kvspool's kvsp-tee).

The tee reads SRC through a durable named reader and appends to DST.  The
crash window is between "the frames are in DST" and "the reader's position
is committed in SRC": a tee killed there would copy the same frames again.
It is closed with a small state file next to DST, written (atomic rename)
around every append, and with DST having one writer, the tee:

1. before an append of ``n`` frames: ``pending = {dst_before: DST.next_seq, n,
   src_after: seq after the last of them}``;
2. ``DST.put_many(frames)`` (atomic: all ``n`` frames or none);
3. ``{dst_next: dst_before + n, src_next: src_after, pending: None}``;
4. after a batch, the reader commits its position in SRC.

On start it reads the state: with a pending append, ``DST.next_seq`` says
whether it landed (``dst_before + n``) or not (``dst_before``); then the
reader is moved to ``src_next`` if it is behind.  Any other ``DST.next_seq``
means something else wrote into DST; the tee stops rather than guess.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

from .. import _format as F
from ..errors import Empty, FrameLost, ShmqError
from .args import positive_arg
from .base import EXIT_BUSY, EXIT_ERROR, EXIT_OK, EXIT_USAGE, CliError, open_spool, resolve
from .fmt import print_json

#: Test hook: "before-put", "after-put" or "after-state" SIGKILLs the tee at that point
#: of its Nth append ("after-put:2"); used by the tests of the crash window only.
CRASH_ENV = "SHMQ_TEST_TEE_CRASH"


def state_path(dst_path, name):
    """The tee's state file: hidden, next to DST (ls/top/metrics skip hidden files)."""
    d, base = os.path.split(dst_path)
    return os.path.join(d, f".{base}.tee.{name}.json")


def _identity(sp):
    st = os.fstat(sp._map.fd)
    return [st.st_dev, st.st_ino, sp._geo["created_ns"]]


class Tee:
    """Copies SRC into DST exactly once (see the module docstring for the protocol)."""

    def __init__(self, src, dst, name, batch=1024):
        self.src, self.dst, self.name, self.batch = src, dst, name, batch
        self.state_file = state_path(dst.path, name)
        self.copied = self.appends = 0
        self.recovered = None
        crash = os.environ.get(CRASH_ENV, "")
        point, _, nth = crash.partition(":")
        self._crash = (point, int(nth or 1)) if point else None

    def _write_state(self, **fields):
        st = {"src": self.src.path, "dst": self.dst.path, "reader": self.name,
              "dst_identity": _identity(self.dst), **fields}
        tmp = self.state_file + ".tmp"
        with open(tmp, "w") as f:
            json.dump(st, f)
        os.replace(tmp, self.state_file)  # atomic: the old state or the new one

    def _crash_at(self, point):
        if self._crash and self._crash == (point, self.appends):
            os.kill(os.getpid(), signal.SIGKILL)

    def recover(self, reader):
        """Apply the state file: settle a pending append, move the reader past what DST
        already holds.  Returns a description of what was done (or None)."""
        try:
            with open(self.state_file) as f:
                st = json.load(f)
        except FileNotFoundError:
            return None
        except ValueError:
            raise CliError(f"{self.state_file}: damaged tee state; remove it only if DST was "
                           "rebuilt", EXIT_ERROR) from None
        if st.get("dst_identity") != _identity(self.dst) or st.get("src") != self.src.path:
            return "a new DST (state of an earlier one ignored)"
        nxt = self.dst.next_seq
        pend = st.get("pending")
        if pend and nxt == pend["dst_before"] + pend["n"]:
            src_next, what = pend["src_after"], f"the append of {pend['n']} frame(s) had landed"
        elif pend and nxt == pend["dst_before"]:
            src_next, what = st["src_next"], "the last append had not landed"
        elif not pend and nxt == st["dst_next"]:
            src_next, what = st["src_next"], None
        else:
            raise CliError(f"{self.dst.path}: next seq {nxt} does not match the tee's record "
                           f"({st}); another process wrote into it, so exactly-once cannot be "
                           "kept: use a DST only this tee writes", EXIT_BUSY)
        if src_next > reader.position:
            try:
                reader.seek(src_next)
            except FrameLost:  # overwritten in SRC meanwhile: counted as lost by the reader
                reader.seek("earliest")
            reader.commit()
            what = (what or "") + f"; reader moved to seq {src_next}"
        self._state = {"src_next": src_next, "dst_next": nxt}
        return what

    def run(self, reader, timeout=None, stop=lambda: False):
        """Copy until ``stop()``, or ``timeout`` seconds without a frame.  Returns frames
        lost in SRC (overwritten before the tee read them)."""
        lost0 = reader.lost
        state = getattr(self, "_state", None) or {"src_next": reader.position,
                                                  "dst_next": self.dst.next_seq}
        idle = time.monotonic()
        while not stop():
            wait = 1.0 if timeout is None else max(0.0, min(1.0, timeout - (time.monotonic()
                                                                          - idle)))
            try:
                frames = reader.get_many(self.batch, timeout=wait)
            except Empty:
                if timeout is not None and time.monotonic() - idle >= timeout:
                    break
                continue
            idle = time.monotonic()
            self._copy(frames, state)
            reader.commit()
        return reader.lost - lost0

    def _copy(self, frames, state):
        from ..dump import record_at

        # runs of one codec: put_many writes one codec per batch
        runs, cur, codec = [], [], None
        for f in frames:
            try:
                c = record_at(self.src, f.seq).codec
            except ShmqError:
                c = None  # overwritten since it was read: the bytes are good, the tag is gone
            c = F.CODEC_RAW if c is None else c
            if cur and c != codec:
                runs.append((codec, cur))
                cur = []
            codec = c
            cur.append(f)
        runs.append((codec, cur))
        for codec, run in runs:
            self.appends += 1
            before, after = self.dst.next_seq, run[-1].seq + 1
            if before != state["dst_next"]:
                raise CliError(f"{self.dst.path}: another process wrote into it (next seq "
                               f"{before}, expected {state['dst_next']}); exactly-once cannot "
                               "be kept: use a DST only this tee writes", EXIT_BUSY)
            self._write_state(src_next=state["src_next"], dst_next=before,
                              pending={"dst_before": before, "n": len(run), "src_after": after})
            self._crash_at("before-put")
            self.dst.put_many([f.data for f in run], timeout=None, codec=codec)
            self._crash_at("after-put")
            state["src_next"], state["dst_next"] = after, before + len(run)
            self._write_state(src_next=after, dst_next=state["dst_next"], pending=None)
            self._crash_at("after-state")
            self.copied += len(run)


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
