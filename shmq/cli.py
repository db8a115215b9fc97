"""The ``shmq`` command line (``python -m shmq``): create, inspect, tail, repair, export.

stdlib only (argparse, termios for ``top``): the core library stays free of
CLI dependencies.  Every subcommand has ``--help``; exit codes are listed
in :data:`EXIT_CODES` and in docs/cli.md.  Errors are one line on stderr
(set ``SHMQ_DEBUG=1`` for a traceback).
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import datetime as _dt
import json
import os
import re
import select
import shutil
import sys
import time

from . import _format as F
from . import _mapping
from .errors import (
    FrameLost, Full, NotASpool, ReaderBusy, ShmqError, SpoolFormatError, Timeout, TooLarge,
    UntrustedSpool,
)

# --- exit codes -------------------------------------------------------------

EXIT_OK = 0
EXIT_PROBLEMS = 1  # fsck found problems (or they remain after --repair)
EXIT_USAGE = 2  # bad arguments (argparse's own code)
EXIT_NOT_FOUND = 3  # no such spool (or reader, or directory)
EXIT_NOT_SPOOL = 4  # a foreign file, a directory, a symlink, not a dump
EXIT_CORRUPT = 5  # a damaged spool (header, control block, ring) or dump; a newer format
EXIT_PERMISSION = 6  # permission denied
EXIT_BUSY = 7  # the named reader is attached by another process
EXIT_FULL = 8  # no room: the spool is full, the writer lock stayed busy, a frame too large
EXIT_LOST = 9  # the requested frame was overwritten or is not written yet
EXIT_EXISTS = 10  # create/import/export target already exists
EXIT_ERROR = 11  # any other error
EXIT_INTERRUPTED = 130  # Ctrl-C outside the watch/follow modes (which exit 0 on Ctrl-C)
EXIT_PIPE = 141  # stdout closed early (e.g. piped into head), as a shell reports SIGPIPE

EXIT_CODES = {
    EXIT_OK: "success (fsck: the spool is clean)",
    EXIT_PROBLEMS: "fsck found problems, or problems remain after --repair",
    EXIT_USAGE: "usage error: bad option or argument",
    EXIT_NOT_FOUND: "no such spool, reader or directory",
    EXIT_NOT_SPOOL: "not a spool: a foreign file, a directory, a symbolic link (or not a dump)",
    EXIT_CORRUPT: "damaged spool or dump, or a newer format than this shmq",
    EXIT_PERMISSION: "permission denied",
    EXIT_BUSY: "the named reader is attached by another process",
    EXIT_FULL: "no room: spool full, writer lock busy, or frame larger than the ring",
    EXIT_LOST: "frame overwritten or not written yet",
    EXIT_EXISTS: "the target already exists",
    EXIT_ERROR: "other error",
    EXIT_INTERRUPTED: "interrupted (Ctrl-C)",
    EXIT_PIPE: "output closed early (broken pipe)",
}


class CliError(Exception):
    """A user-facing failure: one line on stderr, then exit with ``code``."""

    def __init__(self, message, code=EXIT_ERROR):
        super().__init__(message)
        self.code = code


# --- formatting -------------------------------------------------------------

SPARK = "▁▂▃▄▅▆▇█"


def human_bytes(n) -> str:
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def human_rate(x) -> str:
    """A rate per second: 950, 12.3k, 1.2M."""
    if x is None:
        return "-"
    if x < 1000:
        return f"{x:.0f}" if x == int(x) or x >= 10 else f"{x:.1f}"
    for unit, div in (("k", 1e3), ("M", 1e6), ("G", 1e9)):
        if x < div * 1000 or unit == "G":
            return f"{x / div:.1f}{unit}"
    return str(x)


def human_duration(ns) -> str:
    if ns <= 0:
        return "0"
    if ns < 1_000:
        return f"{ns} ns"
    if ns < 1_000_000:
        return f"{ns / 1e3:.1f} µs"
    if ns < 1_000_000_000:
        return f"{ns / 1e6:.1f} ms"
    s = ns / 1e9
    if s < 60:
        return f"{s:.1f} s"
    s = int(s)
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def human_age(ts_ns, now_ns=None) -> str:
    if not ts_ns:
        return "never"
    now_ns = time.time_ns() if now_ns is None else now_ns
    d = now_ns - ts_ns
    return "just now" if d < 1_000_000 else f"{human_duration(d)} ago"


def plural(n, word) -> str:
    return f"{n:,} {word}{'s' * (n != 1)}"


def age_s(ts_ns, now_ns):
    return None if not ts_ns else round(max(0, now_ns - ts_ns) / 1e9, 6)


def iso_time(ts_ns) -> str:
    t = _dt.datetime.fromtimestamp(ts_ns / 1e9, tz=_dt.timezone.utc)
    return t.strftime("%Y-%m-%dT%H:%M:%S.") + f"{ts_ns % 1_000_000_000 // 1000:06d}Z"


def sparkline(values) -> str:
    """One character per value, scaled to the largest ('▁' for zero)."""
    values = list(values)
    top = max(values, default=0)
    if top <= 0:
        return SPARK[0] * len(values)
    return "".join(SPARK[min(len(SPARK) - 1, int(v * (len(SPARK) - 1) / top + 0.999))] if v else SPARK[0]
                   for v in values)


def table(headers, rows, align=None) -> list[str]:
    """Left/right aligned columns (``align``: a string of 'l'/'r' per column)."""
    align = align or "l" * len(headers)
    widths = [len(h) for h in headers]
    for row in rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(str(cell)))

    def fmt(row):
        cells = [str(c).rjust(widths[i]) if align[i] == "r" else str(c).ljust(widths[i])
                 for i, c in enumerate(row)]
        return "  ".join(cells).rstrip()

    return [fmt(headers)] + [fmt(r) for r in rows]


def _print_json(obj, compact=False, out=None):
    out = out or sys.stdout
    if compact:
        out.write(json.dumps(obj, separators=(",", ":"), sort_keys=False) + "\n")
    else:
        # indented, with short lists of numbers (the rate series' pairs) kept on one line
        text = json.dumps(obj, indent=2)
        text = re.sub(r"\[\s+(-?[\d.e+-]+),\s+(-?[\d.e+-]+)\s+\]", r"[\1, \2]", text)
        out.write(text + "\n")
    out.flush()


# --- argument types -----------------------------------------------------------


def _mode(text):
    try:
        mode = int(text, 8)
    except ValueError:
        raise argparse.ArgumentTypeError(f"mode must be octal like 0660, not {text!r}") from None
    if not 0 <= mode <= 0o7777:
        raise argparse.ArgumentTypeError(f"mode {text} is out of range")
    return mode


def _position(text):
    if text in ("earliest", "latest"):
        return text
    try:
        seq = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected 'earliest', 'latest' or a seq number, not {text!r}") from None
    if seq < 0:
        raise argparse.ArgumentTypeError("a seq is a non-negative integer")
    return seq


def _positive(kind):
    def parse(text):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, not {text!r}") from None
        if v <= 0:
            raise argparse.ArgumentTypeError(f"expected a positive number, not {text}")
        return v
    return parse


def _count(text):
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, not {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError("expected a non-negative integer")
    return v


# --- opening ------------------------------------------------------------------


def _open(path):
    from .spool import Spool

    return Spool.open(path)


# --- create / rm / ls ----------------------------------------------------------


def _cmd_dispatch(a) -> int:
    from .dispatch import main as dispatch_main

    try:
        return dispatch_main(a.args)
    except SystemExit as exc:  # its argparse: --help (0) or a usage error (2)
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE


def _cmd_create(a) -> int:
    from .spool import Spool

    parent = os.path.dirname(_resolve(a.path))
    if parent != _mapping.default_dir() and not os.path.isdir(parent):
        raise CliError(f"{parent}: no such directory (create it first)", EXIT_NOT_FOUND)
    sp = Spool.create(a.path, capacity=a.capacity, on_full=a.on_full, mode=a.mode,
                      readers=a.readers, leases=a.leases, checksum=a.checksum)
    try:
        info = {"path": sp.path, "capacity": sp.capacity, "on_full": sp.on_full,
                "mode": f"{a.mode:04o}", "readers": sp._geo["slot_count"],
                "leases": sp._geo["lease_count"], "checksum": bool(sp._checksum),
                "file_bytes": sp._geo["file_bytes"]}
    finally:
        sp.close()
    if a.json:
        _print_json(info)
    else:
        print(f"created {info['path']}: {human_bytes(info['capacity'])} ring, "
              f"on_full={info['on_full']}, mode {info['mode']}, {info['readers']} reader slots, "
              f"CRC {'on' if info['checksum'] else 'off'} (file {human_bytes(info['file_bytes'])})")
    return EXIT_OK


def _cmd_rm(a) -> int:
    from .spool import Spool

    code = EXIT_OK
    for path in a.paths:
        try:
            Spool.destroy(path)
        except FileNotFoundError:
            if a.force:
                continue
            raise
        if not a.quiet:
            print(f"removed {_resolve(path)}")
    return code


def _resolve(path):
    from ._mapping import resolve_path

    return resolve_path(path)


def _ls_rows(directory):
    from .metrics import peek, series_window, spool_paths

    if not os.path.lexists(directory):
        if directory == _mapping.default_dir():
            return []
        raise CliError(f"{directory}: no such directory", EXIT_NOT_FOUND)
    if directory == _mapping.default_dir():
        from ._mapping import check_private_dir

        check_private_dir(directory)  # a planted one is refused, not listed
    now = int(time.time())
    rows = []
    for path in spool_paths([directory]):
        try:
            p = peek(path)
        except (OSError, ShmqError):
            continue  # vanished or not readable: listings skip it
        p["name"] = os.path.relpath(path, directory) if os.path.isdir(directory) else path
        p["write_rate_per_s"] = sum(series_window(p["write_rate"], 10, now)) / 10
        p["read_rate_per_s"] = sum(series_window(p["read_rate"], 10, now)) / 10
        rows.append(p)
    return rows


def _cmd_ls(a) -> int:
    directory = os.path.abspath(a.dir) if a.dir else _mapping.default_dir()
    rows = _ls_rows(directory)
    if a.json:
        for p in rows:
            p["write_rate"] = [list(x) for x in p["write_rate"]]
            p["read_rate"] = [list(x) for x in p["read_rate"]]
        _print_json(rows)
        return EXIT_OK
    if not rows:
        print(f"no spools in {directory}", file=sys.stderr)
        return EXIT_OK
    now = time.time_ns()
    out = table(
        ["SPOOL", "POLICY", "SIZE", "FILL", "FRAMES", "SEQ RANGE", "PUT/S", "GET/S", "LAST PUT"],
        [[p["name"], p["on_full"], human_bytes(p["file_bytes"]), f"{100 * p['fill']:.1f}%",
          f"{p['frames']:,}",
          f"{p['first_seq']}..{p['next_seq'] - 1}" if p["frames"] else "-",
          human_rate(p["write_rate_per_s"]), human_rate(p["read_rate_per_s"]),
          human_age(p["last_put_ns"], now)] for p in rows],
        "lllrrrrrl")
    print("\n".join(out))
    return EXIT_OK


# --- stat -----------------------------------------------------------------------


def stat_dict(st, now_ns=None) -> dict:
    """The JSON document of ``shmq stat --json`` (see docs/cli.md for the fields)."""
    from ._lock import process_alive

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
        f"{human_bytes(st.capacity)}",
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


def _workqueue_text(wq) -> str:
    return (f"work queue: ready {wq.ready}, in flight {wq.in_flight}, delayed {wq.delayed}, "
            f"dead {wq.dead}; acked {wq.acked}, redelivered {wq.redeliveries}, superseded "
            f"{wq.superseded}; oldest {wq.oldest_age_s:.1f} s; lease records "
            f"{wq.lease_slots_used}/{wq.lease_slots}")


def _has_board(path) -> bool:
    """A dispatcher status board beside ``path``: a regular file only (a FIFO planted
    at PATH.dispatch must not make ``stat`` block opening it)."""
    import stat as _st

    from .dispatch import board_path

    try:
        return _st.S_ISREG(os.lstat(board_path(path)).st_mode)
    except OSError:
        return False


def _cmd_stat(a) -> int:
    from .metrics import prometheus_text, workqueue_prometheus_text
    from .workqueue import WorkQueue

    fmt = "json" if a.json else a.format
    clear = a.watch and fmt == "text" and sys.stdout.isatty()
    sp = _open(a.path)
    n = 0
    try:
        while True:
            st = sp.stats()
            wq = WorkQueue.stats_of(sp)
            if fmt == "json":
                d = stat_dict(st)
                if wq is not None:
                    d["workqueue"] = dataclasses.asdict(wq)
                if _has_board(st.path):
                    from .dispatch import status

                    d["dispatcher"] = status(st.path)
                _print_json(d, compact=bool(a.watch))
            elif fmt == "prometheus":
                sys.stdout.write(prometheus_text([st]))
                if wq is not None:
                    sys.stdout.write(workqueue_prometheus_text(st.path, wq))
            else:
                text = stat_text(st)
                if wq is not None:
                    text += "\n" + _workqueue_text(wq)
                if _has_board(st.path):
                    from .dispatch import format_status, status

                    text += "\n" + format_status(status(st.path))
                if clear:
                    sys.stdout.write("\x1b[H\x1b[2J")
                elif n:
                    sys.stdout.write("\n")
                sys.stdout.write(text + "\n")
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
        sp.close()


# --- top -----------------------------------------------------------------------


class Top:
    """The data behind ``shmq top``: spools of a directory (or given paths), refreshed."""

    SPARK_SECONDS = 30

    def __init__(self, targets):
        self.targets = targets
        self.handles = {}  # path -> (Spool, inode)
        self.prev = {}  # (path, reader) -> (gets, monotonic)

    def close(self):
        for sp, _ino in self.handles.values():
            sp.close()
        self.handles.clear()

    def _handle(self, path):
        from .spool import Spool

        try:
            ino = os.stat(path).st_ino
        except OSError:
            ino = None
        have = self.handles.get(path)
        if have and have[1] == ino:
            return have[0]
        if have:
            have[0].close()
            del self.handles[path]
        sp = Spool.open(path)
        self.handles[path] = (sp, ino)
        return sp

    def snapshot(self):
        """``[(path, SpoolStats | error string)]`` for every spool now present."""
        from .metrics import spool_paths

        paths = spool_paths(self.targets)
        for gone in set(self.handles) - set(paths):
            self.handles.pop(gone)[0].close()
        out = []
        for path in paths:
            try:
                out.append((path, self._handle(path).stats()))
            except FileNotFoundError:
                continue
            except (OSError, ShmqError) as exc:
                out.append((path, _one_line(exc)))
        return out

    def snapshot_rates(self):
        """Record the readers' counters (the next frame shows rates since now)."""
        self.frame()

    def frame(self, width=100, height=None, interactive=False) -> list[str]:
        now = time.time()
        now_s, mono = int(now), time.monotonic()
        snaps = self.snapshot()
        where = ", ".join(self.targets)
        stamp = time.strftime("%H:%M:%S", time.localtime(now))
        head = f"shmq top - {where} - {len(snaps)} spool{'s' * (len(snaps) != 1)} - {stamp}"
        lines = [head.ljust(max(0, width - 9)) + "  q: quit"
                 if interactive and width > len(head) + 10 else head]
        if not snaps:
            lines.append(f"(no spools in {where})")
            return [ln[:width] for ln in lines]
        base = os.path.commonpath([os.path.dirname(p) for p, _ in snaps])
        spools, readers = [], []
        for path, st in snaps:
            name = os.path.relpath(path, base) if base else path
            if isinstance(st, str):
                spools.append([name, "?", "", "", "", "", st, ""])
                continue
            series = dict(st.write_rate)
            reads = dict(st.read_rate)
            spark = sparkline(series.get(s, 0) for s in range(now_s - self.SPARK_SECONDS, now_s))
            lock = f"pid {st.lock_pid}" if st.lock_pid else "free"
            spools.append([name, st.on_full, f"{100 * st.fill:.1f}%", f"{st.frames:,}",
                           human_rate(series.get(now_s - 1, 0)),
                           human_rate(reads.get(now_s - 1, 0)), spark, lock])
            for r in st.readers:
                key = (path, r.name)
                rate = None
                if key in self.prev:
                    g0, t0 = self.prev[key]
                    if mono > t0:
                        rate = max(0, r.gets - g0) / (mono - t0)
                self.prev[key] = (r.gets, mono)
                readers.append([name, r.name, r.kind, f"{r.position:,}", f"{r.lag:,}",
                                f"{r.lost:,}", human_rate(rate), r.pid or "-",
                                "yes" if r.alive else "no"])
        lines += table(["SPOOL", "POLICY", "FILL", "FRAMES", "PUT/S", "GET/S",
                        f"PUTS, LAST {self.SPARK_SECONDS} S", "LOCK"], spools, "llrrrrll")
        if readers:
            lines.append("")
            lines += table(["SPOOL", "READER", "KIND", "POSITION", "LAG", "LOST", "GET/S", "PID",
                            "ALIVE"], readers, "lllrrrrrl")
        if height:
            lines = lines[:height]
        return [ln[:width] for ln in lines]


def _cmd_top(a) -> int:
    targets = [os.path.abspath(t) for t in (a.targets or [_mapping.default_dir()])]
    for t in targets:
        if not os.path.exists(t) and t != _mapping.default_dir():
            raise CliError(f"{t}: no such spool or directory", EXIT_NOT_FOUND)
        if t == _mapping.default_dir() and os.path.lexists(t):
            from ._mapping import check_private_dir

            check_private_dir(t)  # a planted one is refused, not watched
    top = Top(targets)
    try:
        interactive = sys.stdout.isatty() and not a.once and not a.count
        if not interactive:
            if a.once:
                top.snapshot_rates()  # a first sample, so readers' GET/S can be shown
                time.sleep(min(a.interval, 0.5))
            n = 0
            while True:
                width = shutil.get_terminal_size((120, 40)).columns if sys.stdout.isatty() else 200
                if n:
                    print()
                print("\n".join(top.frame(width)))
                sys.stdout.flush()
                n += 1
                if a.once or (a.count and n >= a.count):
                    return EXIT_OK
                time.sleep(a.interval)
        return _top_interactive(top, a.interval)
    except KeyboardInterrupt:
        return EXIT_OK
    finally:
        top.close()


def _top_interactive(top, interval) -> int:
    import termios
    import tty

    out = sys.stdout
    fd = sys.stdin.fileno() if sys.stdin.isatty() else None
    saved = termios.tcgetattr(fd) if fd is not None else None
    if fd is not None:
        tty.setcbreak(fd)  # keys arrive one by one; Ctrl-C still raises SIGINT
    out.write("\x1b[?1049h\x1b[?25l")  # alternate screen, hide the cursor
    try:
        while True:
            size = shutil.get_terminal_size((100, 24))
            lines = top.frame(size.columns, size.lines - 1, interactive=True)
            out.write("\x1b[H" + "".join(ln + "\x1b[K\r\n" for ln in lines) + "\x1b[J")
            out.flush()
            deadline = time.monotonic() + interval
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                if fd is None:
                    time.sleep(left)
                    break
                ready, _, _ = select.select([fd], [], [], left)
                if ready:
                    keys = os.read(fd, 64)
                    if not keys or any(k in keys for k in b"qQ\x03\x1b"):
                        return EXIT_OK
                    break  # any other key: refresh now
    except KeyboardInterrupt:
        return EXIT_OK
    finally:
        out.write("\x1b[?25h\x1b[?1049l")
        out.flush()
        if saved is not None:
            termios.tcsetattr(fd, termios.TCSADRAIN, saved)


# --- frames: tail / put / cat -------------------------------------------------

_CTRL = {i: f"\\x{i:02x}" for i in range(32)}
_CTRL.update({9: "\\t", 10: "\\n", 13: "\\r", 127: "\\x7f"})


def _text(data):
    """Printable text if ``data`` is UTF-8 without odd control bytes, else None."""
    try:
        s = data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    bad = sum(1 for ch in s if ord(ch) < 32 and ch not in "\t\n\r")
    return None if bad else s.translate(_CTRL)


def _unpickle(codec, data):
    # Only reached with --unsafe-pickle: the user vouches for the spool's writers.
    from .codec import TRUSTED, decode

    return decode(data, codec, TRUSTED)


def render_payload(codec, data, unsafe_pickle=False) -> str:
    """The ``--format auto`` rendering of a payload, by its codec tag."""
    name = F.CODEC_NAMES.get(codec, f"codec {codec}") if codec is not None else "raw"
    if codec in (F.CODEC_PICKLE, F.CODEC_PICKLE_OOB):
        if not unsafe_pickle:
            return f"<{name}: {len(data)} bytes; pass --unsafe-pickle to unpickle>"
        try:
            return repr(_unpickle(codec, data))
        except Exception as exc:  # a bad pickle is data, not a crash
            return f"<{name}: {len(data)} bytes; unpickling failed: {_one_line(exc)}>"
    if codec == F.CODEC_JSON:
        try:
            return json.dumps(json.loads(data), ensure_ascii=False, separators=(",", ":"))
        except ValueError:
            return f"<invalid json: {data!r}>"
    if codec in (F.CODEC_RAW, F.CODEC_UTF8, None):
        s = _text(data)
        return s if s is not None else repr(data)
    if codec == F.CODEC_NUMPY:
        return _render_numpy(data)
    if codec == F.CODEC_ARROW:
        return _render_arrow(data)
    if codec == F.CODEC_WORKQ:
        return f"<work queue message: {len(data)} bytes; pickled, see 'shmq stat' for the queue>"
    return f"<{name}: {len(data)} bytes>"


def _render_numpy(data) -> str:
    """dtype, shape and the first rows of a numpy frame (no pickle involved)."""
    from .columnar import decode_array

    try:
        arr = decode_array(data)
    except Exception as exc:
        return f"<numpy: {len(data)} bytes; undecodable: {_one_line(exc)}>"
    import numpy as np

    head = np.array2string(arr.reshape(-1)[:3] if arr.ndim != 1 else arr[:3], threshold=6,
                           max_line_width=200)
    more = " ..." if arr.size > 3 else ""
    return f"<numpy {arr.dtype} shape {tuple(arr.shape)}: {head}{more}>"


def _render_arrow(data) -> str:
    """Schema and the first rows of an Arrow frame (needs pyarrow)."""
    try:
        from .columnar import decode_arrow

        table = decode_arrow(bytes(data))
    except ImportError:
        return f"<arrow: {len(data)} bytes; install pyarrow to show it>"
    except Exception as exc:
        return f"<arrow: {len(data)} bytes; undecodable: {_one_line(exc)}>"
    schema = ", ".join(f"{f.name}: {f.type}" for f in table.schema)
    first = table.slice(0, 2).to_pylist()
    return f"<arrow {table.num_rows} rows [{schema}]: {first}{' ...' if table.num_rows > 2 else ''}>"


def _hexdump(data, indent="    ") -> str:
    lines = []
    for off in range(0, len(data), 16):
        chunk = data[off:off + 16]
        hexes = " ".join(f"{b:02x}" for b in chunk)
        text = "".join(chr(b) if 32 <= b < 127 else "." for b in chunk)
        lines.append(f"{indent}{off:08x}  {hexes:<47}  |{text}|")
    return "\n".join(lines) if lines else f"{indent}(empty)"


def record_json(rec, unsafe_pickle=False) -> dict:
    """One line of ``--format json`` (see docs/cli.md)."""
    codec = rec.codec
    d = {"seq": rec.seq, "timestamp_ns": rec.timestamp_ns, "time": iso_time(rec.timestamp_ns),
         "codec": F.CODEC_NAMES.get(codec, str(codec)) if codec is not None else None,
         "length": len(rec.data), "data": None}
    if codec == F.CODEC_JSON:
        try:
            d["data"] = json.loads(rec.data)
            return d
        except ValueError:
            pass
    elif codec in (F.CODEC_RAW, F.CODEC_UTF8, None):
        # raw frames count as text only when they look like it (no odd control bytes)
        if codec == F.CODEC_UTF8 or _text(rec.data) is not None:
            try:
                d["data"] = rec.data.decode("utf-8")
                return d
            except UnicodeDecodeError:
                pass
    elif codec in (F.CODEC_PICKLE, F.CODEC_PICKLE_OOB) and unsafe_pickle:
        try:
            d["repr"] = repr(_unpickle(codec, rec.data))
        except Exception as exc:
            d["error"] = _one_line(exc)
    d["base64"] = base64.b64encode(rec.data).decode("ascii")
    return d


def _emit(rec, fmt, unsafe_pickle):
    out = sys.stdout
    if fmt == "raw":
        out.flush()
        out.buffer.write(rec.data + b"\n")
        return
    if fmt == "json":
        out.write(json.dumps(record_json(rec, unsafe_pickle), ensure_ascii=False) + "\n")
        return
    codec = F.CODEC_NAMES.get(rec.codec, str(rec.codec)) if rec.codec is not None else "?"
    head = f"{rec.seq}  {iso_time(rec.timestamp_ns)}  {codec}  {len(rec.data)} B"
    if fmt == "hex":
        out.write(head + "\n" + _hexdump(rec.data) + "\n")
    elif fmt == "repr":
        out.write(f"{head}  {rec.data!r}\n")
    else:
        out.write(f"{head}  {render_payload(rec.codec, rec.data, unsafe_pickle)}\n")


def _cmd_tail(a) -> int:
    from .dump import iter_records

    sp = _open(a.path)
    info = {}
    shown = 0
    try:
        if a.from_ is None:
            n = 10 if a.lines is None else a.lines
            nxt = sp.next_seq
            start = max(sp.first_seq, nxt - n) if n else "latest"
            if start == nxt:
                start = "latest"
            limit = None
        else:
            start, limit = a.from_, a.lines
            first = sp.first_seq
            if isinstance(start, int) and start < first:
                print(f"shmq tail: seq {start} was overwritten; starting at the oldest frame, "
                      f"{first}", file=sys.stderr)
                start = "earliest"
        # Without -f, stop at the end seen now: busy writers must not make tail endless.
        stop = None if a.follow else sp.next_seq
        try:
            for rec in iter_records(sp, start, stop, follow=a.follow, timeout=a.timeout,
                                    info=info, clamp=True):
                _emit(rec, a.format, a.unsafe_pickle)
                shown += 1
                if a.follow:
                    sys.stdout.flush()
                if limit is not None and shown >= limit:
                    break
        except KeyboardInterrupt:
            if not a.follow:
                raise
        except ShmqError:
            raise
        except ValueError as exc:  # start beyond next_seq
            raise CliError(f"{sp.path}: {exc}", EXIT_USAGE) from None
        sys.stdout.flush()
        if info.get("lost"):
            print(f"shmq tail: {info['lost']} frame(s) were overwritten before they could be "
                  "read", file=sys.stderr)
    finally:
        sp.close()
    return EXIT_OK


def _put_items(a):
    """Yield the frames ``shmq put`` writes, as bytes."""
    if a.file:
        for name in a.file:
            if name == "-":
                yield sys.stdin.buffer.read()
            else:
                with open(name, "rb") as f:
                    yield f.read()
    if a.data:
        for item in a.data:
            yield item.encode("utf-8", "surrogateescape")
    elif not a.file:
        for line in sys.stdin.buffer:
            yield line[:-1] if line.endswith(b"\n") else line


def _cmd_put(a) -> int:
    codec = {"raw": F.CODEC_RAW, "utf8": F.CODEC_UTF8, "json": F.CODEC_JSON}[a.codec]
    sp = _open(a.path)
    first = last = None
    count = nbytes = 0
    try:
        for data in _put_items(a):
            if a.codec == "json":
                try:
                    json.loads(data)
                except ValueError as exc:
                    raise CliError(f"frame {count + 1} is not valid JSON ({exc}); nothing "
                                   "after it was put", EXIT_USAGE) from None
            elif a.codec == "utf8":
                try:
                    data.decode("utf-8")
                except UnicodeDecodeError:
                    raise CliError(f"frame {count + 1} is not valid UTF-8", EXIT_USAGE) from None
            try:
                seq = sp.put(data, timeout=a.timeout, codec=codec)
            except Full as exc:
                raise Full(f"{sp.path} is full (on_full={sp.on_full}): {exc}; {count} frame(s) "
                           "were put before") from None
            first = seq if first is None else first
            last = seq
            count += 1
            nbytes += len(data)
    finally:
        sp.close()
    if a.json:
        _print_json({"path": sp.path, "count": count, "bytes": nbytes, "first_seq": first,
                     "last_seq": last})
    elif not a.quiet:
        rng = "" if first is None else f" (seq {first})" if first == last else f" (seq {first}..{last})"
        print(f"put {count} frame{'s' * (count != 1)}, {human_bytes(nbytes)} into {sp.path}{rng}")
    return EXIT_OK


def _cmd_cat(a) -> int:
    from .dump import record_at

    sp = _open(a.path)
    skipped = 0
    try:
        first, nxt = sp.first_seq, sp.next_seq
        lo = first if a.from_ in (None, "earliest") else nxt if a.from_ == "latest" else a.from_
        hi = nxt - 1 if a.to in (None, "latest") else first - 1 if a.to == "earliest" else a.to
        if hi >= nxt:
            raise FrameLost(f"{sp.path}: seq {hi} has not been written yet (next is {nxt})")
        for seq in range(lo, hi + 1):
            try:
                rec = record_at(sp, seq)
            except FrameLost as exc:
                if not a.skip_lost:
                    raise FrameLost(f"{sp.path}: {exc}; --skip-lost skips missing frames") from None
                skipped += 1
                continue
            _emit(rec, a.format, a.unsafe_pickle)
        sys.stdout.flush()
    finally:
        sp.close()
    if skipped:
        print(f"shmq cat: skipped {skipped} overwritten frame(s)", file=sys.stderr)
    return EXIT_OK


# --- readers ---------------------------------------------------------------------


def _cmd_readers(a) -> int:
    sp = _open(a.path)
    try:
        readers = sp.readers()
        nxt = sp.next_seq
    finally:
        sp.close()
    now = time.time_ns()
    if a.json:
        rows = []
        for r in readers:
            d = r.as_dict()
            d["last_get_age_s"] = age_s(r.last_get_ns, now)
            rows.append(d)
        _print_json(rows)
    elif not readers:
        print(f"no named readers or groups in {sp.path} (next seq {nxt})")
    else:
        print("\n".join(readers_table(readers, now)))
    return EXIT_OK


def _find_reader(sp, name):
    for r in sp.readers():
        if r.name == name:
            return r
    return None


def _cmd_readers_rm(a) -> int:
    sp = _open(a.path)
    try:
        for name in a.names:
            try:
                sp.remove_reader(name)
            except KeyError:
                raise CliError(f"{sp.path}: no reader or group named {name!r}",
                               EXIT_NOT_FOUND) from None
            except ReaderBusy as exc:
                raise ReaderBusy(f"{sp.path}: {exc}") from None
            if not a.quiet:
                print(f"removed reader {name!r} from {sp.path}")
    finally:
        sp.close()
    return EXIT_OK


def _cmd_readers_seek(a) -> int:
    sp = _open(a.path)
    try:
        have = _find_reader(sp, a.name)
        if have is None and not a.create:
            raise CliError(f"{sp.path}: no reader or group named {a.name!r} (pass --create to "
                           "register it at that position)", EXIT_NOT_FOUND)
        group = a.group if have is None else have.kind == "group"
        old = have.position if have else None
        try:
            r = sp.reader(a.name, group=group, start=a.where if have is None else "earliest")
        except ReaderBusy:
            pid = have.pid if have else "?"
            raise ReaderBusy(f"{sp.path}: reader {a.name!r} is attached by another process "
                             f"(pid {pid}); stop it before seeking") from None
        try:
            if have is not None:
                r.seek(a.where)
                r.commit()
        except ShmqError:
            raise
        except ValueError as exc:
            raise CliError(f"{sp.path}: {exc}", EXIT_USAGE) from None
        finally:
            r.close()
        new = _find_reader(sp, a.name).position
    finally:
        sp.close()
    if a.json:
        _print_json({"path": sp.path, "name": a.name, "kind": "group" if group else "reader",
                     "old_position": old, "position": new, "created": have is None})
    else:
        what = "group" if group else "reader"
        if have is None:
            print(f"created {what} {a.name!r} at seq {new} ({a.where})")
        else:
            print(f"{what} {a.name!r}: seq {old} -> {new} ({a.where})")
    return EXIT_OK


# --- fsck ------------------------------------------------------------------------


def _cmd_fsck(a) -> int:
    from .verify import repair, verify

    rep = repair(a.path) if a.repair else verify(a.path)
    code = EXIT_OK if rep.ok else EXIT_PROBLEMS
    if a.json:
        d = rep.as_dict()
        d["exit_code"] = code
        _print_json(d)
        return code
    rng = ""
    if rep.first_seq is not None:
        rng = (f", seq {rep.first_seq}..{rep.next_seq - 1}" if rep.next_seq > rep.first_seq
               else ", empty")
    print(f"fsck {rep.path}: {plural(rep.frames_checked, 'frame')} checked ({rep.crc_verified:,} "
          f"CRC-verified, {plural(rep.pads_checked, 'pad')}{rng}), "
          f"{plural(rep.readers_checked, 'reader')}")
    for action in rep.repaired:
        print(f"repaired: {action}")
    for p in rep.problems:
        print(f"PROBLEM: {p}")
    for w in rep.warnings:
        print(f"warning: {w}")
    if a.verbose:
        for n in rep.notes:
            print(f"note: {n}")
    if rep.ok:
        print("clean" if not rep.repaired else "clean after repair")
    else:
        n = len(rep.problems)
        hint = "" if a.repair else "; 'shmq fsck --repair' fixes stale locks and damaged reader slots"
        remain = (" remains" if n == 1 else " remain") if a.repair else ""
        print(f"{plural(n, 'problem')}{remain}{hint}")
    return code


# --- export / import -----------------------------------------------------------


def _progress_wanted(a):
    return a.progress or (not a.no_progress and sys.stderr.isatty())


def _cmd_export(a) -> int:
    from .dump import export_spool

    s = export_spool(a.path, a.file, progress=_progress_wanted(a))
    out = sys.stderr if a.file == "-" else sys.stdout
    if a.json:
        _print_json(s, out=out)
    elif not a.quiet:
        lost = f"; {s['lost']} overwritten during the export" if s["lost"] else ""
        print(f"exported {s['frames']:,} frames ({human_bytes(s['bytes'])}) and "
              f"{s['readers']} reader positions from {s['source']} to {a.file}{lost}", file=out)
    return EXIT_OK


def _cmd_import(a) -> int:
    from .dump import import_dump

    if a.file != "-" and not os.path.exists(a.file):
        raise CliError(f"{a.file}: no such dump file", EXIT_NOT_FOUND)
    s = import_dump(a.file, a.path, capacity=a.capacity, on_full=a.on_full, mode=a.mode,
                    append=a.append, keep_timestamps=not a.new_timestamps, timeout=a.timeout,
                    progress=_progress_wanted(a))
    if a.json:
        _print_json(s)
    elif not a.quiet:
        print(f"imported {s['frames']:,} frames ({human_bytes(s['bytes'])}) into {s['path']} "
              f"(seq {s['first_seq']}..{s['next_seq'] - 1}); {len(s['readers'])} reader(s) "
              "restored"
              + (f", {len(s['readers_kept'])} already there kept" if s["readers_kept"] else ""))
    return EXIT_OK


# --- demo ------------------------------------------------------------------------


def _cmd_demo(args) -> int:
    from .demo import run

    return run(seconds=args.seconds, writers=args.writers, capacity=args.capacity)


# --- the parser --------------------------------------------------------------------

_FORMATS = ("auto", "raw", "hex", "json", "repr")
_EPILOG = ("PATH is a spool file; a bare name (no slash) means /dev/shm/shmq-UID/NAME, your "
           "private directory (docs/security.md).  "
           "Exit codes: 0 ok, 1 fsck problems, 2 usage, 3 not found, 4 not a spool, "
           "5 corrupt, 6 permission denied, 7 reader busy, 8 full, 9 frame lost, "
           "10 exists, 11 other error.  See docs/cli.md.")


def _formatter(prog):
    return argparse.RawDescriptionHelpFormatter(prog, max_help_position=32)


_PUT_HELP = "put frames into a spool"
_PUT_DESCRIPTION = ("Put each DATA argument as one frame; without DATA (or --file), each line of "
                    "stdin (without its newline).  --file FILE puts a whole file as one frame "
                    "('-': all of stdin).  Options and DATA may be mixed.")


def _put_arguments(p):
    p.add_argument("path", metavar="PATH")
    p.add_argument("data", nargs="*", metavar="DATA")
    p.add_argument("--file", action="append", metavar="FILE", help="a file as one frame "
                   "(repeatable)")
    p.add_argument("--codec", choices=("raw", "utf8", "json"), default="raw",
                   help="codec tag of the frames (json and utf8 are validated; default raw)")
    p.add_argument("--timeout", type=float, default=5.0, metavar="S",
                   help="how long a put may wait for room (block policy) or the lock "
                   "(default 5)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("-q", "--quiet", action="store_true", help="print nothing")
    p.set_defaults(func=_cmd_put, command="put")
    return p


def build_parser() -> argparse.ArgumentParser:
    """The ``shmq`` parser; ``parser.readers_verbs`` maps "rm"/"seek"/"list" to the parsers
    of ``shmq readers VERB ...`` (argparse cannot mix a positional PATH with sub-verbs)."""
    parser = argparse.ArgumentParser(
        prog="shmq", description="Create, inspect, tail, repair and move shmq spools.",
        epilog=_EPILOG, formatter_class=_formatter)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    def add(name, help, description=None, epilog=None):
        p = sub.add_parser(name, help=help, description=description or help.capitalize() + ".",
                           epilog=epilog, formatter_class=_formatter)
        return p

    p = add("create", "create a spool",
            epilog="example: shmq create orders --capacity 64MiB --on-full block --mode 0660")
    p.add_argument("path", metavar="PATH")
    p.add_argument("--capacity", default="64MiB", help="ring size: bytes, or 64KiB/64MiB/1GiB "
                   "(default 64MiB; rounded up to 4 KiB)")
    p.add_argument("--on-full", choices=F.POLICIES, default="overwrite",
                   help="what a put does when the ring is full (default overwrite)")
    p.add_argument("--mode", type=_mode, default=0o600, help="file mode, octal (default 0600)")
    p.add_argument("--readers", type=_positive(int), default=F.DEFAULT_SLOTS,
                   help=f"named reader/group slots (default {F.DEFAULT_SLOTS})")
    p.add_argument("--leases", type=_count, default=F.DEFAULT_LEASES,
                   help=f"work-queue lease slots (default {F.DEFAULT_LEASES})")
    p.add_argument("--checksum", action="store_true", help="store a CRC-32 of every payload "
                   "(checked by fsck and by readers with verify=True)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=_cmd_create)

    p = add("dispatch", "control a running shmq.Dispatcher: scale PATH TYPE N | status PATH | stop PATH",
            epilog="example: shmq dispatch scale jobs resize 8  (see docs/dispatcher.md)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="passed to the dispatcher's control CLI")
    p.set_defaults(func=_cmd_dispatch)

    p = add("rm", "remove spools (file and semaphores)",
            description="Remove spools: the file and its semaphores (Spool.destroy).  Processes "
            "that have it open keep working on the unlinked file.  A file that is not a spool "
            "is refused and left alone.")
    p.add_argument("paths", nargs="+", metavar="PATH")
    p.add_argument("-f", "--force", action="store_true", help="ignore missing spools")
    p.add_argument("-q", "--quiet", action="store_true", help="print nothing")
    p.set_defaults(func=_cmd_rm)

    p = add("ls", "list the spools of a directory",
            description="List the spools in DIR (default your private /dev/shm/shmq-UID): files whose header "
            "validates, read without attaching.  Other files are skipped silently.  PUT/S and "
            "GET/S average the last 10 seconds.")
    p.add_argument("dir", nargs="?", metavar="DIR")
    p.add_argument("--json", action="store_true", help="print a JSON list")
    p.set_defaults(func=_cmd_ls)

    p = add("stat", "show a spool's statistics and readers",
            description="Show everything in the spool's control block (Spool.stats) and a table "
            "of named readers and groups.")
    p.add_argument("path", metavar="PATH")
    p.add_argument("--format", choices=("text", "json", "prometheus"), default="text",
                   help="output format (default text)")
    p.add_argument("--json", action="store_true", help="same as --format json")
    p.add_argument("--watch", type=_positive(float), metavar="SECONDS",
                   help="refresh every SECONDS until Ctrl-C (JSON: one object per line)")
    p.add_argument("--count", type=_positive(int), metavar="N", help="with --watch: stop after N")
    p.set_defaults(func=_cmd_stat)

    p = add("top", "live view of every spool and reader",
            description="A live, refreshing view of the spools in DIR (default your private /dev/shm/shmq-UID) "
            "or of the given spool files: fill, frames, put/get rates of the last second from "
            "the control block's per-second series, a sparkline of the last 30 s of puts, "
            "and every named reader with its lag, loss and read rate.  Quit with q or Ctrl-C.")
    p.add_argument("targets", nargs="*", metavar="DIR|PATH")
    p.add_argument("--once", action="store_true", help="print one frame and exit (no terminal "
                   "needed)")
    p.add_argument("--interval", type=_positive(float), default=1.0, metavar="S",
                   help="seconds between refreshes (default 1)")
    p.add_argument("--count", type=_positive(int), metavar="N",
                   help="print N frames, one after the other, and exit")
    p.set_defaults(func=_cmd_top)

    p = add("tail", "print the last frames of a spool (or follow it)",
            description="Print frames through an anonymous reader (it holds no writer back and "
            "leaves no trace).  Without --from: the last N frames (-n, default 10).  With "
            "--from: frames from there on, at most -n of them.  Payloads are decoded by the "
            "frame's codec tag; pickled frames are only unpickled with --unsafe-pickle.")
    p.add_argument("path", metavar="PATH")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing new frames")
    p.add_argument("--from", dest="from_", type=_position, metavar="earliest|latest|SEQ")
    p.add_argument("-n", "--lines", type=_count, metavar="N", help="number of frames")
    p.add_argument("--format", choices=_FORMATS, default="auto",
                   help="auto (by codec), raw (payload bytes only), hex, json (one object per "
                   "line), repr (default auto)")
    p.add_argument("--unsafe-pickle", action="store_true",
                   help="unpickle pickled frames to show their repr (runs code from the spool)")
    p.add_argument("--timeout", type=_positive(float), metavar="S",
                   help="with -f: exit after S seconds without a new frame")
    p.set_defaults(func=_cmd_tail)

    _put_arguments(add("put", _PUT_HELP, description=_PUT_DESCRIPTION))

    p = add("cat", "print a range of frames by seq",
            description="Print frames --from SEQ --to SEQ (inclusive; default: all in the ring) "
            "with lock-free reads by seq (Spool.read_at).")
    p.add_argument("path", metavar="PATH")
    p.add_argument("--from", dest="from_", type=_position, metavar="SEQ")
    p.add_argument("--to", type=_position, metavar="SEQ")
    p.add_argument("--format", choices=_FORMATS, default="auto", help="as for tail")
    p.add_argument("--unsafe-pickle", action="store_true", help="as for tail")
    p.add_argument("--skip-lost", action="store_true", help="skip overwritten frames instead "
                   "of failing")
    p.set_defaults(func=_cmd_cat)

    readers_epilog = ("also:\n  shmq readers rm PATH NAME [NAME ...]      forget named readers"
                      "\n  shmq readers seek PATH NAME earliest|latest|SEQ   move a cursor"
                      "\n(a spool literally named rm or seek: use ./rm or 'readers list rm')")
    p = add("readers", "list named readers and groups (also: readers rm, readers seek)",
            description="List the named readers and groups of a spool with their position, "
            "lag, loss, pid and liveness.", epilog=readers_epilog)
    p.add_argument("path", metavar="PATH")
    p.add_argument("--json", action="store_true", help="print a JSON list")
    p.set_defaults(func=_cmd_readers)

    extra = {}
    p = argparse.ArgumentParser(prog="shmq readers list", formatter_class=_formatter,
                                description="List the named readers and groups of a spool.")
    p.add_argument("path", metavar="PATH")
    p.add_argument("--json", action="store_true", help="print a JSON list")
    p.set_defaults(func=_cmd_readers, command="readers")
    extra["list"] = extra["ls"] = p

    p = argparse.ArgumentParser(
        prog="shmq readers rm", formatter_class=_formatter,
        description="Forget named readers or groups (their cursors stop holding writers back). "
        "Refused while a live process has one attached.")
    p.add_argument("path", metavar="PATH")
    p.add_argument("names", nargs="+", metavar="NAME")
    p.add_argument("-q", "--quiet", action="store_true", help="print nothing")
    p.set_defaults(func=_cmd_readers_rm, command="readers rm")
    extra["rm"] = p

    p = argparse.ArgumentParser(
        prog="shmq readers seek", formatter_class=_formatter,
        description="Move a named reader's (or group's) committed position: attach it, seek, "
        "commit, detach.  Refused while another process has the reader attached "
        "(a group's shared cursor moves under the group lock even while members run).")
    p.add_argument("path", metavar="PATH")
    p.add_argument("name", metavar="NAME")
    p.add_argument("where", type=_position, metavar="earliest|latest|SEQ")
    p.add_argument("--create", action="store_true", help="register NAME there if it is new")
    p.add_argument("--group", action="store_true", help="with --create: make it a group")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=_cmd_readers_seek, command="readers seek")
    extra["seek"] = p

    p = add("fsck", "verify a spool (and repair it)",
            description="Check the spool header, control words, writer lock, every frame header "
            "and CRC from the oldest frame to the newest, and the reader table.  With --repair: "
            "break locks held by dead processes, finish a dead writer's half-done commit, reset "
            "damaged reader slots to the earliest frame.  Good frames are never rewritten.  "
            "Exit 0 if clean, 1 if problems were found (or remain after --repair).")
    p.add_argument("path", metavar="PATH")
    p.add_argument("--repair", action="store_true", help="fix what can be fixed safely")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("-v", "--verbose", action="store_true", help="also print notes")
    p.set_defaults(func=_cmd_fsck)

    p = add("export", "write a portable dump of a spool's frames and reader positions",
            description="Write every frame (seq, timestamp, codec, flags, payload) and the "
            "named readers' positions to FILE ('-': stdout) in a versioned format that any "
            "shmq version can import.  Live writers are not held back.")
    p.add_argument("path", metavar="PATH")
    p.add_argument("file", metavar="FILE")
    p.add_argument("--progress", action="store_true", help="progress line on stderr even when "
                   "stderr is not a terminal")
    p.add_argument("--no-progress", action="store_true", help="no progress line")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("-q", "--quiet", action="store_true", help="print no summary")
    p.set_defaults(func=_cmd_export)

    p = add("import", "load a dump into a new (or existing) spool",
            description="Create PATH with the source's geometry (or --capacity/--on-full/--mode) "
            "and load the dump's frames (new seqs, same order, codecs and timestamps), then "
            "register its named readers and groups at the new seq of the frame each was about "
            "to read.  --append adds the frames to an existing spool instead (readers that "
            "already exist there are left alone).")
    p.add_argument("file", metavar="FILE")
    p.add_argument("path", metavar="PATH")
    p.add_argument("--append", action="store_true", help="append to an existing spool")
    p.add_argument("--capacity", help="ring size of the new spool (default: the source's)")
    p.add_argument("--on-full", choices=F.POLICIES, help="policy of the new spool (default: "
                   "the source's)")
    p.add_argument("--mode", type=_mode, help="file mode of the new spool (default 0600)")
    p.add_argument("--new-timestamps", action="store_true", help="stamp frames with the import "
                   "time instead of their original time")
    p.add_argument("--timeout", type=_positive(float), default=10.0, metavar="S",
                   help="how long to wait for room before failing (default 10)")
    p.add_argument("--progress", action="store_true", help="progress line on stderr even when "
                   "stderr is not a terminal")
    p.add_argument("--no-progress", action="store_true", help="no progress line")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("-q", "--quiet", action="store_true", help="print no summary")
    p.set_defaults(func=_cmd_import)

    demo = add("demo", "run a live demo of writers and readers over a spool")
    demo.add_argument("--seconds", type=float, default=5.0, help="how long to run (default 5)")
    demo.add_argument("--writers", type=int, default=2, help="writer processes (default 2)")
    demo.add_argument("--capacity", default="4MiB", help="ring size (default 4MiB)")
    demo.set_defaults(func=_cmd_demo)
    parser.readers_verbs = extra
    # `put PATH --codec json DATA...`: DATA after an option needs intermixed parsing,
    # which argparse refuses on a parser with subparsers: parse put on its own.
    parser.put_parser = _put_arguments(argparse.ArgumentParser(
        prog="shmq put", description=_PUT_DESCRIPTION, formatter_class=_formatter))
    return parser


# --- errors ---------------------------------------------------------------------


def _one_line(exc) -> str:
    text = str(exc) or type(exc).__name__
    return " ".join(text.split())


def _os_message(exc, what):
    name = exc.filename if exc.filename is not None else ""
    return f"{name}: {what}" if name else what


def _classify(exc, spool=None):
    """``(exit code, message)`` for an exception escaping a subcommand on ``spool``."""
    from .dump import DumpError

    if isinstance(exc, CliError):
        return exc.code, _one_line(exc)
    if isinstance(exc, NotASpool):
        return EXIT_NOT_SPOOL, _one_line(exc)
    if isinstance(exc, UntrustedSpool):
        return EXIT_PERMISSION, _one_line(exc)
    if isinstance(exc, FileNotFoundError):
        if exc.filename is not None and spool is not None and exc.filename != spool:
            return EXIT_NOT_FOUND, _os_message(exc, "no such file or directory")
        return EXIT_NOT_FOUND, _os_message(exc, "no such spool (create it with 'shmq create')")
    if isinstance(exc, IsADirectoryError):
        return EXIT_NOT_SPOOL, _os_message(exc, "is a directory, not a spool")
    if isinstance(exc, PermissionError):
        return EXIT_PERMISSION, _os_message(exc, "permission denied (a spool needs read and "
                                            "write access; fsck/ls need read access)")
    if isinstance(exc, FileExistsError):
        return EXIT_EXISTS, _os_message(exc, "already exists; refusing to overwrite it")
    if isinstance(exc, DumpError):
        return (EXIT_NOT_SPOOL if "not a shmq dump" in str(exc) else EXIT_CORRUPT), _one_line(exc)
    if isinstance(exc, ReaderBusy):
        return EXIT_BUSY, _one_line(exc)
    if isinstance(exc, (Full, Timeout, TooLarge)):
        return EXIT_FULL, _one_line(exc)
    if isinstance(exc, FrameLost):
        return EXIT_LOST, _one_line(exc)
    if isinstance(exc, SpoolFormatError):
        text = str(exc)
        foreign = "not a shmq spool" in text or "not a regular file" in text
        return (EXIT_NOT_SPOOL if foreign else EXIT_CORRUPT), _one_line(exc)
    if isinstance(exc, ShmqError):
        if "symbolic link" in str(exc):
            return EXIT_NOT_SPOOL, _one_line(exc)
        return EXIT_ERROR, _one_line(exc)
    if isinstance(exc, (ValueError, TypeError)):
        return EXIT_USAGE, _one_line(exc)
    if isinstance(exc, OSError):
        return EXIT_ERROR, _os_message(exc, exc.strerror or _one_line(exc))
    return EXIT_ERROR, f"{type(exc).__name__}: {_one_line(exc)}"


def main(argv=None) -> int:
    """Run the command line; return the exit code (never raises SystemExit)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    extra = parser.readers_verbs
    use = parser
    if len(argv) >= 2 and argv[0] == "readers" and argv[1] in extra:
        use, argv = extra[argv[1]], argv[2:]
    if argv[:1] == ["put"]:
        use, argv = parser.put_parser, argv[1:]
    if argv[:1] == ["dispatch"]:  # everything after it is the dispatcher CLI's
        return _cmd_dispatch(argparse.Namespace(args=argv[1:]))
    try:
        args = use.parse_intermixed_args(argv) if use is parser.put_parser else use.parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error (2)
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    name = getattr(args, "command", None) or "shmq"
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader of our stdout went away (e.g. `shmq tail ... | head`).
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except OSError:
            pass
        return EXIT_PIPE
    except Exception as exc:
        if os.environ.get("SHMQ_DEBUG"):
            raise
        spool = None
        if isinstance(getattr(args, "path", None), str):
            try:
                spool = _resolve(args.path)
            except (TypeError, ValueError, ShmqError):
                pass
        code, message = _classify(exc, spool)
        print(f"shmq {name}: {message}", file=sys.stderr)
        return code
