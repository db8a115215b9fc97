"""The codec layer: the one place where frame bytes become objects, and the one trust check.

Every frame carries a codec tag (``_format.CODEC_*``).  This module turns
objects into payloads (:func:`encode`, :func:`encode_workq`) and payloads
back into objects (:func:`decode`, :func:`decode_item`, :func:`decode_workq`,
:func:`decode_dead`), for ``Queue``, ``WorkQueue`` (and its dead-letter
spool), the CLI and everything built on them.

Queue items that are exact builtin values (a dict of str, int, float,
list ...) are written in the ``values`` codec, without pickle
(``shmq/core/values.c``: about three times faster each way); anything else
is pickled.

Pickles are code: whoever can write a spool can make its readers run
anything when they unpickle.  So pickled codecs (``pickle``,
``pickle-oob``, ``workqueue``), and the ``values`` codec with them (queue
items are objects from one trusted writer or none, whatever their
encoding), are decoded only under a :class:`Trust` that allows it: the spool file is owned by the effective user and not
writable by group or others, or the caller opted in (``trusted=True``,
``--unsafe-pickle``).  The decision is made from ``fstat`` of the
descriptor actually mapped, never from a second ``stat`` of the path
(which another user could swap in between).  It is stable for the life
of the mapping: only the owner (us, if trusted) can chmod the file, and
only root can chown it.  docs/security.md has the threat model.

The other codecs (raw, utf8, json, numpy, arrow) are decoded whatever the
trust.
"""

from __future__ import annotations

import os
import pickle
import stat
from collections.abc import Iterable

from . import _core
from . import _format as F
from ._lazy import TYPE_CHECKING, columnar
from .errors import ShmqError, UntrustedSpool

if TYPE_CHECKING:
    from typing import Any

    from _typeshed import ReadableBuffer

    from .spool import Spool

__all__ = ["Trust", "TRUSTED", "PICKLED", "OBJECTS", "trust_of", "require_trust", "encode", "decode",
           "decode_item", "encode_workq", "decode_workq", "encode_dead", "decode_dead"]

#: Codecs whose payloads are (or contain) pickles.
PICKLED = frozenset({F.CODEC_PICKLE, F.CODEC_PICKLE_OOB, F.CODEC_WORKQ})
#: Codecs decoded only under trust: the pickled ones and the values codec.
OBJECTS = PICKLED | {F.CODEC_VALUES}
PROTOCOL = 5  # out-of-band buffers (PickleBuffer, numpy) need protocol 5

_dumps = pickle.dumps
_loads = pickle.loads
_values_dumps = _core.values_dumps  # None: not only exact builtin values
_values_loads = _core.values_loads


def _user(uid: int) -> str:
    try:
        import pwd

        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (KeyError, ImportError):
        return f"uid {uid}"


class Trust:
    """May pickles from one spool file be loaded?  Decided once, from ``fstat``.

    ``path`` names the file in messages; ``st`` is the ``os.stat_result``
    of the descriptor that is mapped; ``opted_in`` is the caller's
    ``trusted=True``.  ``reason`` is None when the file is ours and private.
    """

    __slots__ = ("path", "uid", "mode", "opted_in", "reason")
    reason: str | None

    def __init__(self, path: str, st: os.stat_result, opted_in: bool = False,
                 network: bool = False) -> None:
        self.path = path
        self.uid = st.st_uid
        self.mode = stat.S_IMODE(st.st_mode)
        self.opted_in = bool(opted_in)
        me = os.geteuid()
        if network:  # written by `shmq sub`: another host's bytes, whoever owns the file
            self.reason = "fed from the network (shmq sub)"
        elif self.uid != me:
            self.reason = "owned by another user"
        elif self.mode & 0o022:
            who = [w for w, bit in (("group", 0o020), ("others", 0o002)) if self.mode & bit]
            self.reason = f"writable by {' and '.join(who)}"
        else:
            self.reason = None

    @property
    def ok(self) -> bool:
        """True if pickles may be loaded (the file is ours and private, or the caller opted in)."""
        return self.opted_in or self.reason is None

    def error(self) -> UntrustedSpool:
        return UntrustedSpool(
            f"{self.path} is {self.reason} (owner {_user(self.uid)}, mode {self.mode:04o}; you "
            f"are {_user(os.geteuid())}): refusing to unpickle from it, since whoever can write "
            "it could run code in this process; pass trusted=True (CLI: --unsafe-pickle) if "
            "you trust them")

    def check(self) -> None:
        """:raises shmq.UntrustedSpool: pickles from this file must not be loaded."""
        if not self.ok:
            raise self.error()

    def __repr__(self) -> str:
        return f"<shmq.codec.Trust {self.path} ok={self.ok}>"


class _Opted(Trust):
    """The caller vouched for the bytes (``--unsafe-pickle``, a frame it wrote itself)."""

    def __init__(self) -> None:
        self.path, self.uid, self.mode, self.opted_in, self.reason = "(caller)", -1, 0, True, None


#: A trust the caller grants explicitly (CLI ``--unsafe-pickle``): pickles are loaded.
TRUSTED = _Opted()


def trust_of(spool: Spool, trusted: bool = False) -> Trust:
    """The :class:`Trust` of an open spool handle, from ``fstat`` of its mapped descriptor."""
    m = spool.mapping
    return Trust(m.path, os.fstat(m.fd), trusted, network=F.from_network(m.geo))


def require_trust(spool: Spool, trusted: bool = False) -> Trust:
    """:func:`trust_of`, raising at once if pickles from ``spool`` must not be loaded.

    :raises shmq.UntrustedSpool: another user owns the file or can write it, and
        ``trusted`` is false (the message names the file, its owner and mode).
    """
    t = trust_of(spool, trusted)
    t.check()
    return t


# --- encoding -------------------------------------------------------------------


def encode(obj: object) -> tuple[Any, int]:
    """``(frame item, codec)`` for a queue item: ``bytes`` as they are (raw), exact
    builtin values in the values codec, else a pickle.

    Out-of-band buffers (numpy arrays, PickleBuffer) stay uncopied: the item
    is then a tuple of parts the spool writes one after the other.

    :raises pickle.PicklingError: (or what ``__reduce__`` raised) the object cannot be pickled.
    """
    if type(obj) is bytes:
        return obj, F.CODEC_RAW
    data = _values_dumps(obj)
    if data is not None:
        return data, F.CODEC_VALUES
    buffers: list[pickle.PickleBuffer] = []
    data = _dumps(obj, PROTOCOL, buffer_callback=buffers.append)
    if not buffers:
        return data, F.CODEC_PICKLE
    return _with_buffers(data, buffers)


def encode_many(objs: Iterable[object]) -> list[tuple[Any, int]]:
    """:func:`encode` of each object, with one buffer list for the whole batch
    (a batch of small objects spends a fifth of its time on per-item set-up)."""
    out: list[tuple[Any, int]] = []
    append = out.append
    buffers: list[pickle.PickleBuffer] = []
    collect = buffers.append
    raw, pickled = F.CODEC_RAW, F.CODEC_PICKLE
    values = F.CODEC_VALUES
    for obj in objs:
        if type(obj) is bytes:
            append((obj, raw))
            continue
        data = _values_dumps(obj)
        if data is not None:
            append((data, values))
            continue
        data = _dumps(obj, PROTOCOL, buffer_callback=collect)
        if buffers:
            append(_with_buffers(data, list(buffers)))
            buffers.clear()
        else:
            append((data, pickled))
    return out


def _with_buffers(data: bytes, buffers: list[pickle.PickleBuffer]) -> tuple[tuple[Any, ...], int]:
    """A pickle with out-of-band buffers as one frame item: header, pickle, buffers."""
    raws = [b.raw() for b in buffers]
    lens = [r.nbytes for r in raws]
    parts: list[Any] = [F.pack_oob_header(len(data), lens), data, F.oob_padding(len(data))]
    for r, n in zip(raws, lens):
        parts += [r, F.oob_padding(n)]
    return tuple(parts), F.CODEC_PICKLE_OOB


def encode_workq(obj: object, headers: dict[str, Any] | None, key: str | bytes | None,
                 head: bytes) -> tuple[bytes, bytes]:
    """A work queue message payload: the packed ``WQ_HEADER`` ``head``, then the pickled body."""
    return head, _dumps((obj, headers, key), PROTOCOL)


def encode_dead(record: dict[str, Any]) -> bytes:
    """A dead-letter record (a dict with the failed message's ``payload`` bytes)."""
    return _dumps(record, PROTOCOL)


# --- decoding -------------------------------------------------------------------


def decode_item(data: ReadableBuffer, codec: int) -> Any:
    """A ``Queue`` item from its payload, for a queue whose :class:`Trust` was required
    when it attached (``Queue`` and its subclasses refuse an untrusted spool at once).

    :raises shmq.ShmqError: a codec a queue never writes.
    """
    if codec == F.CODEC_VALUES:
        return _values_loads(data)
    if codec == F.CODEC_PICKLE:
        return _loads(data)
    if codec == F.CODEC_RAW:
        return data
    if codec == F.CODEC_PICKLE_OOB:
        pickled, buffers = F.unpack_oob(memoryview(data))
        return _loads(pickled, buffers=buffers)
    raise ShmqError(f"frame with codec {codec} is not a queue item (was the spool written by "
                    "something other than shmq.Queue?)")


def decode(data: ReadableBuffer, codec: int | None, trust: Trust) -> Any:
    """Any frame's payload as an object, by its codec tag.

    raw: the bytes; utf8: str; json: the parsed value; numpy: a read-only
    array over ``data``; arrow: a ``pyarrow.Table``; pickle, pickle-oob,
    values: the object; workqueue: ``(body, headers, key)``.

    :raises shmq.UntrustedSpool: a pickled or values codec and ``trust`` does not allow it.
    :raises shmq.ShmqError: an unknown codec or a damaged payload.
    :raises ValueError: invalid UTF-8 or JSON, or a damaged values payload.
    """
    if codec in OBJECTS:
        trust.check()
        if codec == F.CODEC_WORKQ:
            return decode_workq(data, trust)
        if codec == F.CODEC_PICKLE_OOB:
            data = bytearray(data)  # buffers must outlive the frame they came from
        return decode_item(data, codec)
    if codec in (F.CODEC_RAW, None):
        return data
    if codec == F.CODEC_UTF8:
        return bytes(data).decode("utf-8")
    if codec == F.CODEC_JSON:
        import json

        return json.loads(bytes(data))
    if codec == F.CODEC_NUMPY:
        return columnar().decode_array(data)
    if codec == F.CODEC_ARROW:
        return columnar().decode_arrow(data)
    raise ShmqError(f"unknown codec {codec} (a newer shmq, or a damaged frame header)")


def decode_workq(data: ReadableBuffer, trust: Trust) -> tuple[Any, dict[str, Any] | None, str | bytes | None]:
    """``(body, headers, key)`` of a work queue message payload.

    :raises shmq.UntrustedSpool: ``trust`` does not allow unpickling.
    """
    trust.check()
    return _loads(memoryview(data)[F.WQ_HEADER.size:])


def decode_dead(data: ReadableBuffer, trust: Trust, body: bool = True) -> dict[str, Any]:
    """A dead-letter record; with ``body``, its ``payload`` decoded into
    ``record["message"] = (body, headers, key)``.

    :raises shmq.UntrustedSpool: ``trust`` does not allow unpickling.
    """
    trust.check()
    rec = _loads(data)
    if not isinstance(rec, dict) or "payload" not in rec:
        raise ShmqError("not a dead-letter record")
    if body:
        rec["message"] = _loads(rec["payload"])
    return rec
