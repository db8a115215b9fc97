"""The service's request ring: a ``block`` spool at the service's path whose calls
workers take as one group, and what a call looks like in it.

A call is one frame, the pickle (protocol 5, out-of-band buffers written
straight into the ring) of ``(call id, reply queue path, caller identity
word, deadline ns, attempt, request)``.  Workers take frames as members of
the group :data:`GROUP` (each frame to exactly one of them, in the core,
a few microseconds per take); the group's position is what callers read to
tell a call still queued (its seq at or past it) from one taken.

``call_many`` sends its calls in *bundles*: one frame holding consecutive call
ids (the first, and the count) and a list of requests (:func:`encode_bundles`),
pickled as one object, so
a batch of small calls costs one pickle, one put and one take instead of
one of each per call.  A bundle is in one worker's hands as a whole; a call
of it that is sent again goes alone.

There is no per-call lease record: what a worker holds it publishes on
the service board (:meth:`shmq.rpc.board.Board.hold`), and a caller sends
a call again when it is neither queued, nor in a live worker's hands, nor
answered (:mod:`shmq.rpc.client`).  The ring is fixed-size and ``block``:
a slow service makes callers wait in ``put`` (bounded memory).

A service made with ``copy=False`` takes a call whose pickle carries
out-of-band buffers (numpy, Arrow) without copying it: :func:`take_views`
pins its frame (:mod:`shmq.pins`) and :class:`PinnedFrame` decodes it over a
read-only view of the ring.  The pin lasts as long as anything references
those buffers (a finalizer on their one exporter): a request is never
overwritten while it is in use, and the ring cannot wrap past one a handler
keeps (the serving loop notices that and copies from then on).
"""

from __future__ import annotations

import time
import weakref
from pickle import loads as _loads
from typing import Any

from .. import _format as F
from .. import codec as _codec
from .._core import encode_batch
from ..columnar import PinnedView, private_copy
from ..errors import Empty, ShmqError, TooLarge
from ..spool import Spool

__all__ = ["GROUP", "create_or_open", "open_ring", "send", "encode_bundles", "put_bundles", "decode",
           "take_views", "PinnedFrame", "taken_up_to"]

#: The workers' group on the request ring.
GROUP = "calls"
#: A bundle larger than this pickled goes as separate calls (a worker copies its
#: frame at once; big requests are what out-of-band buffers are for).
BUNDLE_BYTES = 1 << 20
#: Smaller out-of-band frames are copied even with ``copy=False``: taking a frame
#: pinned costs a fixed 20-40 us more of Python than a copying take, which a copy
#: of about this size costs too (a worker's CPU per call, copying and pinned:
#: 213 and 253 us at 64 KiB, 273 and 267 at 512 KiB, 333 and 293 at 1 MiB).
PIN_MIN_BYTES = 512 << 10


def create_or_open(path: str, capacity: int | str) -> Spool:
    """The request ring at ``path``, created (with its group) if missing.

    :raises shmq.ShmqError: a spool of another kind is there (not ``block``).
    """
    # Open first: every worker (re)start attaches to the ring, and a create that
    # loses to an existing file still makes (and, unless killed, removes) a whole
    # pre-allocated temporary spool with its semaphores.
    try:
        sp = Spool.open(path)
    except FileNotFoundError:
        try:
            sp = Spool.create(path, capacity=capacity, on_full="block")
        except FileExistsError:  # another process created it meanwhile
            sp = Spool.open(path)
    try:
        if sp.on_full != "block" or (sp.slots.find(GROUP) is None and sp.slots.find("wq") is not None):
            kind = "a work queue (an older shmq's service?)" if sp.on_full == "block" else \
                f"a '{sp.on_full}' spool"
            raise ShmqError(f"{path}: {kind} is there, not a service's request ring "
                            "(Service.destroy it, or use another name)")
        sp.reader(GROUP, group=True).close()  # the group exists before any call is put
    except BaseException:
        sp.close()
        raise
    return sp


def open_ring(path: str, trusted: bool = False) -> Spool:
    """A caller's handle on an existing request ring (never creates one).

    The ring must pass the trust rule (docs/security.md) like the service's
    side: a ring another user can write or read is not where our calls go.

    :raises FileNotFoundError: no service there (yet).
    :raises shmq.UntrustedSpool: another user owns it or can write it.
    :raises shmq.ShmqError: what is there is not a request ring.
    """
    sp = Spool.open(path)
    try:
        _codec.require_trust(sp, trusted)
        if sp.on_full != "block" or sp.slots.find(GROUP) is None:
            raise ShmqError(f"{path}: not a service's request ring (no '{GROUP}' group)")
    except BaseException:
        sp.close()
        raise
    return sp


def send(spool: Spool, calls: list[Any], timeout: float | None) -> list[int]:
    """Put the call tuples, in order, and return their seqs.

    Runs of calls with the same codec go in one atomic batch; a batch
    larger than the ring goes call by call.

    :raises shmq.Full: no room within ``timeout``.
    :raises shmq.TooLarge: a single call can never fit in the ring.
    """
    batch = encode_batch(calls) if len(calls) > 1 else None  # all in-band pickles: one C call
    if batch is not None:
        parts, codec = batch
        try:
            first = spool.put_many(parts, timeout=timeout, codec=codec)
            return list(range(first, first + len(parts)))
        except TooLarge:
            pass  # larger than the ring as one batch: call by call below
    encoded = _codec.encode_many(calls)
    seqs: list[int] = []
    i = 0
    while i < len(encoded):
        codec = encoded[i][1]
        j = i + 1
        while j < len(encoded) and encoded[j][1] == codec:
            j += 1
        items = [e[0] for e in encoded[i:j]]
        if len(items) == 1 and codec == F.CODEC_PICKLE:
            seqs.append(spool.put(items[0], timeout=timeout, codec=codec))  # the core's fast put
        else:
            try:
                first = spool.put_many(items, timeout=timeout, codec=codec)
                seqs += range(first, first + len(items))
            except TooLarge:
                if len(items) == 1:
                    raise
                for item in items:
                    seqs.append(spool.put_many([item], timeout=timeout, codec=codec))
        i = j
    return seqs


def encode_bundles(bundles: list[tuple[Any, ...]]) -> list[bytes] | None:
    """Each bundle (``(first call id, reply queue path, caller, deadline ns, attempt,
    requests, len(requests))``) pickled as one frame; None if one of them would carry
    out-of-band buffers or is larger than :data:`BUNDLE_BYTES`: such calls go one by
    one (:func:`send`), their buffers straight into the ring.  The core's batch
    encoder (``shmq.Queue.put_many``'s) pickles them, in one call."""
    batch = encode_batch(bundles)  # None if a bundle has out-of-band buffers
    if batch is None or any(len(p) > BUNDLE_BYTES for p in batch[0]):
        return None
    return list(batch[0])


def put_bundles(spool: Spool, parts: list[bytes], timeout: float | None) -> list[int] | None:
    """Put :func:`encode_bundles`' frames in one batch; their seqs, or None (nothing
    put) if they never fit in the ring at once.

    :raises shmq.Full: no room within ``timeout``.
    """
    try:
        first = spool.put_many(parts, timeout=timeout, codec=F.CODEC_PICKLE)
    except TooLarge:
        return None
    return list(range(first, first + len(parts)))


class PinnedFrame:
    """A request frame as :func:`take_views` took it.  Pinned (``pin``, the
    :class:`shmq.columnar.PinnedView` that holds it; None for a copy), ``data`` is a
    read-only view of the ring, and the pin ends when :meth:`decode`'s objects are
    all gone, or with this object if it is never decoded."""

    __slots__ = ("seq", "timestamp_ns", "codec", "data", "pin")

    def __init__(self, seq: int, timestamp_ns: int, codec: int, data: Any,
                 pin: PinnedView | None) -> None:
        self.seq, self.timestamp_ns, self.codec, self.data, self.pin = seq, timestamp_ns, codec, data, pin

    def decode(self) -> Any:
        """The call tuple; its out-of-band buffers are read-only views of the frame."""
        import numpy as np

        # One exporter for every buffer the pickle refers to: numpy arrays and Arrow
        # buffers built over its slices keep it alive, and the pin ends with it.
        owner = np.frombuffer(self.data, np.uint8)
        pin, self.data, self.pin = self.pin, None, None
        assert pin is not None  # decode() is for pinned frames (see decode())
        weakref.finalize(owner, pin.release)
        return _codec.decode_item(owner.data, F.CODEC_PICKLE_OOB)


def take_views(spool: Spool, reader: Any, n: int, block: bool, timeout: float | None) -> list[Any]:
    """Frames for a ``copy=False`` worker (see the module docstring): the next one
    alone and pinned, as a :class:`PinnedFrame`, when it carries out-of-band buffers
    (:data:`PIN_MIN_BYTES` or more); otherwise up to ``n`` copied, as ``get_many``,
    but never past the next such frame.  The pins are ``spool.pins``'.

    Which frames are there is read from their headers without the group's lock
    (another worker may take them first): a frame can still be taken copied
    when other workers move the group's cursor meanwhile, never lost.

    :raises shmq.Empty: nothing within ``timeout``.
    """
    ring = spool.ring
    deadline = None
    while True:
        seq, pos = reader.cursor()
        if seq < ring.next_seq:
            k = 0  # frames before the first one to pin
            hit = None
            while k < n and seq + k < ring.next_seq:
                hit = ring.frame_at(seq + k, pos)
                if hit is None or (hit.codec == F.CODEC_PICKLE_OOB and hit.length >= PIN_MIN_BYTES):
                    break
                pos = hit.pos + hit.stored
                k += 1
            if k == 0 and hit is not None:
                got = reader.take(False, timeout)
                if got is not None:
                    # the put time: the header we looked at, if it is this frame's
                    ts = hit.ts if got[0] == hit.seq else time.time_ns()
                    return [_pinned_frame(spool, got, ts)]
            else:
                try:
                    return reader.get_many(max(k, 1), block=False)
                except Empty:
                    pass  # another worker took them
        if not block:  # nothing, or another worker took what we saw: never wait
            raise Empty("no frame available")
        deadline = reader.wait(timeout, deadline)


def _pinned_frame(spool: Spool, got: tuple[int, Any, int, int | None], ts: int) -> PinnedFrame:
    """The :class:`PinnedFrame` of what ``reader.take(copy=False)`` returned."""
    seq, data, codec, fpos = got
    if fpos is None:  # it could not be pinned (gone, or not a data frame): a copy
        return PinnedFrame(seq, ts, codec, data, None)
    pin = PinnedView(None, seq, spool.pins, fpos, data)
    if codec != F.CODEC_PICKLE_OOB:  # another worker took the one we saw: copy this one
        frame = PinnedFrame(seq, ts, codec, bytes(data), None)
        pin.release()
        return frame
    return PinnedFrame(seq, ts, codec, data.toreadonly(), pin)


def decode(frame: Any) -> Any:
    """A call tuple from its frame (the ring's trust was required when it was opened)."""
    if type(frame) is PinnedFrame and frame.pin is not None:
        return frame.decode()
    if frame.codec == F.CODEC_PICKLE:
        return _loads(frame.data)  # the common case, without the codec layer's dispatch
    data = frame.data
    if frame.codec == F.CODEC_PICKLE_OOB and not private_copy(data):
        data = bytearray(data)  # the buffers outlive the frame
    return _codec.decode_item(data, frame.codec)


def taken_up_to(spool: Spool, group: str = GROUP) -> int | None:
    """The position of the workers' ``group``: every frame with a smaller seq was taken
    by a worker (None if the group is gone)."""
    i = spool.slots.find(group)
    if i is None:
        return None
    return spool.slots.cursor(i)[0]
