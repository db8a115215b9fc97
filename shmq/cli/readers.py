"""``shmq readers``: list, remove and move named readers and groups."""

from __future__ import annotations

import argparse
import time

from ..errors import ReaderBusy, ShmqError
from .args import formatter, position_arg
from .base import EXIT_NOT_FOUND, EXIT_OK, EXIT_USAGE, CliError, open_spool
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


def cmd_readers_seek(a) -> int:
    sp = open_spool(a.path)
    try:
        have = find_reader(sp, a.name)
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
        new = find_reader(sp, a.name).position
    finally:
        sp.close()
    if a.json:
        print_json({"path": sp.path, "name": a.name, "kind": "group" if group else "reader",
                     "old_position": old, "position": new, "created": have is None})
    else:
        what = "group" if group else "reader"
        if have is None:
            print(f"created {what} {a.name!r} at seq {new} ({a.where})")
        else:
            print(f"{what} {a.name!r}: seq {old} -> {new} ({a.where})")
    return EXIT_OK


def register(add):
    """Add ``readers`` to the ``shmq`` parser; return ``{verb: parser}`` for ``readers VERB``
    (argparse cannot mix a positional PATH with sub-verbs)."""
    readers_epilog = ("also:\n  shmq readers rm PATH NAME [NAME ...]      forget named readers"
                      "\n  shmq readers seek PATH NAME earliest|latest|SEQ   move a cursor"
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
    p.add_argument("where", type=position_arg, metavar="earliest|latest|SEQ")
    p.add_argument("--create", action="store_true", help="register NAME there if it is new")
    p.add_argument("--group", action="store_true", help="with --create: make it a group")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=cmd_readers_seek, command="readers seek")
    extra["seek"] = p
    return extra
