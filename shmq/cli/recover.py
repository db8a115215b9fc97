"""Recovery commands: ``fsck`` (verify, repair), ``export`` and ``import`` (portable dumps)."""

from __future__ import annotations

import os
import sys

from .. import _format as F
from .args import mode_arg, positive_arg
from .base import EXIT_NOT_FOUND, EXIT_OK, EXIT_PROBLEMS, CliError, progress_wanted
from .fmt import human_bytes, plural, print_json


def cmd_fsck(a) -> int:
    from ..repair import repair
    from ..verify import verify

    rep = repair(a.path) if a.repair else verify(a.path)
    code = EXIT_OK if rep.ok else EXIT_PROBLEMS
    if a.json:
        d = rep.as_dict()
        d["exit_code"] = code
        print_json(d)
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
        hint = _advice(rep.problems, a.repair)
        remain = (" remains" if n == 1 else " remain") if a.repair else ""
        print(f"{plural(n, 'problem')}{remain}{hint}")
    return code


# --- export / import -----------------------------------------------------------


def _advice(problems, repaired) -> str:
    """The commands that can help with these fsck problems (and only those)."""
    fixable = any(p.startswith(("writer lock", "reader table", "control word SLOT_HWM"))
                  for p in problems)
    ring = any(p.startswith("ring") for p in problems)
    broken = any(p.startswith(("geometry", "control word")) and not p.startswith(
        "control word SLOT_HWM") for p in problems)
    tips = []
    if fixable and not repaired:
        tips.append("'shmq fsck --repair' fixes stale locks and damaged reader slots")
    if ring:
        tips.append("a damaged ring cannot be repaired: keep what is readable with 'shmq export "
                    "--skip-corrupt PATH FILE', then 'shmq rm PATH' and 'shmq import FILE PATH'")
    elif broken:
        tips.append("a damaged header or control block cannot be repaired: remove the spool "
                    "('shmq rm PATH') and create it again")
    return "".join("; " + t for t in tips)


def cmd_export(a) -> int:
    from ..dump import export_spool

    s = export_spool(a.path, a.file, progress=progress_wanted(a), skip_corrupt=a.skip_corrupt)
    out = sys.stderr if a.file == "-" else sys.stdout
    if s["corrupt"] and not a.json:
        ranges = ", ".join(f"{lo}" if lo == hi else f"{lo}..{hi}" for lo, hi in s["corrupt_ranges"])
        print(f"shmq export: skipped {s['corrupt']:,} damaged frame(s) (seq {ranges})",
              file=sys.stderr)
    if a.json:
        print_json(s, out=out)
    elif not a.quiet:
        lost = f"; {s['lost']} overwritten during the export" if s["lost"] else ""
        print(f"exported {s['frames']:,} frames ({human_bytes(s['bytes'])}) and "
              f"{s['readers']} reader positions from {s['source']} to {a.file}{lost}", file=out)
    return EXIT_OK


def cmd_import(a) -> int:
    from ..dump import import_dump

    if a.file != "-" and not os.path.exists(a.file):
        raise CliError(f"{a.file}: no such dump file", EXIT_NOT_FOUND)
    s = import_dump(a.file, a.path, capacity=a.capacity, on_full=a.on_full, mode=a.mode,
                    append=a.append, keep_timestamps=not a.new_timestamps, timeout=a.timeout,
                    progress=progress_wanted(a))
    if a.json:
        print_json(s)
    elif not a.quiet:
        print(f"imported {s['frames']:,} frames ({human_bytes(s['bytes'])}) into {s['path']} "
              f"(seq {s['first_seq']}..{s['next_seq'] - 1}); {len(s['readers'])} reader(s) "
              "restored"
              + (f", {len(s['readers_kept'])} already there kept" if s["readers_kept"] else ""))
    return EXIT_OK


def register(add):
    """Add ``fsck``, ``export`` and ``import`` to the ``shmq`` parser."""
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
    p.set_defaults(func=cmd_fsck)

    p = add("export", "write a portable dump of a spool's frames and reader positions",
            description="Write every frame (seq, timestamp, codec, flags, payload) and the "
            "named readers' positions to FILE ('-': stdout) in a versioned format that any "
            "shmq version can import.  Live writers are not held back.")
    p.add_argument("path", metavar="PATH")
    p.add_argument("file", metavar="FILE")
    p.add_argument("--skip-corrupt", action="store_true", help="skip damaged frames (counted "
                   "and reported) instead of failing; without it a damaged frame fails the "
                   "export and removes the partial FILE")
    p.add_argument("--progress", action="store_true", help="progress line on stderr even when "
                   "stderr is not a terminal")
    p.add_argument("--no-progress", action="store_true", help="no progress line")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("-q", "--quiet", action="store_true", help="print no summary")
    p.set_defaults(func=cmd_export)

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
    p.add_argument("--mode", type=mode_arg, help="file mode of the new spool (default 0600)")
    p.add_argument("--new-timestamps", action="store_true", help="stamp frames with the import "
                   "time instead of their original time")
    p.add_argument("--timeout", type=positive_arg(float), default=10.0, metavar="S",
                   help="how long to wait for room before failing (default 10)")
    p.add_argument("--progress", action="store_true", help="progress line on stderr even when "
                   "stderr is not a terminal")
    p.add_argument("--no-progress", action="store_true", help="no progress line")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("-q", "--quiet", action="store_true", help="print no summary")
    p.set_defaults(func=cmd_import)
