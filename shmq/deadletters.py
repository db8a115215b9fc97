"""Dead letters: the side spool (``PATH.dead``) where a work queue parks failed messages.

A dead letter is one pickled record (codec "pickle") carrying the message
and its last failure.  Replayed or purged letters are not removed (a ring
only drops its oldest frames): their header gets ``FLAG_SUPERSEDED`` (a
tombstone) under the dead-letter spool's writer lock, and listing skips it.
The spool is an ``overwrite`` ring: the oldest letters make room for new
ones.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time

from . import _format as F
from . import codec
from ._lock import ofd_lock, ofd_unlock
from .spool import Spool

__all__ = ["DeadLetter", "DeadLetters"]

_NS = 1_000_000_000


@dataclasses.dataclass(frozen=True)
class DeadLetter:
    """A message that failed ``attempts`` times, with the last failure."""

    id: int  # seq in the dead-letter spool (for replay_dead / purge_dead)
    message_id: int
    body: object
    headers: dict
    key: object
    attempts: int
    error: dict  # {"type", "message", "traceback"}
    last_holder_pid: int
    enqueued_at: float
    failed_at: float


class DeadLetters:
    """The dead letters of one work queue, over an open spool handle ``spool``.

    Reads are lock-free; tombstones (replay, purge) are set under the
    dead-letter spool's writer lock, held only for the store; replayers take
    turns on a replay lock of their own (see :meth:`replay`).  The trust check for
    unpickling is made again on each read (``trusted`` as the work queue was
    opened): the owner may have widened the file's mode since.
    """

    def __init__(self, spool, trusted=False):
        self.spool = spool
        self._trusted = trusted
        self._thread_lock = threading.Lock()

    @classmethod
    def create(cls, path, capacity, trusted=False) -> "DeadLetters":
        """Create or attach to the dead-letter spool at ``path``.

        A side spool gets the same trust check as the main one: its records
        are pickles too (a planted .dead file must not run code here).

        :raises shmq.UntrustedSpool: (or the trust check's error) at once.
        """
        sp = Spool.create(path, capacity=capacity, on_full="overwrite", exist_ok=True)
        try:
            codec.require_trust(sp, trusted)  # refused at once, as the main spool
        except BaseException:
            sp.close()
            raise
        return cls(sp, trusted)

    def close(self) -> None:
        self.spool.close()

    def add(self, record) -> int:
        """Append one failure record (see :func:`shmq.codec.encode_dead`); return its id."""
        return self.spool.put(codec.encode_dead(record), codec=F.CODEC_PICKLE)

    def frames(self):
        """Live (not tombstoned) dead-letter frames with their header hits, oldest first."""
        ring = self.spool.ring
        seq, pos = ring.first_cursor()
        while True:
            frame, nseq, npos, _lost, _codec = ring.read(seq, pos)
            if frame is None:
                return
            hit = ring.header_at(ring.frame_pos(pos) if frame[0] == seq else npos)
            if hit is not None and hit.seq == frame[0] and not hit.flags & F.FLAG_SUPERSEDED:
                yield frame, hit
            seq, pos = nseq, npos

    def count(self) -> int:
        """How many live dead letters there are."""
        return sum(1 for _ in self.frames())

    def _trust(self):
        return codec.require_trust(self.spool, self._trusted)

    def list(self) -> list:
        """:class:`DeadLetter` s, oldest first (replayed/purged ones excluded)."""
        trust = self._trust()
        out = []
        for f, _hit in self.frames():
            rec = codec.decode_dead(f.data, trust)
            obj, headers, key = rec["message"]
            out.append(DeadLetter(f.seq, rec["message_id"], obj, headers or {}, key, rec["attempts"],
                                  rec["error"], rec["last_holder_pid"], rec["enqueued_ns"] / _NS,
                                  rec["failed_ns"] / _NS))
        return out

    def replay(self, ids, put, stop_on=()) -> int:
        """``put(obj, key=, headers=)`` each letter (all, or those whose id is in ``ids``),
        then tombstone it; return how many.

        One letter at a time, and ``put`` runs holding no lock of this spool
        that anyone else waits for: it may wait for room in the work queue,
        and the consumers that would make room dead-letter into this spool
        (docs/guarantees.md, "Lock order").  Replayers are serialized by an
        fcntl lock on :data:`~shmq._format.REPLAY_LOCK_BYTE` (only replayers
        take it; the kernel drops it if the holder dies), so two concurrent
        replays do not put the same letter twice.  A crash between the put
        and the tombstone replays that letter again on the next replay (at
        least once, a duplicate), never loses it.  A letter purged while its
        put waited is still put once (and counted).  An exception in
        ``stop_on`` raised by ``put`` ends the replay there (that letter and
        the rest stay); any other propagates.
        """
        wanted = None if ids is None else set(ids)
        trust = self._trust()
        n = 0
        with self._replaying():
            for f, hit in list(self.frames()):
                if wanted is not None and f.seq not in wanted:
                    continue
                if not self._live(f.seq, hit):  # purged or overwritten since the listing
                    continue
                rec = codec.decode_dead(f.data, trust)
                obj, headers, key = rec["message"]
                try:
                    put(obj, key=key, headers=headers)  # may wait for room: no lock held here
                except stop_on:  # e.g. Full at the caller's deadline: this letter stays dead
                    break
                with self.spool.writer_lock:  # tombstones serialize with writers (short)
                    if self._live(f.seq, hit):
                        self.spool.ring.set_flags(hit, F.FLAG_SUPERSEDED)
                n += 1
        return n

    def _live(self, seq, hit) -> bool:
        """True while letter ``seq`` (header hit ``hit``) is in the ring and not tombstoned."""
        ring = self.spool.ring
        now = ring.header_at(hit.pos)
        return (now is not None and now.seq == seq and not now.flags & F.FLAG_SUPERSEDED
                and ring.still_there(hit.pos))

    @contextlib.contextmanager
    def _replaying(self):
        """Hold the replay lock: this handle's threads, then the fcntl byte across processes."""
        with self._thread_lock:
            fd = self.spool.mapping.fd
            ofd_lock(fd, F.REPLAY_LOCK_BYTE, wait=True)
            try:
                yield
            finally:
                ofd_unlock(fd, F.REPLAY_LOCK_BYTE)

    def purge(self, older_than=None) -> int:
        """Tombstone letters (all, or those failed more than ``older_than`` seconds ago)."""
        cutoff = None if older_than is None else time.time() - older_than
        trust = self._trust()
        n = 0
        with self.spool.writer_lock:
            for f, hit in list(self.frames()):
                rec = codec.decode_dead(f.data, trust, body=False)
                if cutoff is None or rec["failed_ns"] / _NS < cutoff:
                    self.spool.ring.set_flags(hit, F.FLAG_SUPERSEDED)
                    n += 1
        return n
