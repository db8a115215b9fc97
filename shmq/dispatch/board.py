"""The status board ``PATH.dispatch``: its format, and reading it from any process.

A small memory-mapped file: a header of 8-byte words (magic, version, the
supervisor's identity and state, per-type targets and live counts, a JSON
config block at :data:`JSON_OFF`), then one row per worker slot (counters,
the message in progress, a ring of recent latencies).  Every word is
published with one aligned 8-byte store (``memoryview(...).cast("Q")``), so
readers never see a torn counter.  One writer per word at a time: a row
belongs to its worker while the worker lives, then to the supervisor.
"""

from __future__ import annotations

import fcntl
import json
import math
import mmap
import os
import stat as _stat
import time
from typing import TYPE_CHECKING, Any

from .._lock import holder_alive, holder_pid, holder_word
from .._mapping import open_file, resolve_path
from ..errors import ShmqError
from .registry import MAX_TYPES, attach

if TYPE_CHECKING:
    from _typeshed import StrPath

MAGIC = int.from_bytes(b"SHMQDSP1", "little")
VERSION = 1
HDR_BYTES = 16384
JSON_OFF = 2048
# header words
(H_MAGIC, H_VERSION, H_HOLDER, H_STATE, H_NROWS, H_RESERVOIR, H_NTYPES, H_STARTED_NS,
 H_JSON_LEN, H_ROUTED, H_UNROUTABLE, H_STOPPED_NS) = range(12)
H_TARGET = 16  # one word per type
H_LIVE = H_TARGET + MAX_TYPES
STATE_STOPPED, STATE_STARTING, STATE_RUNNING, STATE_STOPPING = 0, 1, 2, 3
STATE_NAMES = {STATE_STOPPED: "stopped", STATE_STARTING: "starting", STATE_RUNNING: "running",
               STATE_STOPPING: "stopping"}
# row words (one row per worker slot; one writer at a time: its worker, or the
# supervisor once that worker is dead)
(R_TYPE, R_HOLDER, R_PROCESSED, R_FAILED, R_TIMED_OUT, R_CRASHED, R_BUSY, R_MSG, R_SLOT,
 R_TOKEN, R_ATTEMPT, R_STARTED_NS, R_DEADLINE_NS, R_NSAMPLES, R_LEASE_LOST, R_GRACE_NS) = range(16)
ROW_HDR = 32  # words before a row's latency samples


def board_path(path: StrPath) -> str:
    """The metrics board file of the dispatcher whose ingress queue is ``path``."""
    return resolve_path(path) + ".dispatch"


def row_words(reservoir):
    """Words per worker row with ``reservoir`` latency samples."""
    return ROW_HDR + reservoir


class Board:
    """A mapping of ``PATH.dispatch`` (words are published with aligned 8-byte stores)."""

    def __init__(self, fd, size, writable):
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        self.mm = mmap.mmap(fd, size, mmap.MAP_SHARED, prot)
        self.w = memoryview(self.mm).cast("Q")
        self.size = size
        self.old_queues = []

    @classmethod
    def open(cls, path, writable=False):
        """Map an existing board.

        :raises FileNotFoundError: no board at ``path``.
        :raises shmq.ShmqError: the file is not a board (too short, bad magic or version).
        """
        # never follows, never blocks: a FIFO planted at PATH.dispatch is refused
        fd, st = open_file(path, write=writable)
        try:
            size = st.st_size
            if size < HDR_BYTES:
                raise ShmqError(f"{path}: not a dispatcher board (too short)")
            b = cls(fd, size, writable)
        finally:
            os.close(fd)
        if b.w[H_MAGIC] != MAGIC or b.w[H_VERSION] != VERSION:
            b.close()
            raise ShmqError(f"{path}: not a dispatcher board (bad magic or version)")
        return b

    def base(self, row):
        """Index of ``row``'s first word."""
        return HDR_BYTES // 8 + row * row_words(self.w[H_RESERVOIR])

    def config(self):
        """The JSON config block (``{}`` if absent or out of range)."""
        n = self.w[H_JSON_LEN]
        if not n or n > HDR_BYTES - JSON_OFF:
            return {}
        return json.loads(bytes(self.mm[JSON_OFF:JSON_OFF + n]))

    def write_config(self, cfg):
        """Store ``cfg`` as the JSON config block (the oldest ``queues`` are
        dropped if it does not fit).

        :raises ValueError: it does not fit even without queues.
        """
        raw = json.dumps(cfg).encode()
        while len(raw) > HDR_BYTES - JSON_OFF and cfg.get("queues"):
            cfg["queues"] = cfg["queues"][1:]
            raw = json.dumps(cfg).encode()
        if len(raw) > HDR_BYTES - JSON_OFF:
            raise ValueError("too many or too long handler names for the dispatcher board")
        self.mm[JSON_OFF:JSON_OFF + len(raw)] = raw
        self.w[H_JSON_LEN] = len(raw)

    def row_add(self, row, field, n=1):
        """Add ``n`` to a word of ``row`` (its single writer only)."""
        i = self.base(row) + field
        self.w[i] = self.w[i] + n

    def sample(self, base, seconds):
        """Record one latency in the row starting at word ``base`` (its single writer only)."""
        w = self.w
        n = w[base + R_NSAMPLES]
        w[base + ROW_HDR + n % w[H_RESERVOIR]] = max(0, int(seconds * 1e9))
        w[base + R_NSAMPLES] = n + 1

    def close(self):
        if self.mm is not None:
            self.w.release()
            self.mm.close()
            self.mm = None


def claim_board(bp, path, rows, reservoir):
    """Create or reuse the board file ``bp`` under an exclusive flock, sized for
    ``rows`` workers; zero it (state "starting").  Returns ``(fd, board)``: the
    flock lives as long as ``fd``.  ``board.old_queues`` lists the queues a
    previous run recorded that still exist.

    :raises shmq.ShmqError: the file is not a regular file of ours, or another
        dispatcher holds the flock.
    """
    # O_NONBLOCK: opening a FIFO planted at the path must not block us
    fd = os.open(bp, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o600)
    try:
        st = os.fstat(fd)
        if not _stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise ShmqError(f"{bp}: not a regular file owned by this user")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = None
            try:
                b = Board.open(bp)
                pid = holder_pid(b.w[H_HOLDER])
                b.close()
            except Exception:
                pass
            raise ShmqError(f"a dispatcher (pid {pid}) is already running on {path}; "
                            "one dispatcher per queue") from None
        old_queues = []
        if st.st_size >= HDR_BYTES:
            try:
                b = Board.open(bp)
                old_queues = [q for q in b.config().get("queues", []) if os.path.exists(q)]
                b.close()
            except Exception:
                pass
        size = HDR_BYTES + rows * row_words(reservoir) * 8
        if st.st_size < size:
            os.ftruncate(fd, size)  # grows only: a reader mapping the old size stays valid
        size = max(size, st.st_size)
        board = Board(fd, size, True)
    except BaseException:
        os.close(fd)
        raise
    board.old_queues = old_queues
    w = board.w
    w[H_STATE] = STATE_STARTING  # readers stop at the state word from here on
    board.mm[8 * (H_STATE + 1):] = bytes(size - 8 * (H_STATE + 1))
    w[H_NROWS] = rows
    w[H_RESERVOIR] = reservoir
    w[H_STARTED_NS] = time.time_ns()
    return fd, board


def publish_board(board):
    """Make a claimed board valid for readers: holder, then version, then magic last."""
    w = board.w
    w[H_HOLDER] = holder_word()
    w[H_VERSION] = VERSION
    w[H_MAGIC] = MAGIC


def percentile(sorted_values, q):
    """The ``q`` quantile (nearest rank) of ``sorted_values``, or None if empty."""
    if not sorted_values:
        return None
    k = max(0, min(len(sorted_values) - 1, math.ceil(q * len(sorted_values)) - 1))
    return sorted_values[k]


def status(path: StrPath, queues: bool = True) -> dict[str, Any]:
    """The state of the dispatcher on ``path``, from any process.

    Returns ``{"path", "state", "pid", "alive", "started_at", "stopped_at",
    "routed", "unroutable", "types": {type: metrics}}``; each type's metrics
    are ``workers``, ``target``, ``processed``, ``failed``, ``timed_out``,
    ``crashed``, ``lease_lost``, ``in_progress``, ``latency`` (``count``,
    ``p50``, ``p90``, ``p99`` in seconds, over the most recent ``reservoir``
    runs of each worker slot) and, with ``queues``, ``queue`` (``ready``,
    ``in_flight``, ``delayed``, ``dead``, ``redeliveries``).

    :raises FileNotFoundError: no dispatcher ever ran on ``path``.
    :raises shmq.ShmqError: ``PATH.dispatch`` is not a board, or is truncated.
    """
    path = resolve_path(path)
    b = Board.open(board_path(path))
    try:
        w = b.w
        state = w[H_STATE]
        holder = w[H_HOLDER]
        out = {"path": path, "state": STATE_NAMES.get(state, str(state)),
               "pid": holder_pid(holder) or None, "alive": bool(holder) and holder_alive(holder),
               "started_at": w[H_STARTED_NS] / 1e9 or None, "stopped_at": w[H_STOPPED_NS] / 1e9 or None,
               "routed": w[H_ROUTED], "unroutable": w[H_UNROUTABLE], "types": {}}
        if state != STATE_STOPPED and not out["alive"]:
            out["state"] = "dead"
        if state == STATE_STARTING:
            return out
        cfg = b.config()
        types = [t["type"] for t in cfg.get("types", [])]
        nrows, k = w[H_NROWS], w[H_RESERVOIR]
        rw = row_words(k)
        if HDR_BYTES + nrows * rw * 8 > b.size:
            raise ShmqError(f"{path}.dispatch is truncated")
        acc = {t: {"workers": w[H_LIVE + i], "target": w[H_TARGET + i], "processed": 0,
                   "failed": 0, "timed_out": 0, "crashed": 0, "lease_lost": 0, "in_progress": 0,
                   "_samples": []} for i, t in enumerate(types)}
        for r in range(nrows):
            base = HDR_BYTES // 8 + r * rw
            ti = w[base + R_TYPE]
            if not ti or ti > len(types):
                continue
            a = acc[types[ti - 1]]
            for key, f in (("processed", R_PROCESSED), ("failed", R_FAILED),
                           ("timed_out", R_TIMED_OUT), ("crashed", R_CRASHED),
                           ("lease_lost", R_LEASE_LOST)):
                a[key] += w[base + f]
            if w[base + R_BUSY] and w[base + R_HOLDER]:
                a["in_progress"] += 1
            n = min(w[base + R_NSAMPLES], k)
            a["_samples"].extend(w[base + ROW_HDR:base + ROW_HDR + n].tolist())
    finally:
        b.close()
    for t, a in acc.items():
        s = sorted(x / 1e9 for x in a.pop("_samples"))
        a["latency"] = {"count": len(s), "p50": percentile(s, 0.50), "p90": percentile(s, 0.90),
                        "p99": percentile(s, 0.99)}
        if queues:
            try:
                with attach(f"{path}.{t}") as q:
                    st = q.stats()
                a["queue"] = {"ready": st.ready, "in_flight": st.in_flight, "delayed": st.delayed,
                              "dead": st.dead, "redeliveries": st.redeliveries}
            except (FileNotFoundError, ShmqError):
                a["queue"] = None
    out["types"] = acc
    return out


def _fmt_s(v):
    if v is None:
        return "-"
    return f"{v * 1e3:.1f}ms" if v < 1 else f"{v:.2f}s"


def format_status(st: dict[str, Any]) -> str:
    """A human-readable table of :func:`status`."""
    lines = [f"dispatcher on {st['path']}: {st['state']}"
             + (f" (pid {st['pid']})" if st.get("pid") else "")
             + f", routed {st['routed']}, unroutable {st['unroutable']}"]
    cols = ("type", "workers", "processed", "failed", "timed_out", "crashed", "busy",
            "p50", "p90", "p99", "ready", "in_flight", "delayed", "dead")
    rows = [cols]
    for t, m in st["types"].items():
        q = m.get("queue") or {}
        lat = m["latency"]
        rows.append((t, f"{m['workers']}/{m['target']}", str(m["processed"]), str(m["failed"]),
                     str(m["timed_out"]), str(m["crashed"]), str(m["in_progress"]),
                     _fmt_s(lat["p50"]), _fmt_s(lat["p90"]), _fmt_s(lat["p99"]),
                     *(str(q.get(k, "-")) for k in ("ready", "in_flight", "delayed", "dead"))))
    widths = [max(len(r[i]) for r in rows) for i in range(len(cols))]
    for r in rows:
        lines.append("  ".join(v.ljust(widths[i]) if i == 0 else v.rjust(widths[i])
                               for i, v in enumerate(r)))
    return "\n".join(lines)
