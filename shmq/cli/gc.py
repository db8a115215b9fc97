"""``shmq gc``: list (and with ``--yes`` remove) your orphaned semaphores and anonymous queues."""

from __future__ import annotations

import argparse

from .base import EXIT_OK
from .fmt import print_json


def _seconds(text):
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, not {text!r}") from None
    if not v >= 0:
        raise argparse.ArgumentTypeError(f"expected seconds >= 0, not {text}")
    return v


def cmd_gc(a) -> int:
    from ..gc import sweep

    found = sweep(remove=a.yes, min_age=a.min_age)
    if a.json:
        print_json({"semaphores": found.semaphores, "queues": found.queues,
                    "stale_registry_entries": found.stale_entries, "kept": found.kept,
                    "removed": found.removed})
        return EXIT_OK
    verb = "removed" if a.yes else "would remove"
    for prefix, names in sorted(found.semaphores.items()):
        print(f"{verb} semaphores of a removed spool: {', '.join(names)}")
    for q in found.queues:
        print(f"{verb} anonymous queue (creator dead, open by nobody): {q}")
    nsem = sum(len(v) for v in found.semaphores.values())
    print(f"{'removed' if a.yes else 'found'} {nsem} orphaned semaphore(s) of "
          f"{len(found.semaphores)} spool(s) and {len(found.queues)} orphaned anonymous "
          f"queue(s); kept the semaphores of {found.kept} spool(s) that exist or are in use"
          + ("" if a.yes or not (nsem or found.queues) else "; run 'shmq gc --yes' to remove them"))
    return EXIT_OK


def register(add):
    """Add ``gc`` to the ``shmq`` parser."""
    p = add("gc", "list (--yes: remove) your orphaned semaphores and anonymous queues",
            description="List your sem.shmq.* semaphores whose spool file no longer exists "
            "(removed with rm instead of 'shmq rm' / Spool.destroy) and that no live process "
            "maps, and your anonymous queues (shmq.Queue() without a path) whose creator is "
            "dead and that no live process has open.  Semaphores of a spool that exists are "
            "never touched: spools under /dev/shm are found by a scan, those elsewhere (disk "
            "paths) from a record shmq keeps in your private directory when it creates them. "
            "A dry run unless --yes.")
    p.add_argument("--yes", action="store_true", help="remove what is listed")
    p.add_argument("--min-age", type=_seconds, default=2.0, metavar="S",
                   help="leave semaphores younger than S seconds alone (a spool being created; "
                   "default 2)")
    p.add_argument("--json", action="store_true", help="print what was found as JSON")
    p.set_defaults(func=cmd_gc)
