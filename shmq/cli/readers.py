"""``shmq readers``: list, remove and move named readers and groups."""

from __future__ import annotations

import argparse
import datetime as _dt
import time

from ..errors import FrameLost, ReaderBusy, ShmqError
from .args import formatter, position_arg
from .base import EXIT_ERROR, EXIT_NOT_FOUND, EXIT_OK, EXIT_USAGE, CliError, open_spool
from .fmt import age_s, print_json
from .stat import readers_table


def cmd_readers(a) -> int:
    sp = open_spool(a.path)
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
        print_json(rows)
    elif not readers:
        print(f"no named readers or groups in {sp.path} (next seq {nxt})")
    else:
        print("\n".join(readers_table(readers, now)))
    return EXIT_OK


def find_reader(sp, name):
    for r in sp.readers():
        if r.name == name:
            return r
    return None


def cmd_readers_rm(a) -> int:
    sp = open_spool(a.path)
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


def parse_time(text) -> int:
    """An ISO 8601 date-time as ns since the epoch (no zone: local time, like ``date``)."""
    try:
        t = _dt.datetime.fromisoformat(text)
    except ValueError:
        raise CliError(f"--to-time expects an ISO 8601 time like 2026-11-23T14:05:00Z, not "
                       f"{text!r}", EXIT_USAGE) from None
    if t.tzinfo is None:
        t = t.astimezone()  # local time
    return int(t.timestamp()) * 1_000_000_000 + t.microsecond * 1000


def seq_at_time(sp, ts_ns) -> int:
    """The seq of the oldest resident frame stamped at or after ``ts_ns`` (next_seq if
    none): a binary search over lock-free reads by seq (``Spool.read_at``), assuming
    timestamps rise with seq, as they do for frames put on one host."""
    for _attempt in range(100):
        lo, hi = sp.first_seq, sp.next_seq  # answer in [lo, hi]
        try:
            while lo < hi:
                mid = (lo + hi) // 2
                if sp.read_at(mid).timestamp_ns >= ts_ns:
                    hi = mid
                else:
                    lo = mid + 1
            return lo
        except FrameLost:
            continue  # a writer overwrote the lower end meanwhile: search again
    raise CliError(f"{sp.path}: frames are overwritten faster than they can be searched",
                   EXIT_ERROR)


def _target(sp, a, have):
    """Where ``readers seek`` moves the cursor, and a description of why."""
    first, nxt = sp.first_seq, sp.next_seq
    if a.to_time is not None:
        ts = parse_time(a.to_time)
        seq = seq_at_time(sp, ts)
        return seq, f"first frame at or after {a.to_time}" if seq < nxt else (
            f"no frame at or after {a.to_time}: the end")
    if a.shift_by is not None:
        if have is None:
            raise CliError(f"{sp.path}: --shift-by moves an existing reader; {a.name!r} does "
                           "not exist", EXIT_NOT_FOUND)
        seq = have.position + a.shift_by
        clamped = min(max(seq, first), nxt)
        why = f"shift by {a.shift_by:+d}"
        if clamped != seq:
            why += f", clamped to the ring ({first}..{nxt})"
        return clamped, why
    if a.where is None:
        raise CliError("say where: earliest|latest|SEQ, --to-time or --shift-by", EXIT_USAGE)
    return a.where, str(a.where)


def cmd_readers_seek(a) -> int:
    if sum(x is not None for x in (a.where, a.to_time, a.shift_by)) > 1:
        raise CliError("give one of earliest|latest|SEQ, --to-time, --shift-by", EXIT_USAGE)
    sp = open_spool(a.path)
    try:
        have = find_reader(sp, a.name)
        if have is None and not a.create:
            raise CliError(f"{sp.path}: no reader or group named {a.name!r} (pass --create to "
                           "register it at that position)", EXIT_NOT_FOUND)
        group = a.group if have is None else have.kind == "group"
        old = have.position if have else None
        where, why = _target(sp, a, have)
        if a.dry_run:
            new = where if isinstance(where, int) else (
                sp.first_seq if where == "earliest" else sp.next_seq)
            if new > sp.next_seq:
                raise CliError(f"{sp.path}: seq {new} is beyond the next seq {sp.next_seq}",
                               EXIT_USAGE)
            lag = sp.next_seq - new
        else:
            new, lag = _move(sp, a, have, group, where), None
    finally:
        sp.close()
    kind = "group" if group else "reader"
    if a.json:
        d = {"path": sp.path, "name": a.name, "kind": kind, "old_position": old,
             "position": new, "created": have is None, "reason": why, "dry_run": a.dry_run}
        if a.dry_run:
            d["lag_after"] = lag
        print_json(d)
    elif a.dry_run:
        change = f"would be created at seq {new}" if have is None else f"seq {old} -> {new}"
        print(f"{kind} {a.name!r}: {change} ({why}); {lag:,} frame(s) to read after; dry run, "
              "nothing changed")
    elif have is None:
        print(f"created {kind} {a.name!r} at seq {new} ({why})")
    else:
        print(f"{kind} {a.name!r}: seq {old} -> {new} ({why})")
    return EXIT_OK


def _move(sp, a, have, group, where):
    """Attach the named reader, seek, commit, detach; return its new position."""
    try:
        r = sp.reader(a.name, group=group, start=where if have is None else "earliest")
    except ReaderBusy:
        pid = have.pid if have else "?"
        raise ReaderBusy(f"{sp.path}: reader {a.name!r} is attached by another process "
                         f"(pid {pid}); stop it before seeking") from None
    try:
        if have is not None:
            r.seek(where)
            r.commit()
    except ShmqError:
        raise
    except ValueError as exc:
        raise CliError(f"{sp.path}: {exc}", EXIT_USAGE) from None
    finally:
        r.close()
    return find_reader(sp, a.name).position


def register(add):
    """Add ``readers`` to the ``shmq`` parser; return ``{verb: parser}`` for ``readers VERB``
    (argparse cannot mix a positional PATH with sub-verbs)."""
    readers_epilog = ("also:\n  shmq readers rm PATH NAME [NAME ...]      forget named readers"
                      "\n  shmq readers seek PATH NAME earliest|latest|SEQ|--to-time T|--shift-by N"
                      " [--dry-run]   move a cursor"
                      "\n(a spool literally named rm or seek: use ./rm or 'readers list rm')")
    p = add("readers", "list named readers and groups (also: readers rm, readers seek)",
            description="List the named readers and groups of a spool with their position, "
            "lag, loss, pid and liveness.", epilog=readers_epilog)
    p.add_argument("path", metavar="PATH")
    p.add_argument("--json", action="store_true", help="print a JSON list")
    p.set_defaults(func=cmd_readers)

    extra = {}
    p = argparse.ArgumentParser(prog="shmq readers list", formatter_class=formatter,
                                description="List the named readers and groups of a spool.")
    p.add_argument("path", metavar="PATH")
    p.add_argument("--json", action="store_true", help="print a JSON list")
    p.set_defaults(func=cmd_readers, command="readers")
    extra["list"] = extra["ls"] = p

    p = argparse.ArgumentParser(
        prog="shmq readers rm", formatter_class=formatter,
        description="Forget named readers or groups (their cursors stop holding writers back). "
        "Refused while a live process has one attached.")
    p.add_argument("path", metavar="PATH")
    p.add_argument("names", nargs="+", metavar="NAME")
    p.add_argument("-q", "--quiet", action="store_true", help="print nothing")
    p.set_defaults(func=cmd_readers_rm, command="readers rm")
    extra["rm"] = p

    p = argparse.ArgumentParser(
        prog="shmq readers seek", formatter_class=formatter,
        description="Move a named reader's (or group's) committed position: attach it, seek, "
        "commit, detach.  Refused while another process has the reader attached "
        "(a group's shared cursor moves under the group lock even while members run).")
    p.add_argument("path", metavar="PATH")
    p.add_argument("name", metavar="NAME")
    p.add_argument("where", type=position_arg, nargs="?", metavar="earliest|latest|SEQ")
    p.add_argument("--to-time", metavar="ISO8601", help="to the first frame stamped at or after "
                   "this time (e.g. 2026-11-23T14:05:00Z; no zone: local time)")
    p.add_argument("--shift-by", type=int, metavar="N", help="by N frames from the current "
                   "position (negative: back), clamped to the frames in the ring")
    p.add_argument("--dry-run", action="store_true", help="print where it would move, change "
                   "nothing (works while the reader is attached)")
    p.add_argument("--create", action="store_true", help="register NAME there if it is new")
    p.add_argument("--group", action="store_true", help="with --create: make it a group")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=cmd_readers_seek, command="readers seek")
    extra["seek"] = p
    return extra
