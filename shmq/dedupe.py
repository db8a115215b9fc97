"""Frame stamps and deduplication for consumers of Spark-written spools (no pyspark needed).

The Spark sink (``shmq.spark``) writes at least once: a retried task writes
its rows again.  It can stamp every frame with where it came from (writer
id, batch id, partition, attempt, row index); a consumer recognises the
duplicates by stamp key with :class:`Deduper`.  This module needs only the
standard library, so a plain sidecar process can dedupe without installing
pyspark; ``shmq.spark`` re-exports every name here.
"""

from __future__ import annotations

import json
import struct
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

__all__ = ["Stamp", "Deduper", "split_stamp", "pop_stamp", "arrow_stamp", "STAMP_MAGIC",
           "STAMP_BYTES", "STAMP_LAST", "STAMP_FIELD", "ARROW_STAMP_KEY"]

# The "prefix" stamp: 40 bytes in front of the payload, little-endian:
#   magic 8s  b"\x93SHMQst\x01" (0x93 never starts UTF-8, JSON or a pickle)
#   writer Q  first 64 bits of the streaming query id / batch write job id
#   batch  q  micro-batch id (-1 for a batch write)
#   part   i  Spark partition id
#   attempt H Spark task attempt number (saturates at 65535)
#   flags  H  bit 0: the last frame this task attempt wrote
#   row    Q  row index within the task's partition
# (Kept here rather than in _format: it is the Spark layer's envelope, not
# part of the spool format; the spool never looks inside payloads.)

STAMP_MAGIC = b"\x93SHMQst\x01"
STAMP_STRUCT = struct.Struct("<8sQqiHHQ")
STAMP_BYTES = STAMP_STRUCT.size
assert STAMP_BYTES == 40
STAMP_LAST = 0x1
STAMP_FIELD = "_shmq"  # the JSON/pickle stamp's key


@dataclass(frozen=True)
class Stamp:
    """Where a frame written by the Spark sink came from.

    ``key`` is the same for every copy of one logical row: a retried task
    (or a replayed micro-batch after a restart, which keeps its query id
    and batch id) writes the same rows under the same key with another
    ``attempt``.  Row indexes are stable only if the partition's content
    and order are deterministic; otherwise deduplicate per task attempt
    (``task``), using ``last`` to know that an attempt is complete.
    """

    writer: str  # 16 hex digits
    batch: int
    partition: int
    attempt: int
    row: int
    last: bool = False
    rows: int = 1  # rows in the frame (Arrow frames carry many; ``row`` is the first)

    @property
    def key(self) -> tuple[str, int, int, int]:
        """``(writer, batch, partition, row)``: equal for duplicates of one row."""
        return (self.writer, self.batch, self.partition, self.row)

    @property
    def task(self) -> tuple[str, int, int]:
        """``(writer, batch, partition)``: the logical task (all its attempts)."""
        return (self.writer, self.batch, self.partition)

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"w": self.writer, "b": self.batch, "p": self.partition, "a": self.attempt, "i": self.row}
        if self.rows != 1:
            d["n"] = self.rows
        if self.last:
            d["last"] = True
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Stamp":
        return cls(str(d["w"]), int(d["b"]), int(d["p"]), int(d["a"]), int(d["i"]),
                   bool(d.get("last", False)), int(d.get("n", 1)))

    def pack(self) -> bytes:
        return STAMP_STRUCT.pack(STAMP_MAGIC, int(self.writer, 16), self.batch, self.partition,
                           min(self.attempt, 0xFFFF), STAMP_LAST if self.last else 0, self.row)


def split_stamp(data: bytes | bytearray | memoryview
                ) -> tuple[Stamp | None, bytes | bytearray | memoryview]:
    """Return ``(Stamp or None, payload)`` for a frame's bytes.

    Understands the 40-byte prefix stamp (``stamp="prefix"``); for JSON or
    pickle frames stamped in a field, decode the frame and use
    :meth:`Stamp.from_json` on its ``"_shmq"`` entry (see :func:`pop_stamp`).
    The payload is a zero-copy memoryview slice when a prefix is removed.
    """
    if len(data) >= STAMP_BYTES and data[:8] == STAMP_MAGIC:
        _m, writer, batch, part, attempt, flags, row = STAMP_STRUCT.unpack_from(data)
        return (Stamp(f"{writer:016x}", batch, part, attempt, row, bool(flags & STAMP_LAST)),
                memoryview(data)[STAMP_BYTES:])
    return None, data


def pop_stamp(record: object) -> Stamp | None:
    """Remove and return the :class:`Stamp` of a decoded JSON/pickle row dict (None if unstamped)."""
    d = record.pop(STAMP_FIELD, None) if isinstance(record, dict) else None
    return Stamp.from_json(d) if d else None


ARROW_STAMP_KEY = b"shmq.stamp"  # Arrow frames: the stamp is schema metadata


def arrow_stamp(table: Any) -> Stamp | None:
    """The :class:`Stamp` of an Arrow frame (``Reader.get_arrow()``), or None."""
    meta = table.schema.metadata or {}
    raw = meta.get(ARROW_STAMP_KEY)
    return Stamp.from_json(json.loads(raw)) if raw else None


class Deduper:
    """Recognise rows a retried Spark task wrote twice, by stamp key.

    ``seen(stamp)`` is True for a key seen before (drop that frame).  Keeps
    the most recent ``max_keys`` keys: size it to cover the longest
    stretch over which a retry can land (a few micro-batches).
    """

    def __init__(self, max_keys: int = 1_000_000) -> None:
        self._keys: OrderedDict[tuple[str, int, int, int], None] = OrderedDict()
        self._max = max_keys
        self.duplicates = 0

    def seen(self, stamp: Stamp | None) -> bool:
        if stamp is None:
            return False
        k = stamp.key
        if k in self._keys:
            self.duplicates += 1
            return True
        self._keys[k] = None
        if len(self._keys) > self._max:
            self._keys.popitem(last=False)
        return False
