"""A reliable work queue on a spool: leases, acks, retries, dead letters, dedup, delays.

Layout (docs/workqueue.md has the full semantics):

* messages are frames (codec "workqueue") in a ``block``-policy spool;
* the slot ``wq`` is the *take cursor* (next frame never handed out) and its
  recoverable lock is the work queue's lock: every state change happens
  under it, in short critical sections (bodies are unpickled outside it);
* the lease region of the spool holds lease records (leased, delayed and
  retrying messages, by seq and position) and a key index for dedup;
* the slot ``wq.low`` holds the oldest seq still referenced (take cursor or
  a lease record), so writers never overwrite a leased or delayed frame;
* failures past ``max_attempts`` go to a dead-letter spool (``PATH.dead``).

At-least-once: a message is delivered again until acknowledged, unless it
is dead-lettered or superseded by a newer message with the same key.
"""

from __future__ import annotations

import os
import time
import traceback
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Self

from . import _format as F
from . import codec
from ._format import (
    L_ATTEMPTS, L_DUE_NS, L_ENQ_NS, L_HOLDER, L_POS, L_SEQ, L_STATE, LEASE_LEASED, LEASE_RETRY,
    LEASE_WORDS,
)
from ._lock import holder_pid
from ._mapping import check_name_length, read_geometry, resolve_path
from .deadletters import DeadLetter, DeadLetters
from .errors import Empty, Full, ShmqError
from .leases import KeyIndex, LeaseTable, WorkQueueStats, lease_stats
from .spool import Spool
from .waiting import check_block_timeout

if TYPE_CHECKING:
    from _typeshed import StrPath

    from .ring import HeaderHit

__all__ = ["WorkQueue", "Message", "DeadLetter", "WorkQueueStats"]

TAKE_SLOT = "wq"
LOW_SLOT = "wq.low"
_NS = 1_000_000_000
#: How often a consumer checks that lease holders are alive (seconds).
LIVENESS_INTERVAL_S = 0.5


class Message:
    """One delivery of a work queue message, under a lease.

    ``ack()``, ``nack()`` and ``extend()`` carry the fencing ``token`` of
    this delivery; once the lease was re-granted (it expired, or the holder
    was declared dead) they raise :class:`shmq.LeaseLost`.
    """

    __slots__ = ("_wq", "_slot", "body", "id", "attempt", "key", "headers", "enqueued_at", "token",
                 "lease_deadline", "_done")

    def __init__(self, wq: WorkQueue, slot: int, body: Any, msg_id: int, attempt: int, key: str | bytes | None,
                 headers: dict[str, Any], enqueued_at: float, token: int, deadline: float) -> None:
        self._wq = wq
        self._slot = slot
        self.body = body
        self.id = msg_id
        self.attempt = attempt
        self.key = key
        self.headers = headers
        self.enqueued_at = enqueued_at
        self.token = token
        self.lease_deadline = deadline
        self._done = False

    def ack(self) -> None:
        """Acknowledge: the message is done and never delivered again.

        :raises shmq.LeaseLost: the lease was re-granted (stale token).
        """
        self._wq._ack(self)
        self._done = True

    def nack(self, delay: float | None = None, error: BaseException | str | None = None) -> None:
        """Give the message back: delivered again after ``delay`` seconds (attempt + 1),
        or dead-lettered if it has used up its attempts.

        ``error``: an exception (type, message and traceback are recorded) or a string.

        :raises shmq.LeaseLost: the lease was re-granted (stale token).
        """
        self._wq._nack(self, delay, error)
        self._done = True

    @property
    def slot(self) -> int:
        """The lease record of this delivery: with :attr:`token`, what
        :meth:`WorkQueue.release` needs to give it back from another handle."""
        return self._slot

    def extend(self, seconds: float) -> None:
        """Push the lease deadline to ``seconds`` from now.

        :raises shmq.LeaseLost: the lease was re-granted (stale token).
        """
        self.lease_deadline = self._wq._extend(self, seconds)

    def __repr__(self) -> str:
        return (f"<shmq.Message id={self.id} attempt={self.attempt} key={self.key!r} "
                f"token={self.token}>")


def _error_record(error: BaseException | str | None) -> dict[str, str | None]:
    if error is None:
        return {"type": None, "message": None, "traceback": None}
    if isinstance(error, BaseException):
        tb = "".join(traceback.format_exception(type(error), error, error.__traceback__))
        return {"type": type(error).__name__, "message": str(error), "traceback": tb}
    return {"type": "str", "message": str(error), "traceback": None}


class WorkQueue:
    """An at-least-once work queue shared by processes; see the module doc.

    ``WorkQueue(path)`` creates the spool (``capacity`` bytes of ring,
    ``leases`` lease records, ``keys`` key-index entries) or attaches to an
    existing one.  Handles pickle to their path.
    """

    def __init__(self, path: StrPath, *, capacity: int | str = "64MiB", max_attempts: int = 5, leases: int = 1024,
                 keys: int = 4096, dead_capacity: int | str = "16MiB", trusted: bool = False,
                 liveness_interval: float = LIVENESS_INTERVAL_S) -> None:
        if isinstance(max_attempts, bool) or not isinstance(max_attempts, int) or max_attempts < 1:
            raise ValueError("max_attempts must be an int >= 1")
        for name, v in (("leases", leases), ("keys", keys)):
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 1 << 20:
                raise ValueError(f"{name} must be an int in 1..1048576")
        self.path = resolve_path(path)
        check_name_length(self.path, ".dead")  # before the queue's spool: it would be left behind
        self._opts = dict(capacity=capacity, max_attempts=max_attempts, leases=leases, keys=keys,
                          dead_capacity=dead_capacity, trusted=trusted,
                          liveness_interval=liveness_interval)
        records = F.wq_region_records(leases, keys)
        sp = Spool.create(self.path, capacity=capacity, on_full="block", leases=records, exist_ok=True)
        try:
            self._attach(sp, max_attempts, leases, keys, trusted)
        except BaseException:
            sp.close()
            raise
        try:
            self._dead = DeadLetters.create(self.path + ".dead", dead_capacity, trusted)
        except BaseException:
            self._region.release()
            self._take.close()
            sp.close()
            raise
        self._liveness_interval = liveness_interval
        self._next_liveness = 0.0

    def _attach(self, sp: Spool, max_attempts: int, leases: int, keys: int, trusted: bool) -> None:
        if sp.on_full != "block":
            raise ShmqError(f"{sp.path} is a '{sp.on_full}' spool; a work queue needs on_full='block'")
        self._trust = codec.require_trust(sp, trusted)  # fstat of the mapped fd
        ctl = sp.ring.ctl
        take = sp.reader(TAKE_SLOT, group=True)  # creates the slot if new (earliest)
        self._spool, self._ctl, self._take = sp, ctl, take
        self._lock = take.lock
        # Before the first acquire: the attach itself may break a dead consumer's
        # lock, and its repair must run then (without it, a frame granted by a
        # consumer killed before moving the take cursor was granted again).
        self._attached = False  # _recover builds its own lease table until then
        self._lock.on_recover = self._recover
        with self._lock:
            if not ctl[F.W_WQ_LEASE_SLOTS]:  # first attach: initialize under the lock
                if F.wq_region_records(leases, keys) > sp.geometry["lease_count"]:
                    raise ShmqError(f"{sp.path}: its lease region is too small for a work queue "
                                    f"with {leases} leases and {keys} keys")
                ctl[F.W_WQ_KEY_SLOTS] = keys
                ctl[F.W_WQ_MAX_ATTEMPTS] = max_attempts
                ctl[F.W_WQ_LEASE_SLOTS] = leases  # published last: initialized
        self._low = sp.slots.attach(LOW_SLOT, F.SLOT_READER, "earliest")
        self._nleases = ctl[F.W_WQ_LEASE_SLOTS]
        self._nkeys = ctl[F.W_WQ_KEY_SLOTS]
        self._max_attempts = ctl[F.W_WQ_MAX_ATTEMPTS]
        self._region = sp.lease_region()
        self._leases = LeaseTable(self._region, ctl, self._nleases)
        self._keys = KeyIndex(self._region, self._nleases * LEASE_WORDS, self._nkeys)
        self._attached = True

    @classmethod
    def open(cls, path: StrPath, **kw: Any) -> Self:
        """Attach to an existing work queue.

        :raises FileNotFoundError: nothing at ``path``.
        """
        if not os.path.lexists(resolve_path(path)):
            raise FileNotFoundError(f"no work queue at {resolve_path(path)}")
        return cls(path, **kw)

    def close(self) -> None:
        """Detach this handle (leases it granted stay valid until they expire)."""
        if self._spool is None:
            return
        self._region.release()
        self._take.close()
        self._spool.close()
        self._dead.close()
        self._spool = None  # type: ignore[assignment]  # closed: _check() raises

    @staticmethod
    def destroy(path: StrPath) -> None:
        """Remove a work queue's spool and its dead-letter spool.

        Every side file is checked before anything is removed: if one is not
        a spool (a FIFO, socket, symbolic link, directory or foreign file
        planted at ``PATH.dead``), nothing is removed and nothing blocks.

        :raises FileNotFoundError: no work queue spool at ``path``.
        :raises shmq.NotASpool: the spool or a side file is not a regular file.
        :raises shmq.SpoolFormatError: the spool or a side file is not a spool.
        """
        path = resolve_path(path)
        sides = [p for p in (path + ".dead",) if os.path.lexists(p)]
        for p in [path] + sides:
            read_geometry(p)  # raises (opening nothing that blocks) if it is not a spool
        Spool.destroy(path)
        for p in sides:
            try:
                Spool.destroy(p)
            except FileNotFoundError:
                pass

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __reduce__(self) -> tuple[Callable[..., WorkQueue], tuple[Any, ...]]:
        return (_reopen, (self.path, self._opts))

    def options(self) -> dict[str, Any]:
        """The options this handle was opened with (a copy), as keyword arguments."""
        return dict(self._opts)

    def _check(self) -> None:
        if self._spool is None:
            raise ValueError("work queue handle is closed")

    # -- producing ----------------------------------------------------------------

    def put(self, obj: Any, key: str | bytes | None = None, delay: float | None = None,
            headers: dict[str, Any] | None = None, *, not_before: float | None = None,
            max_attempts: int | None = None, timeout: float | None = None) -> int:
        """Enqueue ``obj``; return its message id (its seq in the spool).

        ``key``: a newer message replaces an older one with the same key
        that has not been delivered (at once); one in flight finishes but is
        not redelivered.  ``delay`` (seconds) or ``not_before`` (epoch
        seconds) defers delivery without holding up later messages.

        :raises TypeError: ``headers`` not a dict, ``key`` not str/bytes.
        :raises shmq.TooLarge: the message can never fit.
        :raises shmq.ShmqError: the key index is full.
        :raises shmq.Full: no room within ``timeout`` (consumers hold the ring: the
            spool's ``block`` policy; None waits as long as it takes).
        """
        return self.put_many([obj], key=key, delay=delay, headers=headers, not_before=not_before,
                             max_attempts=max_attempts, timeout=timeout)

    def put_many(self, objs: Iterable[Any], key: str | bytes | None | list[str | bytes | None] = None, delay: float | None = None,
                 headers: dict[str, Any] | None = None, *, not_before: float | None = None,
                 max_attempts: int | None = None, timeout: float | None = None) -> int:
        """Enqueue several messages atomically (all with the same options); return the first id.

        ``key`` may be a list (one key per message).
        """
        self._check()
        objs = list(objs)
        if not objs:
            raise ValueError("put_many() needs at least one message")
        keys = key if isinstance(key, list) else [key] * len(objs)
        if len(keys) != len(objs):
            raise ValueError("one key per message")
        if headers is not None and not isinstance(headers, dict):
            raise TypeError(f"headers must be a dict, not {type(headers).__name__}")
        if not_before is None and delay is not None:
            delay = check_block_timeout(True, delay)
            not_before = time.time() + delay
        elif not_before is not None:
            not_before = float(not_before)
        nb_ns = int(not_before * _NS) if not_before else 0
        if max_attempts is not None and (isinstance(max_attempts, bool) or not isinstance(max_attempts, int)
                                         or not 1 <= max_attempts <= 0xFFFFFFFF):
            raise ValueError("max_attempts must be an int >= 1")
        items, hashes = [], []
        for obj, k in zip(objs, keys):
            if k is not None and not isinstance(k, (str, bytes)):
                raise TypeError(f"key must be str or bytes, not {type(k).__name__}")
            h = F.key_hash(k) if k is not None else 0
            head = F.WQ_HEADER.pack(h, nb_ns, max_attempts or 0, F.WQ_HAS_KEY if k is not None else 0)
            items.append(codec.encode_workq(obj, headers, k, head))  # pickled outside any lock
            hashes.append(h)
        index = self._index_keys if any(hashes) else None
        seq = self._spool.writer.append(tuple(items), check_block_timeout(True, timeout), F.CODEC_WORKQ,
                                  before_commit=(lambda s, placed: index(s, placed, hashes)) if index else None)
        return seq

    def _index_keys(self, seq0: int, placed: Any, hashes: list[int]) -> None:
        """Point the key index at the new messages (writer lock held, before commit)."""
        self._keys.point(seq0, placed, hashes, self._ctl[F.W_FIRST_SEQ], self.path)

    def _superseded(self, h: int, seq: int) -> bool:
        """True if a newer committed message with key hash ``h`` exists."""
        got = self._keys.newest(h)
        if got is None:
            return False
        newer, pos = got
        if newer <= seq or newer >= self._ctl[F.W_NEXT_SEQ]:
            return False
        hit = self._spool.ring.header_at(pos)  # verify: the entry may be torn or stale
        return hit is not None and hit.seq == newer and self._ext(hit)[0] == h

    def _ext(self, hit: HeaderHit) -> tuple[Any, ...]:
        """Decode the work-queue header of the frame whose header is ``hit``."""
        if hit.length < F.WQ_HEADER.size:
            raise ShmqError(f"{self.path}: frame {hit.seq} is not a work queue message")
        return F.WQ_HEADER.unpack_from(self._spool.ring.payload(hit))

    # -- consuming ----------------------------------------------------------------

    def get(self, timeout: float | None = None, lease: float = 30.0) -> Message:
        """Lease the next deliverable message for ``lease`` seconds.

        Delivers, oldest first: messages whose retry or delay is due and
        messages whose lease expired or whose holder died (attempt + 1),
        then new messages in commit order.  Blocks until one is available
        (woken by puts, nacks and due times; no polling).

        :raises shmq.Empty: nothing deliverable within ``timeout``.
        """
        msgs = self.get_many(1, timeout=timeout, lease=lease)
        return msgs[0]

    def get_many(self, max_messages: int = 10, timeout: float | None = None,
                 lease: float = 30.0) -> list[Message]:
        """Lease up to ``max_messages`` messages (blocking only for the first)."""
        self._check()
        if isinstance(max_messages, bool) or not isinstance(max_messages, int) or max_messages < 1:
            raise ValueError("max_messages must be a positive int")
        lease = check_block_timeout(True, lease)
        if not lease:
            raise ValueError("lease must be positive")
        timeout = check_block_timeout(True, timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            got, next_due = self._lease_some(max_messages, lease)
            msgs = []
            for g in got:  # unpickled outside the lock
                try:
                    msgs.append(self._message(*g))
                except Exception as exc:
                    # An undecodable body is a failed attempt, not a lost lease:
                    # settle it now (retried, then dead-lettered with the error).
                    stub = Message(self, g[0], None, g[1], g[2], None, {}, g[3] / _NS, g[4], g[5] / _NS)
                    self._nack(stub, None, exc)
            if msgs:
                return msgs
            if got:
                continue
            now = time.monotonic()
            left = None if deadline is None else deadline - now
            if left is not None and left <= 0:
                raise Empty(f"no message within {timeout} s")
            wait = left
            if next_due is not None:
                wait = next_due if wait is None else min(wait, next_due)
            wait = min(wait, self._liveness_interval) if wait is not None else self._liveness_interval
            sp = self._spool
            cursor = self._take_seq()
            sp.data_bell.wait(lambda: sp.ring.next_seq > cursor, max(wait, 0.001))

    def _take_seq(self) -> int:
        return self._take.position

    def _lease_some(self, max_messages: int, lease: float) -> tuple[list[tuple[Any, ...]], float | None]:
        """Grant up to ``max_messages`` leases; return (grants, seconds until the next due time)."""
        sp = self._spool
        now_ns = time.time_ns()
        check_live = time.monotonic() >= self._next_liveness
        grants = []
        freed = False
        with self._lock:
            # 1. lease records that are due again (retry, delay, expired or dead holder)
            due, next_due_ns, ahead = self._leases.due(now_ns, check_live, self._take_seq())
            if ahead:  # a taker died granting (its lock broken without our repair): repair now
                self._recover(0)
            for _seq, i in due[:max_messages]:
                g = self._redeliver(i, now_ns, lease)
                if g is not None:
                    grants.append(g)
                else:
                    freed = True
            # 2. new frames from the take cursor
            while len(grants) < max_messages:
                g, more, due_ns = self._take_new(now_ns, lease)
                if due_ns is not None:
                    next_due_ns = due_ns if next_due_ns is None else min(next_due_ns, due_ns)
                if g is not None:
                    grants.append(g)
                elif not more:
                    break
            if freed or grants:
                self._update_low()
        if check_live:
            self._next_liveness = time.monotonic() + self._liveness_interval
        if freed:
            sp.core.ring_space()
        wait = None if next_due_ns is None else max(0.0, (next_due_ns - now_ns) / _NS)
        return grants, wait

    def _take_new(self, now_ns: int, lease: float) -> tuple[tuple[Any, ...] | None, bool, int | None]:
        """Move the frame at the take cursor into the lease table (lock held).

        Returns (grant or None, whether to keep going, due time if it was delayed).
        """
        sp, slots, t = self._spool, self._spool.slots, self._take.slot
        seq, pos = slots.cursor(t)
        frame, nseq, npos, lost, codec = sp.ring.read(seq, pos)
        if lost:  # cannot happen in block mode; counted if it does
            slots.set_word(t, F.S_LOST, slots.word(t, F.S_LOST) + lost)
        if frame is None:
            if lost:
                slots.set_cursor(t, nseq, npos)
            return None, False, None
        fpos = sp.ring.frame_pos(pos)
        data = frame[2]
        if codec != F.CODEC_WORKQ or len(data) < F.WQ_HEADER.size:
            # not ours (written by a plain spool writer): skip it, counted as superseded
            slots.set_cursor(t, nseq, npos)
            self._ctl[F.W_WQ_SUPERSEDED] += 1
            return None, True, None
        h, nb_ns, max_att, _flags = F.WQ_HEADER.unpack_from(data)
        if self._superseded(h, frame[0]):
            slots.set_cursor(t, nseq, npos)
            self._ctl[F.W_WQ_SUPERSEDED] += 1
            return None, True, None
        i = self._leases.take_free()
        if i is None:
            return None, False, None  # lease table full: stop taking (documented)
        self._leases.fill(i, frame[0], fpos, frame[1], max_att or self._max_attempts)
        if nb_ns > now_ns:
            self._leases.delay(i, nb_ns)
            slots.set_cursor(t, nseq, npos)
            return None, True, nb_ns
        grant = self._grant(i, now_ns, lease, data)
        # the record exists before the cursor moves: a crash in between
        # redelivers (at least once), never loses (see _recover)
        slots.set_cursor(t, nseq, npos)
        return grant, True, None

    def _grant(self, i: int, now_ns: int, lease: float, data: Any) -> tuple[Any, ...]:
        return self._leases.grant(i, now_ns, lease, self._spool.holder) + (data,)

    def _frame_payload(self, i: int) -> Any:
        seq = self._leases.word(i, L_SEQ)
        frame, _s, _p, lost, _c = self._spool.ring.read(seq, self._leases.word(i, L_POS))
        if frame is None or lost or frame[0] != seq:
            raise ShmqError(f"{self.path}: leased frame {seq} is gone (ring corrupt?)")
        return frame[2]

    def _redeliver(self, i: int, now_ns: int, lease: float) -> tuple[Any, ...] | None:
        """A due record: grant it again, or drop it (superseded / out of attempts)."""
        leases = self._leases
        data = self._frame_payload(i)
        h = F.WQ_HEADER.unpack_from(data)[0]
        if self._superseded(h, leases.word(i, L_SEQ)):
            leases.free(i)
            self._ctl[F.W_WQ_SUPERSEDED] += 1
            return None
        state = leases.word(i, L_STATE)
        if state == LEASE_LEASED:  # expired or holder died: counts as a failed attempt
            if leases.out_of_attempts(i):
                self._dead_letter(i, data, {"type": "LeaseExpired", "message":
                                            "lease expired or holder died", "traceback": None})
                return None
            self._ctl[F.W_WQ_REDELIVERED] += 1
        elif state == LEASE_RETRY:
            self._ctl[F.W_WQ_REDELIVERED] += 1
        return self._grant(i, now_ns, lease, data)

    def _dead_letter(self, i: int, data: Any, error: dict[str, str | None]) -> None:
        word = self._leases.word
        record = {"message_id": word(i, L_SEQ), "payload": bytes(data[F.WQ_HEADER.size:]),
                  "attempts": word(i, L_ATTEMPTS) & 0xFFFFFFFF, "error": error,
                  "last_holder_pid": holder_pid(word(i, L_HOLDER)),
                  "enqueued_ns": word(i, L_ENQ_NS), "failed_ns": time.time_ns()}
        self._dead.add(record)  # before freeing: never lost
        self._leases.free(i)
        self._ctl[F.W_WQ_DEAD] += 1

    def _update_low(self) -> None:
        """Publish the oldest referenced frame so writers keep it (lock held)."""
        slots = self._spool.slots
        seq, pos = self._leases.oldest(*slots.cursor(self._take.slot))
        slots.set_cursor(self._low, seq, pos)

    def _message(self, i: int, seq: int, attempt: int, enq_ns: int, token: int, deadline: int,
                 data: Any) -> Message:
        obj, headers, key = codec.decode_workq(data, self._trust)
        return Message(self, i, obj, seq, attempt, key, headers or {}, enq_ns / _NS, token,
                       deadline / _NS)

    def _owned(self, msg: Message) -> None:
        """Lock held: the lease record still belongs to this delivery, or LeaseLost."""
        self._leases.owned(msg._slot, msg.token, msg.id)

    def _ack(self, msg: Message) -> None:
        self._check()
        with self._lock:
            self._owned(msg)
            self._leases.free(msg._slot)
            self._ctl[F.W_WQ_ACKED] += 1
            self._update_low()
        sp = self._spool
        sp.core.ring_space()

    def _nack(self, msg: Message, delay: float | None, error: BaseException | str | None) -> None:
        self._give_back(msg._slot, msg.token, msg.id, delay, error)

    def release(self, slot: int, token: int, *, delay: float | None = None,
                error: BaseException | str | None = None) -> None:
        """Give back the delivery leased under ``token`` in lease record ``slot``
        (``Message.slot`` and ``Message.token``), as its holder's ``nack`` would:
        delivered again after ``delay`` seconds, or dead-lettered (with
        ``error``) if it has used up its attempts.

        For a process that settles on behalf of a holder that died, from its
        own handle, knowing only what the holder published (the Dispatcher's
        supervisor does).  Atomic under the work queue's lock; safe to race
        with the lease expiring or the holder settling: exactly one wins.

        :raises shmq.LeaseLost: that delivery is no longer leased under ``token``
            (settled, or re-granted after its lease expired).
        :raises ValueError: ``slot`` is out of range, or the handle is closed.
        :raises TypeError: ``slot`` or ``token`` is not an int.
        """
        for name, v in (("slot", slot), ("token", token)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{name} must be an int, not {type(v).__name__}")
        self._check()
        if not 0 <= slot < self._nleases:
            raise ValueError(f"lease slot {slot} is out of range (0..{self._nleases - 1})")
        self._give_back(slot, token, None, delay, error)

    def _give_back(self, slot: int, token: int, msg_id: int | None, delay: float | None,
                   error: BaseException | str | None) -> None:
        self._check()
        delay = 0.0 if delay is None else check_block_timeout(True, delay)
        rec = _error_record(error)
        dead = False
        with self._lock:
            self._leases.owned(slot, token, msg_id)
            if self._leases.out_of_attempts(slot):
                self._dead_letter(slot, self._frame_payload(slot), rec)
                self._update_low()
                dead = True
            else:
                self._leases.delay(slot, time.time_ns() + int(delay * _NS), LEASE_RETRY)
        sp = self._spool
        if dead:
            sp.core.ring_space()  # its frame no longer holds the ring: a blocked put may go on
        else:
            sp.core.ring_data()  # a consumer may be waiting for exactly this

    def _extend(self, msg: Message, seconds: float) -> float:
        self._check()
        seconds = check_block_timeout(True, seconds)
        with self._lock:
            self._owned(msg)
            deadline = time.time_ns() + int(seconds * _NS)
            self._leases.set_word(msg._slot, L_DUE_NS, deadline)
        return deadline / _NS

    def _recover(self, dead_pid: int) -> None:
        """After breaking a dead consumer's lock (lock held): records ahead of the take
        cursor mean it died between recording a lease and moving the cursor; the
        cursor moves past them, so that their frames are not granted twice.

        Also called when :meth:`_lease_some` finds such records: the lock was
        broken by something without this repair (``shmq recover``, another tool).
        """
        sp, slots, t = self._spool, self._spool.slots, self._take.slot
        seq = slots.word(t, F.S_SEQ)
        if self._attached:
            ahead = self._leases.at_or_after(seq)
        else:  # breaking the lock while attaching
            n = self._ctl[F.W_WQ_LEASE_SLOTS]
            if not n:
                return  # not initialized yet: no lease can exist
            region = sp.lease_region()
            try:
                ahead = LeaseTable(region, self._ctl, n).at_or_after(seq)
            finally:
                region.release()
        for rseq, rpos in ahead:  # in record order, as they were taken
            if rseq >= seq:
                hit = sp.ring.header_at(rpos)
                if hit is not None and hit.seq == rseq:
                    seq = hit.seq + 1
                    slots.set_cursor(t, seq, hit.pos + hit.stored)

    # -- dead letters ---------------------------------------------------------------

    def dead_letters(self) -> list[DeadLetter]:
        """Messages that ran out of attempts, oldest first (replayed/purged ones excluded)."""
        self._check()
        return self._dead.list()

    def replay_dead(self, ids: Iterable[int] | None = None, timeout: float | None = None) -> int:
        """Re-enqueue dead letters (all, or those whose ``id`` is in ``ids``); return how many.

        Replayed messages get new ids and fresh attempts.  Each put waits for
        room in the work queue; with ``timeout``, the replay stops at the first
        letter that found no room before the deadline (it and the rest stay
        dead letters, nothing is lost) and returns how many were replayed.  A
        consumer that replays should pass a timeout: with every consumer waiting
        in a replay, nobody makes room.
        """
        self._check()
        if timeout is None:
            return self._dead.replay(ids, self.put)
        deadline = time.monotonic() + timeout

        def put(obj: Any, **kw: Any) -> int:
            return self.put(obj, timeout=max(0.0, deadline - time.monotonic()), **kw)

        return self._dead.replay(ids, put, stop_on=Full)

    def purge_dead(self, older_than: float | None = None) -> int:
        """Drop dead letters (all, or those failed more than ``older_than`` seconds ago)."""
        self._check()
        return self._dead.purge(older_than)

    # -- statistics -----------------------------------------------------------------

    def stats(self) -> WorkQueueStats:
        """Ready, in-flight, delayed and dead counts, redeliveries, oldest age."""
        self._check()
        return lease_stats(self._spool, self._region, self._take_seq(), self._dead.count())

    @staticmethod
    def stats_of(spool: Spool) -> WorkQueueStats | None:
        """Work-queue statistics of an open spool handle (None if it is not a work queue).

        Reads only: attaches nothing, so ``shmq stat`` can show them.
        """
        ctl = spool.ring.ctl
        if not ctl[F.W_WQ_LEASE_SLOTS]:
            return None
        i = spool.slots.find(TAKE_SLOT)
        take = spool.slots.word(i, F.S_SEQ) if i is not None else ctl[F.W_NEXT_SEQ]
        region = spool.lease_region()
        dead = 0
        if os.path.exists(spool.path + ".dead"):
            letters = DeadLetters(Spool.open(spool.path + ".dead"))
            try:
                dead = letters.count()
            finally:
                letters.close()
        try:
            return lease_stats(spool, region, take, dead)
        finally:
            region.release()


def _reopen(path: str, opts: dict[str, Any]) -> WorkQueue:
    return WorkQueue(path, **opts)
