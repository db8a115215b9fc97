"""Spool lifecycle commands: create, rm, ls (and the dispatch and demo front doors)."""

from __future__ import annotations

import argparse
import os
import sys
import time

from .. import _format as F
from .. import _mapping
from ..errors import NotASpool, ShmqError, SpoolFormatError
from .args import count_arg, mode_arg, positive_arg
from .base import (
    EXIT_BUSY, EXIT_NOT_FOUND, EXIT_NOT_SPOOL, EXIT_OK, EXIT_USAGE, CliError, one_line, resolve,
)
from .fmt import human_age, human_bytes, human_rate, print_json, table


def cmd_dispatch(a) -> int:
    from ..dispatch import main as dispatch_main

    try:
        return dispatch_main(a.args, prog="shmq dispatch")
    except SystemExit as exc:  # its argparse: --help (0) or a usage error (2)
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE


def cmd_create(a) -> int:
    from ..spool import Spool

    parent = os.path.dirname(resolve(a.path))
    if parent != _mapping.default_dir() and not os.path.isdir(parent):
        raise CliError(f"{parent}: no such directory (create it first)", EXIT_NOT_FOUND)
    sp = Spool.create(a.path, capacity=a.capacity, on_full=a.on_full, mode=a.mode,
                      readers=a.readers, leases=a.leases, checksum=a.checksum,
                      max_capacity=a.max_capacity)
    try:
        info = {"path": sp.path, "capacity": sp.capacity, "on_full": sp.on_full,
                "mode": f"{a.mode:04o}", "readers": sp.geometry["slot_count"],
                "leases": sp.geometry["lease_count"], "checksum": bool(sp.checksum),
                "file_bytes": sp.geometry["file_bytes"], "growable": sp.growable,
                "allocated": sp.allocated}
    finally:
        sp.close()
    if a.json:
        print_json(info)
    else:
        print(f"created {info['path']}: {human_bytes(info['capacity'])} ring, "
              f"on_full={info['on_full']}, mode {info['mode']}, {info['readers']} reader slots, "
              f"CRC {'on' if info['checksum'] else 'off'} (file {human_bytes(info['file_bytes'])}"
              + (f", growable: {human_bytes(info['allocated'])} allocated now)"
                 if info["growable"] else ")"))
    return EXIT_OK


def cmd_rm(a) -> int:
    from ..gc import open_by
    from ..spool import Spool

    for path in a.paths:
        full = resolve(path)
        users = [] if a.force else open_by(full)
        if users:
            pids = ", ".join(map(str, users[:5])) + (" ..." if len(users) > 5 else "")
            raise CliError(f"{full}: in use by pid {pids}; stop them first, or pass --force "
                           "(they keep working on the removed file)", EXIT_BUSY)
        try:
            Spool.destroy(full)
        except FileNotFoundError:
            if a.force:
                continue
            raise
        _remove_tee_state(full)
        if not a.quiet:
            print(f"removed {full}")
    return EXIT_OK


def _remove_tee_state(path):
    """The records ``shmq tee``/``shmq sub`` keep next to a destination spool belong to
    it: remove them too (only those whose ``dst`` is this path)."""
    import glob
    import json

    d, base = os.path.split(path)
    for kind in ("tee", "sub"):
        for f in glob.glob(os.path.join(glob.escape(d), f".{glob.escape(base)}.{kind}.*.json")):
            try:
                with open(f) as fh:
                    if json.load(fh).get("dst") != path:
                        continue
                os.unlink(f)
            except (OSError, ValueError):
                pass


def _damaged_spools(directory):
    """``[(path, error)]``: files in ``directory`` that are spools whose header is damaged
    (truncated, checksum, newer version); foreign files are not listed."""
    from .._mapping import read_geometry

    out = []
    if not os.path.isdir(directory):
        return out
    for name in sorted(os.listdir(directory)):
        full = os.path.join(directory, name)
        if name.startswith(".") or not os.path.isfile(full) or os.path.islink(full):
            continue
        try:
            read_geometry(full)
        except NotASpool:
            continue
        except SpoolFormatError as exc:
            out.append((full, exc))
        except OSError:
            continue
    return out


def _ls_rows(directory, damaged):
    from ..metrics import spool_paths

    if not os.path.lexists(directory):
        if directory == _mapping.default_dir():
            return []
        raise CliError(f"{directory}: no such directory", EXIT_NOT_FOUND)
    if directory == _mapping.default_dir():
        _mapping.check_private_dir(directory)  # a planted one is refused, not listed
    return _peek_rows(spool_paths([directory]), directory, damaged)


def _anonymous_rows(damaged):
    """Rows for this user's anonymous queues, each with the pids that have it open."""
    from ..anonymous import anonymous_paths
    from ..gc import open_by, orphaned_queues

    rows = _peek_rows(anonymous_paths(), None, damaged)
    orphans = set(orphaned_queues())
    for p in rows:
        p["anonymous"] = True
        p["open_by"] = open_by(p["path"])
        p["orphan"] = p["path"] in orphans  # creator dead, open by nobody: shmq gc removes it
    return rows


def _peek_rows(paths, directory, damaged):
    from ..metrics import peek, series_window

    now = int(time.time())
    rows = []
    for path in paths:
        try:
            p = peek(path)
        except SpoolFormatError as exc:  # a header that validates, a body that does not
            damaged.append((path, exc))
            continue
        except (OSError, ShmqError):
            continue  # vanished or not readable: listings skip it
        p["name"] = (os.path.relpath(path, directory) if directory and os.path.isdir(directory)
                     else path)
        p.setdefault("path", path)
        p["write_rate_per_s"] = sum(series_window(p["write_rate"], 10, now)) / 10
        p["read_rate_per_s"] = sum(series_window(p["read_rate"], 10, now)) / 10
        rows.append(p)
    return rows


def cmd_ls(a) -> int:
    directory = os.path.abspath(a.dir) if a.dir else _mapping.default_dir()
    if directory == _mapping.default_dir() and os.path.lexists(directory):
        _mapping.check_private_dir(directory)  # a planted one is refused, not listed
    if os.path.exists(directory) and not os.path.isdir(directory):
        from .._mapping import read_geometry

        try:
            read_geometry(directory)  # a spool is listed alone; anything else is an error
        except NotASpool:
            raise CliError(f"{directory}: not a directory (nor a spool); ls lists the spools "
                           "of a directory", EXIT_NOT_SPOOL) from None
    damaged = _damaged_spools(directory)
    rows = _ls_rows(directory, damaged)
    if a.anonymous:
        rows += _anonymous_rows(damaged)
    for path, exc in damaged:  # stderr: the listing (and its JSON) keeps its shape
        print(f"shmq ls: damaged: {one_line(exc)}", file=sys.stderr)
    if a.anonymous:
        from ..gc import sweep

        found = sweep()
        for prefix, names in sorted(found.semaphores.items()):
            print(f"shmq ls: orphaned semaphores of a removed spool: {', '.join(names)} "
                  "('shmq gc --yes' removes them)", file=sys.stderr)
    if a.json:
        for p in rows:
            p["write_rate"] = [list(x) for x in p["write_rate"]]
            p["read_rate"] = [list(x) for x in p["read_rate"]]
        print_json(rows)
        return EXIT_OK
    if not rows:
        print(f"no {'usable ' if damaged else ''}spools in {directory}", file=sys.stderr)
        return EXIT_OK
    now = time.time_ns()
    # SIZE is what the file uses (a growable spool's sparse size is its ceiling)
    headers = ["SPOOL", "POLICY", "SIZE", "FILL", "FRAMES", "SEQ RANGE", "PUT/S", "GET/S", "LAST PUT"]
    body = [[p["name"], p["on_full"],
             human_bytes(p["allocated"]) + (f" of {human_bytes(p['file_bytes'])}"
                                            if p["growable"] else ""),
             f"{100 * p['fill']:.1f}%",
             f"{p['frames']:,}",
             f"{p['first_seq']}..{p['next_seq'] - 1}" if p["frames"] else "-",
             human_rate(p["write_rate_per_s"]), human_rate(p["read_rate_per_s"]),
             human_age(p["last_put_ns"], now)] for p in rows]
    align = "lllrrrrrl"
    if a.anonymous:  # who has each anonymous queue open (its creator, usually)
        headers.append("OPEN BY")
        for p, row in zip(rows, body):
            row.append(("orphan (creator dead)" if p.get("orphan") else
                        ",".join(map(str, p["open_by"])) or "-") if p.get("anonymous") else "")
        align += "l"
    out = table(headers, body, align)
    print("\n".join(out))
    return EXIT_OK


def cmd_demo(args) -> int:
    from ..demo import run

    return run(seconds=args.seconds, writers=args.writers, capacity=args.capacity)



def register(add):
    """Add create, dispatch, rm, ls and demo to the ``shmq`` parser (``add`` makes a subparser)."""
    p = add("create", "create a spool",
            epilog="example: shmq create orders --capacity 64MiB --on-full block --mode 0660")
    p.add_argument("path", metavar="PATH")
    p.add_argument("--capacity", default="64MiB", help="ring size: bytes, or 64KiB/64MiB/1GiB "
                   "(default 64MiB; rounded up to 4 KiB)")
    p.add_argument("--max-capacity", metavar="SIZE", default=None,
                   help="make the spool growable: --capacity is allocated at first, and it grows "
                   "a segment at a time up to SIZE and shrinks as readers consume")
    p.add_argument("--on-full", choices=F.POLICIES, default="overwrite",
                   help="what a put does when the ring is full (default overwrite)")
    p.add_argument("--mode", type=mode_arg, default=0o600, help="file mode, octal (default 0600)")
    p.add_argument("--readers", type=positive_arg(int), default=F.DEFAULT_SLOTS,
                   help=f"named reader/group slots (default {F.DEFAULT_SLOTS})")
    p.add_argument("--leases", type=count_arg, default=F.DEFAULT_LEASES,
                   help=f"work-queue lease slots (default {F.DEFAULT_LEASES})")
    p.add_argument("--checksum", action="store_true", help="store a CRC-32 of every payload "
                   "(checked by fsck and by readers with verify=True)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=cmd_create)

    p = add("dispatch", "control a running shmq.Dispatcher: scale PATH TYPE N | status PATH | stop PATH",
            epilog="example: shmq dispatch scale jobs resize 8  (see docs/dispatcher.md)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="passed to the dispatcher's control CLI")
    p.set_defaults(func=cmd_dispatch)

    p = add("rm", "remove spools (file and semaphores)",
            description="Remove spools: the file and its semaphores (Spool.destroy), whatever "
            "state the file is in (truncated or header-corrupt spools too).  A spool another "
            "process has open is refused unless --force (those processes then keep working on "
            "the unlinked file).  A file that is not a spool is refused and left alone.")
    p.add_argument("paths", nargs="+", metavar="PATH")
    p.add_argument("-f", "--force", action="store_true", help="remove spools other processes "
                   "have open, and ignore missing ones")
    p.add_argument("-q", "--quiet", action="store_true", help="print nothing")
    p.set_defaults(func=cmd_rm)

    p = add("ls", "list the spools of a directory",
            description="List the spools in DIR (default your private /dev/shm/shmq-UID): files whose header "
            "validates, read without attaching.  Other files are skipped silently.  PUT/S and "
            "GET/S average the last 10 seconds.")
    p.add_argument("dir", nargs="?", metavar="DIR")
    p.add_argument("-a", "--anonymous", action="store_true",
                   help="also list your anonymous queues (shmq.Queue() without a path, "
                   "/dev/shm/shmq-q-*) with the pids that have each open (orphans: creator "
                   "dead, open by nobody), and on stderr your orphaned semaphores (see shmq gc)")
    p.add_argument("--json", action="store_true", help="print a JSON list")
    p.set_defaults(func=cmd_ls)

    demo = add("demo", "run a live demo of writers and readers over a spool")
    demo.add_argument("--seconds", type=float, default=5.0, help="how long to run (default 5)")
    demo.add_argument("--writers", type=int, default=2, help="writer processes (default 2)")
    demo.add_argument("--capacity", default="4MiB", help="ring size (default 4MiB)")
    demo.set_defaults(func=cmd_demo)
