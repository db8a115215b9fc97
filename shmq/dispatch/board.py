"""The status board ``PATH.dispatch``: its layout, and reading it from any process.

A status board of the worker platform (:mod:`shmq.workers.board`: the
file, its opening, its exclusive owner's flock, holder rows) of kind
``dispatch``, owned by the running supervisor (one dispatcher per path):

* the platform's header (magic, version, kind, geometry, the supervisor's
  identity, its state and start/stop times), then the dispatcher's words
  (the number of types, messages routed and unroutable, the latency
  reservoir, the length of the JSON config block at :data:`JSON_OFF`),
  per-type targets (:data:`H_TARGET`) and live counts (:data:`H_LIVE`),
  and the JSON config block (handlers, queues);
* one row per worker slot: the platform's holder word and holding (the
  message in progress: its id, the lease's slot and token, its attempt,
  when it started: what the supervisor gives back to the work queue when
  the worker dies, :mod:`shmq.workers.holdings`), then the dispatcher's
  counters, the handler's deadline and grace (the backstop's), and a ring
  of recent latencies.

Every word is published with one aligned 8-byte store; one writer per word
at a time: a row belongs to its worker while the worker lives, then to the
supervisor.  Readers ``pread`` the file (:func:`status`).
"""

from __future__ import annotations

import json
import math
import os
from typing import TYPE_CHECKING, Any

from .._lock import holder_alive, holder_pid
from .._mapping import resolve_path
from ..errors import ShmqError
from ..workers import board as _board
from ..workers import holdings as _holdings
from ..workers.board import HDR_COMMON, ROW_COMMON, STATE_NAMES, STATE_STARTING, STATE_STOPPED, Layout
from .registry import MAX_TYPES, attach

if TYPE_CHECKING:
    from _typeshed import StrPath

HDR_BYTES = 16384
JSON_OFF = 2048
# header words after the platform's
(H_NTYPES, H_ROUTED, H_UNROUTABLE, H_RESERVOIR, H_JSON_LEN) = range(HDR_COMMON, HDR_COMMON + 5)
H_TARGET = 32  # one word per type
H_LIVE = H_TARGET + MAX_TYPES
assert H_LIVE + MAX_TYPES <= JSON_OFF // 8
# row words after the platform's (holder, holding); one writer at a time: its worker,
# or the supervisor once that worker is dead
(R_TYPE, R_PROCESSED, R_FAILED, R_TIMED_OUT, R_CRASHED, R_LEASE_LOST, R_DEADLINE_NS, R_GRACE_NS,
 R_NSAMPLES) = range(ROW_COMMON, ROW_COMMON + 9)
ROW_HDR = ROW_COMMON + 16  # words before a row's latency samples
LAYOUT = Layout("dispatch", HDR_BYTES // 8, what="dispatcher board",
                legacy=((b"SHMQDSP1", "start the dispatcher with this shmq (it rewrites the board), "
                         "or remove the file"),))


def board_path(path: StrPath) -> str:
    """The metrics board file of the dispatcher whose ingress queue is ``path``."""
    return resolve_path(path) + ".dispatch"


def row_words(reservoir: int) -> int:
    """Words per worker row with ``reservoir`` latency samples."""
    return ROW_HDR + reservoir


def config_of(w: memoryview) -> dict[str, Any]:
    """The JSON config block of the board words ``w`` (``{}`` if absent or out of range)."""
    n = w[H_JSON_LEN]
    if not n or n > HDR_BYTES - JSON_OFF:
        return {}
    return json.loads(w.cast("B")[JSON_OFF:JSON_OFF + n].tobytes())


def write_config(board: _board.Board, cfg: dict[str, Any]) -> None:
    """Store ``cfg`` as the JSON config block of an owned board (the oldest ``queues``
    are dropped if it does not fit).

    :raises ValueError: it does not fit even without queues.
    """
    raw = json.dumps(cfg).encode()
    while len(raw) > HDR_BYTES - JSON_OFF and cfg.get("queues"):
        cfg["queues"] = cfg["queues"][1:]
        raw = json.dumps(cfg).encode()
    if len(raw) > HDR_BYTES - JSON_OFF:
        raise ValueError("too many or too long handler names for the dispatcher board")
    assert board.mm is not None
    board.mm[JSON_OFF:JSON_OFF + len(raw)] = raw
    board.w[H_JSON_LEN] = len(raw)


def claim_board(bp: str, path: str, rows: int, reservoir: int) -> tuple[_board.Board, list[str]]:
    """Own the board file ``bp`` (its flock, for as long as the board is open), sized for
    ``rows`` workers, zeroed, its state "starting".  Returns the board and the queues
    a previous run recorded that still exist.

    :raises shmq.ShmqError: the file is not a regular file of ours, or another
        dispatcher owns it.
    """
    try:
        board, before = _board.Board.own(bp, LAYOUT, rows, row_words(reservoir))
    except _board.BoardBusy as exc:
        raise ShmqError(f"a dispatcher (pid {exc.owner}) is already running on {path}; "
                        "one dispatcher per queue") from None
    old_queues = []
    if before is not None:
        try:
            old = config_of(memoryview(before).cast("Q"))
            old_queues = [q for q in old.get("queues", []) if isinstance(q, str) and os.path.exists(q)]
        except ValueError:
            pass
    board.w[H_RESERVOIR] = reservoir
    return board, old_queues


def sample(row: _board.Row, seconds: float) -> None:
    """Record one latency in ``row``'s ring (its single writer only)."""
    w, base = row.w, row.base
    n = w[base + R_NSAMPLES]
    k = row.board.row_words - ROW_HDR
    w[base + ROW_HDR + n % k] = max(0, int(seconds * 1e9))
    w[base + R_NSAMPLES] = n + 1


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
    :raises shmq.NotASpool: ``PATH.dispatch`` is not a regular file.
    :raises shmq.ShmqError: ``PATH.dispatch`` is not a board, or is truncated (an older
        shmq's board is named as such, with what to do).
    """
    path = resolve_path(path)
    w = _board.read_words(board_path(path), LAYOUT)
    state = w[_board.H_STATE]
    owner = w[_board.H_OWNER]
    out: dict[str, Any] = {
        "path": path, "state": STATE_NAMES.get(state, str(state)), "pid": holder_pid(owner) or None,
        "alive": bool(owner) and holder_alive(owner),
        "started_at": w[_board.H_STARTED_NS] / 1e9 or None,
        "stopped_at": w[_board.H_STOPPED_NS] / 1e9 or None,
        "routed": w[H_ROUTED], "unroutable": w[H_UNROUTABLE], "types": {}}
    if state != STATE_STOPPED and not out["alive"]:
        out["state"] = "dead"
    if state == STATE_STARTING:
        return out
    types = [t["type"] for t in config_of(w).get("types", [])]
    k = w[H_RESERVOIR]
    acc: dict[str, dict[str, Any]] = {
        t: {"workers": w[H_LIVE + i], "target": w[H_TARGET + i], "processed": 0, "failed": 0,
            "timed_out": 0, "crashed": 0, "lease_lost": 0, "in_progress": 0, "_samples": []}
        for i, t in enumerate(types)}
    for _r, base, holder in _board.live_rows(w, holders=False):
        ti = w[base + R_TYPE]
        if not ti or ti > len(types):
            continue
        a = acc[types[ti - 1]]
        for key, f in (("processed", R_PROCESSED), ("failed", R_FAILED),
                       ("timed_out", R_TIMED_OUT), ("crashed", R_CRASHED),
                       ("lease_lost", R_LEASE_LOST)):
            a[key] += w[base + f]
        if w[base + _holdings.R_HELD_N] and holder:
            a["in_progress"] += 1
        n = min(w[base + R_NSAMPLES], k)
        a["_samples"].extend(w[base + ROW_HDR:base + ROW_HDR + n].tolist())
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
