"""Statistics records returned by :meth:`shmq.Spool.stats` and :meth:`shmq.Spool.readers`.

They are snapshots assembled from the control block and the reader table;
nothing here touches shared memory after construction.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class ReaderStats:
    """One named reader or group, as recorded in the spool's reader table.

    ``position`` is the committed cursor (next seq to read); ``lag`` and
    ``lag_bytes`` are what it still has to read; ``lost`` counts frames that
    were overwritten before it read them (exact).  ``high_water``/
    ``low_water`` are the largest/smallest lag seen when it read.  Counters
    are kept per handle and flushed to the spool every 64 frames, when the
    reader has slept 1 ms waiting for frames, and when it closes (a group's under the group lock), so
    a killed reader's last unflushed frames are not counted.
    """

    name: str
    kind: str  # "reader" or "group"
    position: int
    lag: int
    lag_bytes: int
    lost: int
    gets: int
    get_bytes: int
    last_get_ns: int
    avg_delay_ns: int
    max_delay_ns: int
    high_water: int
    low_water: int
    pid: int
    alive: bool
    slot: int

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class SpoolStats:
    """A snapshot of a spool's control block (see docs/guide.md, "Statistics").

    Frame counts are exact for writers (kept under the writer lock).
    ``gets``/``get_bytes``/delays/``lost`` sum the named readers and groups;
    anonymous readers keep no shared statistics.  ``write_rate`` and
    ``read_rate`` are ``(unix_second, frames)`` pairs for the last minute,
    oldest first; the read series is approximate when several readers
    update the same second concurrently.
    """

    path: str
    capacity: int
    on_full: str
    checksum: bool
    first_seq: int
    next_seq: int
    frames: int
    used_bytes: int
    fill: float
    puts: int
    put_bytes: int
    last_put_ns: int
    gets: int
    get_bytes: int
    last_get_ns: int
    avg_delay_ns: int
    max_delay_ns: int
    lost: int
    evicted: int
    high_water: int
    low_water: int
    high_water_frames: int
    high_water_bytes: int
    lock_pid: int
    lock_token: int
    lock_breaks: int
    #: bytes of the filesystem the file uses now (a growable spool's follow its backlog)
    allocated: int = 0
    growable: bool = False
    #: segments a growable spool has allocated since creation
    growths: int = 0
    write_rate: tuple = ()
    read_rate: tuple = ()
    readers: tuple = field(default_factory=tuple)

    def as_dict(self) -> dict:
        d = asdict(self)
        d["write_rate"] = [list(p) for p in self.write_rate]
        d["read_rate"] = [list(p) for p in self.read_rate]
        return d
