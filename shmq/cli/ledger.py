"""The record that makes ``shmq tee`` and ``shmq sub`` exactly-once: which source seqs a
destination spool already holds, kept across crashes in a small file next to it.

Around every append of ``n`` frames into the destination (which must have no
other writer) the ledger writes, replacing the file atomically by rename:

1. ``pending = {dst_before: DST.next_seq, n, src_after}`` (the source seq after them);
2. then the append itself (``put_many``: all ``n`` frames or none);
3. then ``{dst_next: dst_before + n, src_next: src_after, pending: None}``.

:meth:`Ledger.recover` reads it back: with a pending append, ``DST.next_seq``
says whether it landed (``dst_before + n``) or not (``dst_before``).  Any
other ``DST.next_seq`` means something else wrote into the destination, and
it refuses rather than guess.  The record names the destination's identity
(device, inode, creation time), so a destination removed and created again
starts afresh.
"""

from __future__ import annotations

import json
import os
import signal

from .base import EXIT_BUSY, EXIT_ERROR, CliError

#: Test hook: "before-put", "after-put" or "after-state" SIGKILLs the process at that
#: point of its Nth append ("after-put:2"); used by the tests of the crash window only.
CRASH_ENV = "SHMQ_TEST_TEE_CRASH"


def state_path(dst_path, kind, name):
    """Hidden, next to the destination (ls/top/metrics skip hidden files); ``shmq rm``
    removes it with the spool."""
    d, base = os.path.split(dst_path)
    return os.path.join(d, f".{base}.{kind}.{name}.json")


def identity(sp):
    return sp.identity()


class Ledger:
    """Exactly-once appends of source frames into ``dst`` (see the module docstring)."""

    def __init__(self, dst, state_file, source):
        self.dst, self.state_file, self.source = dst, state_file, source
        self.src_next = None  # the next source seq DST needs (None: unknown yet)
        self.dst_next = dst.next_seq
        self.appends = 0
        crash = os.environ.get(CRASH_ENV, "")
        point, _, nth = crash.partition(":")
        self._crash = (point, int(nth or 1)) if point else None

    def _write(self, **fields):
        st = {"source": self.source, "dst": self.dst.path, "dst_identity": identity(self.dst),
              **fields}
        tmp = self.state_file + ".tmp"
        with open(tmp, "w") as f:
            json.dump(st, f)
        os.replace(tmp, self.state_file)  # atomic: the old record or the new one

    def _crash_at(self, point):
        if self._crash and self._crash == (point, self.appends):
            os.kill(os.getpid(), signal.SIGKILL)

    def recover(self):
        """Settle the record; set and return ``src_next`` (None if there is no usable
        record), with a note of what was done.

        :raises CliError: a damaged record, or another writer in the destination.
        """
        try:
            with open(self.state_file) as f:
                st = json.load(f)
        except FileNotFoundError:
            return None, None
        except ValueError:
            raise CliError(f"{self.state_file}: damaged record; remove it only if the "
                           "destination was rebuilt", EXIT_ERROR) from None
        if st.get("dst_identity") != identity(self.dst) or st.get("source") != self.source:
            return None, "a new destination (the record of an earlier one is ignored)"
        nxt = self.dst.next_seq
        pend = st.get("pending")
        if pend and nxt == pend["dst_before"] + pend["n"]:
            self.src_next, note = pend["src_after"], f"the append of {pend['n']} frame(s) had landed"
        elif pend and nxt == pend["dst_before"]:
            self.src_next, note = st["src_next"], "the last append had not landed"
        elif not pend and nxt == st["dst_next"]:
            self.src_next, note = st["src_next"], None
        else:
            raise CliError(f"{self.dst.path}: next seq {nxt} does not match the record in "
                           f"{self.state_file}; another process wrote into it, so exactly-once "
                           "cannot be kept: use a destination only this process writes",
                           EXIT_BUSY)
        self.dst_next = nxt
        return self.src_next, note

    def append(self, codec, datas, src_after):
        """Append ``datas`` (one codec) as one atomic batch; afterwards ``src_next`` is
        ``src_after``.

        :raises CliError: another process wrote into the destination.
        """
        self.appends += 1
        before = self.dst.next_seq
        if before != self.dst_next:
            raise CliError(f"{self.dst.path}: another process wrote into it (next seq {before}, "
                           f"expected {self.dst_next}); exactly-once cannot be kept: use a "
                           "destination only this process writes", EXIT_BUSY)
        self._write(src_next=self.src_next, dst_next=before,
                    pending={"dst_before": before, "n": len(datas), "src_after": src_after})
        self._crash_at("before-put")
        self.dst.put_many(datas, timeout=None, codec=codec)
        self._crash_at("after-put")
        self.src_next, self.dst_next = src_after, before + len(datas)
        self._write(src_next=self.src_next, dst_next=self.dst_next, pending=None)
        self._crash_at("after-state")


def codec_runs(items):
    """Split ``[(seq, codec, data)]`` into runs of one codec: ``[(codec, [data], seq after)]``."""
    runs = []
    for seq, codec, data in items:
        if runs and runs[-1][0] == codec:
            runs[-1][1].append(data)
            runs[-1][2] = seq + 1
        else:
            runs.append([codec, [data], seq + 1])
    return runs
