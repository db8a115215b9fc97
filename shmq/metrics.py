"""Spool metrics: the Prometheus text exposition, a prometheus_client collector,
and read-only helpers that find spools and summarize their rate series.

``prometheus_client`` is optional: it is imported only by
:class:`ShmqCollector`, so ``import shmq.metrics`` works without it.

Metric names (every sample carries ``spool="<path>"``; reader metrics also
``reader="<name>"`` and ``kind="reader"|"group"``) are listed in
:data:`SPOOL_METRICS` and :data:`READER_METRICS` and in docs/cli.md; a
service's (``shmq.Service``: its request queue plus the board ``PATH.svc``)
carry ``service="<path>"`` and are in :data:`SERVICE_METRICS`.
"""

from __future__ import annotations

import os
import stat as _stat
import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from . import _format as F
from ._lock import holder_pid

if TYPE_CHECKING:
    from _typeshed import StrPath

    from .leases import WorkQueueStats
    from .stats import SpoolStats

__all__ = ["prometheus_text", "ShmqCollector", "SPOOL_METRICS", "READER_METRICS",
           "spool_paths", "peek", "rate_at", "series_window", "service_snapshot",
           "service_prometheus_text", "SERVICE_METRICS"]

_NS = 1e-9

#: (name, type, help, getter(SpoolStats)); counter names end in ``_total``.
SPOOL_METRICS = (
    ("shmq_capacity_bytes", "gauge", "Size of the data ring in bytes.", lambda s: s.capacity),
    ("shmq_used_bytes", "gauge", "Ring bytes holding frames.", lambda s: s.used_bytes),
    ("shmq_fill_ratio", "gauge", "used_bytes / capacity_bytes.", lambda s: s.fill),
    ("shmq_frames", "gauge", "Frames resident in the ring.", lambda s: s.frames),
    ("shmq_first_seq", "gauge", "Seq of the oldest frame in the ring.", lambda s: s.first_seq),
    ("shmq_next_seq", "gauge", "Seq the next committed frame gets.", lambda s: s.next_seq),
    ("shmq_puts_total", "counter", "Frames ever put.", lambda s: s.puts),
    ("shmq_put_bytes_total", "counter", "Payload bytes ever put.", lambda s: s.put_bytes),
    ("shmq_gets_total", "counter", "Frames read by named readers and groups.", lambda s: s.gets),
    ("shmq_get_bytes_total", "counter", "Payload bytes read by named readers and groups.",
     lambda s: s.get_bytes),
    ("shmq_lost_total", "counter", "Frames named readers and groups lost to overwrites.",
     lambda s: s.lost),
    ("shmq_evicted_total", "counter", "Frames pushed out of the ring to make room.",
     lambda s: s.evicted),
    ("shmq_high_water_frames", "gauge", "Most frames ever resident.", lambda s: s.high_water_frames),
    ("shmq_high_water_bytes", "gauge", "Most ring bytes ever in use.", lambda s: s.high_water_bytes),
    ("shmq_last_put_timestamp_seconds", "gauge", "Unix time of the last put (0: never).",
     lambda s: s.last_put_ns * _NS),
    ("shmq_last_get_timestamp_seconds", "gauge", "Unix time of the last named get (0: never).",
     lambda s: s.last_get_ns * _NS),
    ("shmq_delay_avg_seconds", "gauge", "Average put-to-get delay of named readers.",
     lambda s: s.avg_delay_ns * _NS),
    ("shmq_delay_max_seconds", "gauge", "Largest put-to-get delay of named readers.",
     lambda s: s.max_delay_ns * _NS),
    ("shmq_lock_held", "gauge", "1 while a writer holds the writer lock.",
     lambda s: int(bool(s.lock_pid))),
    ("shmq_lock_token", "gauge", "Writer lock fencing token (bumped when a dead holder's lock "
     "is broken).", lambda s: s.lock_token),
    ("shmq_lock_breaks_total", "counter", "Writer locks recovered from dead holders.",
     lambda s: s.lock_breaks),
)

#: (name, type, help, getter(ReaderStats)).
READER_METRICS = (
    ("shmq_reader_position", "gauge", "Committed cursor: the next seq the reader returns.",
     lambda r: r.position),
    ("shmq_reader_lag", "gauge", "Frames the reader has still to read.", lambda r: r.lag),
    ("shmq_reader_lag_bytes", "gauge", "Ring bytes the reader has still to read.",
     lambda r: r.lag_bytes),
    ("shmq_reader_lost_total", "counter", "Frames overwritten before the reader got them.",
     lambda r: r.lost),
    ("shmq_reader_gets_total", "counter", "Frames read.", lambda r: r.gets),
    ("shmq_reader_get_bytes_total", "counter", "Payload bytes read.", lambda r: r.get_bytes),
    ("shmq_reader_delay_avg_seconds", "gauge", "Average put-to-get delay.",
     lambda r: r.avg_delay_ns * _NS),
    ("shmq_reader_delay_max_seconds", "gauge", "Largest put-to-get delay.",
     lambda r: r.max_delay_ns * _NS),
    ("shmq_reader_alive", "gauge", "1 while a process has the reader attached.",
     lambda r: int(r.alive)),
)


def _escape(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(pairs: Iterable[tuple[str, str]]) -> str:
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in pairs) + "}"


def _num(v: float) -> str:
    if isinstance(v, float):
        return repr(v) if v == v and v not in (float("inf"), float("-inf")) else str(v)
    return str(int(v))


def prometheus_text(stats_list: Iterable[SpoolStats]) -> str:
    """The Prometheus text exposition (format 0.0.4) of some :class:`shmq.SpoolStats`.

    One ``# HELP``/``# TYPE`` pair per metric, then one sample per spool
    (and per named reader/group for the ``shmq_reader_*`` metrics).
    Pure: reads only the snapshots given.
    """
    stats_list = list(stats_list)
    out: list[str] = []
    for name, kind, doc, get in SPOOL_METRICS:
        out.append(f"# HELP {name} {doc}")
        out.append(f"# TYPE {name} {kind}")
        for s in stats_list:
            out.append(f"{name}{_labels([('spool', s.path)])} {_num(get(s))}")
    out.append("# HELP shmq_info Static facts about a spool (value is always 1).")
    out.append("# TYPE shmq_info gauge")
    for s in stats_list:
        out.append(f"shmq_info{_labels([('spool', s.path), ('on_full', s.on_full), ('checksum', str(s.checksum).lower())])} 1")
    for name, kind, doc, get in READER_METRICS:
        out.append(f"# HELP {name} {doc}")
        out.append(f"# TYPE {name} {kind}")
        for s in stats_list:
            for r in s.readers:
                labels = _labels([("spool", s.path), ("reader", r.name), ("kind", r.kind)])
                out.append(f"{name}{labels} {_num(get(r))}")
    return "\n".join(out) + "\n"


class ShmqCollector:
    """A ``prometheus_client`` collector for spools (paths of spools or of directories).

    Each scrape opens the spools, snapshots :meth:`shmq.Spool.stats` and
    closes them, so spools created or removed later are picked up.
    ``shmq_up{spool=...}`` is 0 for a path that cannot be read.  Usage::

        from prometheus_client import REGISTRY
        REGISTRY.register(ShmqCollector([f"/dev/shm/shmq-{os.geteuid()}"]))  # your spools

    :raises ImportError: prometheus_client is not installed (at construction).
    """

    def __init__(self, paths: StrPath | Iterable[StrPath]) -> None:
        import importlib

        importlib.import_module("prometheus_client.core")  # optional dependency: fail early

        self.paths = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)

    def describe(self) -> list[Any]:
        return []  # do not scrape at registration time

    def _snapshots(self) -> tuple[list[SpoolStats], list[str], list[tuple[str, dict[str, Any]]]]:
        from .spool import Spool

        out, failed, services = [], [], []
        for path in spool_paths(self.paths):
            try:
                with Spool.open(path) as sp:
                    out.append(sp.stats())
                    svc = service_snapshot(sp)
            except Exception:  # one bad spool must not break the scrape
                failed.append(path)
                continue
            if svc is not None and "error" not in svc:
                services.append((path, svc))
        return out, failed, services

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        snaps, failed, services = self._snapshots()
        up = GaugeMetricFamily("shmq_up", "1 if the spool could be read.", labels=["spool"])
        for s in snaps:
            up.add_metric([s.path], 1)
        for path in failed:
            up.add_metric([path], 0)
        yield up

        def family(name: str, kind: str, doc: str, labels: list[str]) -> Any:
            if kind == "counter":
                return CounterMetricFamily(name[:-len("_total")], doc, labels=labels)
            return GaugeMetricFamily(name, doc, labels=labels)

        for name, kind, doc, get in SPOOL_METRICS:
            fam = family(name, kind, doc, ["spool"])
            for s in snaps:
                fam.add_metric([s.path], get(s))
            yield fam
        info = GaugeMetricFamily("shmq_info", "Static facts about a spool (value is always 1).",
                                 labels=["spool", "on_full", "checksum"])
        for s in snaps:
            info.add_metric([s.path, s.on_full, str(s.checksum).lower()], 1)
        yield info
        for name, kind, doc, get in READER_METRICS:
            fam = family(name, kind, doc, ["spool", "reader", "kind"])
            for s in snaps:
                for r in s.readers:
                    fam.add_metric([s.path, r.name, r.kind], get(r))
            yield fam
        fams: dict[str, Any] = {}
        for path, snap in services:
            for name, kind, doc, extra, v in _service_samples(snap):
                if name not in fams:
                    fams[name] = family(name, kind, doc, ["service"] + [k for k, _ in extra])
                fams[name].add_metric([path] + [val for _, val in extra], v)
        yield from fams.values()


# --- finding spools and reading their header without attaching ------------


def spool_paths(paths: Iterable[StrPath]) -> list[str]:
    """Expand ``paths`` (spool files or directories) into spool file paths.

    Directory entries are kept when they are regular files (not symlinks,
    not hidden) whose geometry validates; anything else is skipped silently.
    """
    from ._mapping import read_geometry

    out = []
    for p in paths:
        p = os.fspath(p)
        if os.path.isdir(p) and not os.path.islink(p):
            try:
                names = sorted(os.listdir(p))
            except OSError:
                continue
            for name in names:
                if name.startswith("."):
                    continue
                full = os.path.join(p, name)
                try:
                    st = os.lstat(full)
                    if not _stat.S_ISREG(st.st_mode) or st.st_size < F.HEADER_BYTES:
                        continue
                    read_geometry(full)
                except Exception:
                    continue
                out.append(full)
        else:
            out.append(os.path.abspath(p))
    return out


def peek(path: str) -> dict[str, Any]:
    """Geometry and control words of a spool, read with ``pread`` (no mapping, no semaphores).

    Works on spools the caller can read but not write.  The words are a
    racy snapshot: fine for listings, not for decisions.

    :raises OSError: cannot read the file.
    :raises shmq.SpoolFormatError: not a spool.
    """
    from ._mapping import open_file

    fd, st = open_file(path, write=False)  # never follows, never blocks, regular files only
    try:
        size = st.st_size
        head = os.pread(fd, F.HEADER_BYTES, 0)
        geo = F.unpack_geometry(head[:F.GEOMETRY.size], size, path)
    finally:
        os.close(fd)
    ctl = memoryview(head).cast("Q")
    series = []
    now = int(time.time())
    for k in range(F.RATE_SECONDS):
        b = F.W_RATE + k * F.RATE_WORDS
        if ctl[b] and now - ctl[b] < F.RATE_SECONDS:
            series.append((ctl[b], ctl[b + 1], ctl[b + 2]))
    series.sort()
    nxt, first = ctl[F.W_NEXT_SEQ], ctl[F.W_FIRST_SEQ]
    used = max(0, ctl[F.W_NEXT_POS] - ctl[F.W_FIRST_POS])
    return {
        "path": path, "capacity": geo["ring_bytes"], "file_bytes": geo["file_bytes"],
        "allocated": st.st_blocks * 512, "growable": bool(ctl[F.W_SEGMENT]),
        "on_full": geo["policy"], "checksum": geo["checksum"], "slots": geo["slot_count"],
        "created_ns": geo["created_ns"], "first_seq": first, "next_seq": nxt,
        "frames": max(0, nxt - first), "used_bytes": used,
        "fill": min(1.0, used / geo["ring_bytes"]), "put_bytes": ctl[F.W_PUT_BYTES],
        "last_put_ns": ctl[F.W_LAST_PUT_NS], "lock_pid": holder_pid(ctl[F.W_LOCK_HOLDER]),
        "write_rate": [(s, p) for s, p, _g in series], "read_rate": [(s, g) for s, _p, g in series],
    }


def rate_at(series: Iterable[tuple[int, int]], second: int) -> int:
    """Frames counted in unix ``second`` by a ``(second, frames)`` series (0 if absent)."""
    for s, n in series:
        if s == second:
            return n
    return 0


def series_window(series: Iterable[tuple[int, int]], seconds: int,
                  now: float | None = None) -> list[int]:
    """Per-second counts for the ``seconds`` complete seconds before ``now``, oldest first."""
    now = int(time.time() if now is None else now)
    d = dict(series)
    return [d.get(s, 0) for s in range(now - seconds, now)]


#: (field of WorkQueueStats, help) for ``shmq_workqueue_<field>`` gauges.
WORKQUEUE_METRICS = (
    ("ready", "Messages deliverable now (committed, not yet handed out, plus due retries)."),
    ("in_flight", "Messages under lease."),
    ("delayed", "Messages waiting for their not-before time."),
    ("dead", "Messages in the dead-letter spool."),
    ("redeliveries", "Deliveries after a nack, an expired lease or a dead holder."),
    ("acked", "Messages acknowledged."),
    ("superseded", "Messages replaced by a newer one with the same key."),
    ("oldest_age_s", "Age in seconds of the oldest message not yet acked."),
    ("lease_slots_used", "Lease records in use."),
)


def workqueue_prometheus_text(path: str, wq: WorkQueueStats) -> str:
    """Prometheus text exposition of a :class:`shmq.WorkQueueStats` for spool ``path``."""
    out: list[str] = []
    labels = _labels([("spool", path)])
    for field, help_ in WORKQUEUE_METRICS:
        name = f"shmq_workqueue_{field}"
        out += [f"# HELP {name} {help_}", f"# TYPE {name} gauge",
                f"{name}{labels} {_num(getattr(wq, field))}"]
    return "\n".join(out) + "\n"


# --- services (shmq.Service): the board PATH.svc and the request queue ---------


def service_snapshot(spool: Any) -> dict[str, Any] | None:
    """The service view of an open spool: None if no service board is next to it, else
    :func:`shmq.rpc.board.service_status` (``in_flight`` among it) plus ``queued`` (calls
    waiting in the request ring), or ``{"error": message}`` for a board that
    cannot be read (not a regular file, not a board).  Reads only; never blocks."""
    from .errors import ShmqError
    from .rpc.board import board_path, service_status
    from .rpc.service import queued_calls

    try:  # a regular file only: a FIFO planted at PATH.svc must not block anyone
        st = os.lstat(board_path(spool.path))
    except OSError:
        return None
    if not _stat.S_ISREG(st.st_mode):
        return {"error": f"{board_path(spool.path)}: not a regular file, not a service board"}
    try:
        out = service_status(spool.path)
    except (OSError, ShmqError) as exc:
        return {"error": str(exc)}
    out["queued"] = queued_calls(spool)
    return out


#: (name, type, help, getter(service_snapshot dict)); latency gauges carry ``quantile``.
SERVICE_METRICS = (
    ("shmq_service_workers", "gauge", "Processes serving the service (holding a board row).",
     lambda s: s["workers"]),
    ("shmq_service_busy", "gauge", "Serving processes holding a call now.", lambda s: s["busy"]),
    ("shmq_service_queued", "gauge", "Calls waiting in the request queue.",
     lambda s: s["queued"]),
    ("shmq_service_in_flight", "gauge", "Calls taken by a worker and not answered yet.",
     lambda s: s["in_flight"]),
    ("shmq_service_calls_total", "counter", "Calls answered (errors included).",
     lambda s: s["calls"]),
    ("shmq_service_failed_total", "counter", "Calls answered with an error.",
     lambda s: s["failed"]),
    ("shmq_service_expired_total", "counter", "Calls dropped: their caller had given up.",
     lambda s: s["expired"]),
    ("shmq_service_redeliveries_total", "counter",
     "Calls taken again: sent again by their caller after a worker died holding them.",
     lambda s: s["redeliveries"]),
)
#: (name, help, key of the snapshot) for the quantile gauges (seconds, bucket midpoints).
SERVICE_QUANTILES = (
    ("shmq_service_latency_seconds", "Call latency, the caller's put to the reply written "
     "(log buckets, within 12.5%).", "latency"),
    ("shmq_service_service_seconds", "Service time, the call handed to the handler to its "
     "answer (log buckets, within 12.5%).", "service_time"),
)


def _service_samples(snap: dict[str, Any]) -> Iterator[tuple[str, str, str, list[tuple[str, str]], float]]:
    """``(name, kind, help, extra labels, value)`` of one service snapshot (values known only)."""
    for name, kind, doc, get in SERVICE_METRICS:
        v = get(snap)
        if v is not None:
            yield name, kind, doc, [], v
    for name, doc, key in SERVICE_QUANTILES:
        summary = snap[key]
        for q in ("0.5", "0.99"):
            v = summary["p50" if q == "0.5" else "p99"]
            if v is not None:
                yield name, "gauge", doc, [("quantile", q)], v


def service_prometheus_text(path: str, snap: dict[str, Any]) -> str:
    """Prometheus text exposition of a :func:`service_snapshot` for the service at ``path``."""
    out: list[str] = []
    seen = set()
    for name, kind, doc, extra, v in _service_samples(snap):
        if name not in seen:
            seen.add(name)
            out += [f"# HELP {name} {doc}", f"# TYPE {name} {kind}"]
        out.append(f"{name}{_labels([('service', path)] + extra)} {_num(v)}")
    return "\n".join(out) + "\n" if out else ""
