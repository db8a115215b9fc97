"""``shmq stat``: everything in a spool's control block, as text, JSON or Prometheus."""

from __future__ import annotations

import dataclasses
import os
import stat as stat_module
import sys
import time

from .args import positive_arg
from .base import EXIT_NOT_FOUND, EXIT_OK, CliError, open_spool, resolve_target
from .fmt import age_s, human_age, human_bytes, human_duration, plural, print_json, table


def stat_dict(st, now_ns=None) -> dict:
    """The JSON document of ``shmq stat --json`` (see docs/cli.md for the fields)."""
    from .._lock import process_alive

    now_ns = time.time_ns() if now_ns is None else now_ns
    now_s = now_ns // 1_000_000_000
    d = st.as_dict()
    d["time_ns"] = now_ns
    d["lock_alive"] = bool(st.lock_pid) and process_alive(st.lock_pid)
    d["last_put_age_s"] = age_s(st.last_put_ns, now_ns)
    d["last_get_age_s"] = age_s(st.last_get_ns, now_ns)
    wr, rr = dict(st.write_rate), dict(st.read_rate)
    d["write_rate_per_s"] = wr.get(now_s - 1, 0)
    d["read_rate_per_s"] = rr.get(now_s - 1, 0)
    d["readers"] = []
    for r in st.readers:
        rd = r.as_dict()
        rd["last_get_age_s"] = age_s(r.last_get_ns, now_ns)
        d["readers"].append(rd)
    return d


def readers_table(readers, now_ns) -> list[str]:
    return table(
        ["NAME", "KIND", "POSITION", "LAG", "LAG BYTES", "LOST", "GETS", "PID", "ALIVE",
         "LAST GET"],
        [[r.name, r.kind, f"{r.position:,}", f"{r.lag:,}", human_bytes(r.lag_bytes),
          f"{r.lost:,}", f"{r.gets:,}", r.pid or "-", "yes" if r.alive else "no",
          human_age(r.last_get_ns, now_ns)] for r in readers],
        "llrrrrrrll")


def stat_text(st, now_ns=None) -> str:
    d = stat_dict(st, now_ns)
    now_ns = d["time_ns"]
    lock = "free"
    if st.lock_pid:
        lock = f"held by pid {st.lock_pid} ({'alive' if d['lock_alive'] else 'DEAD: run shmq fsck --repair'})"
    lines = [
        f"spool       {st.path}",
        f"policy      {st.on_full}, CRC {'on' if st.checksum else 'off'}, capacity "
        f"{human_bytes(st.capacity)}" + (
            f" (growable: {human_bytes(st.allocated)} allocated, {st.growths:,} segments grown)"
            if st.growable else ""),
        f"frames      {st.frames:,} resident: seq {st.first_seq:,} .. {max(st.first_seq, st.next_seq - 1):,}"
        f" (next {st.next_seq:,})",
        f"fill        {human_bytes(st.used_bytes)} ({100 * st.fill:.1f}%); ring high water "
        f"{st.high_water_frames:,} frames, {human_bytes(st.high_water_bytes)}",
        f"puts        {plural(st.puts, 'frame')}, {human_bytes(st.put_bytes)}; last {human_age(st.last_put_ns, now_ns)}; "
        f"{d['write_rate_per_s']:,}/s last second",
        f"gets        {plural(st.gets, 'frame')}, {human_bytes(st.get_bytes)} (named readers and groups); "
        f"last {human_age(st.last_get_ns, now_ns)}; {d['read_rate_per_s']:,}/s last second",
        f"delay       avg {human_duration(st.avg_delay_ns)}, max {human_duration(st.max_delay_ns)} "
        "(put to get)",
        f"lag water   high {st.high_water:,}, low {st.low_water:,} frames (named readers)",
        f"lost        {st.lost:,} (named readers and groups); evicted {st.evicted:,}",
        f"lock        {lock}; token {st.lock_token}; breaks {st.lock_breaks}",
    ]
    if st.readers:
        lines.append("")
        lines += readers_table(st.readers, now_ns)
    else:
        lines.append("readers     none (anonymous readers leave no trace)")
    return "\n".join(lines)


def workqueue_text(wq) -> str:
    return (f"work queue: ready {wq.ready}, in flight {wq.in_flight}, delayed {wq.delayed}, "
            f"dead {wq.dead}; acked {wq.acked}, redelivered {wq.redeliveries}, superseded "
            f"{wq.superseded}; oldest {wq.oldest_age_s:.1f} s; lease records "
            f"{wq.lease_slots_used}/{wq.lease_slots}")


def _secs(v):
    return "-" if v is None else human_duration(round(v * 1e9))


def service_text(svc) -> str:
    """The service lines of ``shmq stat`` (a :func:`shmq.metrics.service_snapshot`)."""
    if "error" in svc:
        return f"service: board unreadable: {svc['error']}"
    pids = ", ".join(map(str, svc["pids"][:16])) + (", ..." if len(svc["pids"]) > 16 else "")
    lat, st = svc["latency"], svc["service_time"]
    q = "-" if svc["queued"] is None else f"{svc['queued']:,}"
    f = "-" if svc["in_flight"] is None else f"{svc['in_flight']:,}"
    return (f"service: {plural(svc['workers'], 'worker')}" + (f" (pids {pids})" if pids else "")
            + f", {svc['busy']} busy; calls queued {q}, in flight {f}; answered "
            f"{svc['calls']:,} ({svc['failed']:,} with an error), {svc['expired']:,} dropped "
            f"(caller gone), {svc['redeliveries']:,} redelivered (worker died)\n"
            f"service latency: p50 {_secs(lat['p50'])}, p99 {_secs(lat['p99'])} over "
            f"{plural(lat['count'], 'call')} (put to reply); service time p50 {_secs(st['p50'])}, "
            f"p99 {_secs(st['p99'])} (handler and reply; log buckets, within 12.5%)")


def stat_targets(args):
    """Spool paths named by ``args``: files as given (bare names resolved), directories
    expanded to the spools in them.

    :raises CliError: a directory argument holds no spool.
    """
    from ..metrics import spool_paths

    paths = []
    for arg in args:
        target = resolve_target(arg)
        if os.path.isdir(target):
            found = spool_paths([target])
            if not found:
                raise CliError(f"{target}: no spools in this directory", EXIT_NOT_FOUND)
            paths += found
        else:
            paths.append(target)
    return paths


def _one(sp, fmt):
    """The ``stat`` output of one open spool, as text to write."""
    from ..metrics import (prometheus_text, service_prometheus_text, service_snapshot,
                           workqueue_prometheus_text)
    from ..workqueue import WorkQueue

    st = sp.stats()
    wq = WorkQueue.stats_of(sp)
    svc = service_snapshot(sp)
    from ..dispatch import board_path

    try:  # a regular file only: a FIFO planted at PATH.dispatch must not block stat
        board = stat_module.S_ISREG(os.lstat(board_path(st.path)).st_mode)
    except OSError:
        board = False
    if fmt == "json":
        d = stat_dict(st)
        if wq is not None:
            d["workqueue"] = dataclasses.asdict(wq)
        if board:
            from ..dispatch import status

            d["dispatcher"] = status(st.path)
        if svc is not None:
            d["service"] = svc
        return d
    if fmt == "prometheus":
        return (prometheus_text([st]) + (workqueue_prometheus_text(st.path, wq) if wq else "")
                + (service_prometheus_text(st.path, svc) if svc and "error" not in svc else ""))
    text = stat_text(st)
    if wq is not None:
        text += "\n" + workqueue_text(wq)
    if svc is not None:
        text += "\n" + service_text(svc)
    if board:
        from ..dispatch import format_status, status

        text += "\n" + format_status(status(st.path))
    return text + "\n"


def cmd_stat(a) -> int:
    fmt = "json" if a.json else a.format
    clear = a.watch and fmt == "text" and sys.stdout.isatty()
    paths = stat_targets(a.paths)
    # one spool file named: one JSON object, as always; several (or a directory): a list
    as_list = len(paths) > 1 or any(os.path.isdir(resolve_target(p)) for p in a.paths)
    spools = []
    n = 0
    try:
        for path in paths:
            spools.append(open_spool(path))
        while True:
            outs = [_one(sp, fmt) for sp in spools]
            if fmt == "json":
                if a.watch:
                    for d in outs:
                        print_json(d, compact=True)
                else:
                    print_json(outs if as_list else outs[0])
            else:
                if clear:
                    sys.stdout.write("\x1b[H\x1b[2J")
                elif n and fmt == "text":
                    sys.stdout.write("\n")
                sys.stdout.write(("\n" if fmt == "text" else "").join(outs))
            sys.stdout.flush()
            n += 1
            if not a.watch or (a.count and n >= a.count):
                return EXIT_OK
            time.sleep(a.watch)
    except KeyboardInterrupt:
        if a.watch:
            return EXIT_OK
        raise
    finally:
        for sp in spools:
            sp.close()


def register(add):
    """Add ``stat`` to the ``shmq`` parser."""
    p = add("stat", "show spools' statistics and readers",
            description="Show everything in the spool's control block (Spool.stats) and a table "
            "of named readers and groups.  Several PATHs, or a DIR (its spools), show one block "
            "per spool (JSON: a list; one spool file: one object).")
    p.add_argument("paths", nargs="+", metavar="PATH|DIR")
    p.add_argument("--format", choices=("text", "json", "prometheus"), default="text",
                   help="output format (default text)")
    p.add_argument("--json", action="store_true", help="same as --format json")
    p.add_argument("--watch", type=positive_arg(float), metavar="SECONDS",
                   help="refresh every SECONDS until Ctrl-C (JSON: one object per line)")
    p.add_argument("--count", type=positive_arg(int), metavar="N", help="with --watch: stop after N")
    p.set_defaults(func=cmd_stat)
