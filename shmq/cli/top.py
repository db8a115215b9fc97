"""``shmq top``: a live, refreshing view of spools and their readers."""

from __future__ import annotations

import os
import select
import shutil
import sys
import time

from .. import _mapping
from ..errors import ShmqError
from .args import positive_arg
from .base import EXIT_NOT_FOUND, EXIT_OK, CliError, one_line, resolve_target
from .fmt import human_duration, human_rate, sparkline, table


class Top:
    """The data behind ``shmq top``: spools of a directory (or given paths), refreshed."""

    SPARK_SECONDS = 30

    def __init__(self, targets, anonymous=False):
        self.targets = targets
        self.anonymous = anonymous  # also show this user's anonymous queues (shmq.Queue())
        self.handles = {}  # path -> (Spool, inode)
        self.prev = {}  # (path, reader) -> (gets, monotonic)

    def close(self):
        for sp, _ino in self.handles.values():
            sp.close()
        self.handles.clear()

    def _handle(self, path):
        from ..spool import Spool

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
        from ..metrics import spool_paths

        paths = spool_paths(self.targets)
        if self.anonymous:
            from ..queue import anonymous_paths

            paths += [p for p in spool_paths(anonymous_paths()) if p not in paths]
        for gone in set(self.handles) - set(paths):
            self.handles.pop(gone)[0].close()
        out = []
        for path in paths:
            try:
                out.append((path, self._handle(path).stats()))
            except FileNotFoundError:
                continue
            except (OSError, ShmqError) as exc:
                out.append((path, one_line(exc)))
        return out

    def _service(self, path, name, mono):
        """The SERVICES row of a spool with a service board (None without one)."""
        from ..metrics import service_snapshot

        have = self.handles.get(path)
        svc = service_snapshot(have[0]) if have else None
        if svc is None:
            return None
        if "error" in svc:
            return [name, "?", svc["error"], "", "", "", "", "", "", "", ""]
        key = (path, None)  # the service's calls counter, for CALLS/S
        rate = None
        if key in self.prev:
            c0, t0 = self.prev[key]
            if mono > t0:
                rate = max(0, svc["calls"] - c0) / (mono - t0)
        self.prev[key] = (svc["calls"], mono)
        pids = ",".join(map(str, svc["pids"][:8])) + (",..." if len(svc["pids"]) > 8 else "")
        return [name, str(svc["workers"]), pids or "-", str(svc["busy"]),
                "-" if svc["queued"] is None else f"{svc['queued']:,}",
                "-" if svc["in_flight"] is None else f"{svc['in_flight']:,}",
                f"{svc['calls']:,}", f"{svc['failed']:,}", human_rate(rate),
                _secs(svc["latency"]["p50"]), _secs(svc["latency"]["p99"])]

    def snapshot_rates(self):
        """Record the readers' counters (the next frame shows rates since now)."""
        self.frame()

    def frame(self, width: int | None = 100, height=None, interactive=False) -> list[str]:
        now = time.time()
        now_s, mono = int(now), time.monotonic()
        snaps = self.snapshot()
        where = ", ".join(self.targets) + (" + anonymous queues" if self.anonymous else "")
        stamp = time.strftime("%H:%M:%S", time.localtime(now))
        head = f"shmq top - {where} - {len(snaps)} spool{'s' * (len(snaps) != 1)} - {stamp}"
        lines = [head.ljust(max(0, width - 9)) + "  q: quit"
                 if interactive and width > len(head) + 10 else head]
        if not snaps:
            lines.append(f"(no spools in {where})")
            return lines if width is None else [ln[:width] for ln in lines]
        anon = set()
        if self.anonymous:
            from ..anonymous import anonymous_paths
            from ..gc import open_by

            anon = set(anonymous_paths())
        named = [os.path.dirname(p) for p, _ in snaps if p not in anon]
        base = os.path.commonpath(named) if named else ""
        spools, readers, services = [], [], []
        for path, st in snaps:
            # an anonymous queue goes by its file name (shmq-q-...), which says what it is
            name = (os.path.basename(path) if path in anon
                    else os.path.relpath(path, base) if base else path)
            if isinstance(st, str):
                spools.append([name, "?", "", "", "", "", st, ""] + [""] * self.anonymous)
                continue
            series = dict(st.write_rate)
            reads = dict(st.read_rate)
            spark = sparkline(series.get(s, 0) for s in range(now_s - self.SPARK_SECONDS, now_s))
            lock = f"pid {st.lock_pid}" if st.lock_pid else "free"
            spools.append([name, st.on_full, f"{100 * st.fill:.1f}%", f"{st.frames:,}",
                           human_rate(series.get(now_s - 1, 0)),
                           human_rate(reads.get(now_s - 1, 0)), spark, lock])
            if self.anonymous:  # who has each anonymous queue open (its creator, usually)
                spools[-1].append(",".join(map(str, open_by(path))) or "-"
                                  if path in anon else "")
            svc = self._service(path, name, mono)
            if svc is not None:
                services.append(svc)
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
                        f"PUTS, LAST {self.SPARK_SECONDS} S", "LOCK"] + ["OPEN BY"] * self.anonymous,
                       spools, "llrrrrll" + "l" * self.anonymous)
        if readers:
            lines.append("")
            lines += table(["SPOOL", "READER", "KIND", "POSITION", "LAG", "LOST", "GET/S", "PID",
                            "ALIVE"], readers, "lllrrrrrl")
        if services:
            lines.append("")
            lines += table(["SERVICE", "WORKERS", "PIDS", "BUSY", "QUEUED", "IN FLIGHT", "CALLS",
                            "FAILED", "CALLS/S", "P50", "P99"], services, "lrlrrrrrrrr")
        if height:
            lines = lines[:height]
        return lines if width is None else [ln[:width] for ln in lines]


def _secs(v):
    return "-" if v is None else human_duration(round(v * 1e9))


def cmd_top(a) -> int:
    targets = [resolve_target(t) for t in (a.targets or [_mapping.default_dir()])]
    for t in targets:
        if not os.path.exists(t) and t != _mapping.default_dir():
            raise CliError(f"{t}: no such spool or directory", EXIT_NOT_FOUND)
        if t == _mapping.default_dir() and os.path.lexists(t):
            _mapping.check_private_dir(t)  # a planted one is refused, not watched
    top = Top(targets, anonymous=a.anonymous)
    try:
        interactive = sys.stdout.isatty() and not a.once and not a.count
        if not interactive:
            if a.once:
                top.snapshot_rates()  # a first sample, so readers' GET/S can be shown
                time.sleep(min(a.interval, 0.5))
            n = 0
            while True:
                # a pipe or a file gets whole lines (a long name must not cut the columns
                # a script reads); a terminal, lines cut to its width
                width = shutil.get_terminal_size((120, 40)).columns if sys.stdout.isatty() else None
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


def register(add):
    """Add ``top`` to the ``shmq`` parser."""
    p = add("top", "live view of every spool and reader",
            description="A live, refreshing view of the spools in DIR (default your private /dev/shm/shmq-UID) "
            "or of the given spool files: fill, frames, put/get rates of the last second from "
            "the control block's per-second series, a sparkline of the last 30 s of puts, "
            "every named reader with its lag, loss and read rate, and every service "
            "(shmq.Service) with its workers, queued and in-flight calls, call rate and "
            "latency p50/p99.  Quit with q or Ctrl-C.")
    p.add_argument("targets", nargs="*", metavar="DIR|PATH")
    p.add_argument("--once", action="store_true", help="print one frame and exit (no terminal "
                   "needed)")
    p.add_argument("--interval", type=positive_arg(float), default=1.0, metavar="S",
                   help="seconds between refreshes (default 1)")
    p.add_argument("--count", type=positive_arg(int), metavar="N",
                   help="print N frames, one after the other, and exit")
    p.add_argument("-a", "--anonymous", action="store_true",
                   help="also show your anonymous queues (shmq.Queue() without a path, "
                   "/dev/shm/shmq-q-*) with the pids that have each open")
    p.set_defaults(func=cmd_top)
