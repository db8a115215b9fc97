"""Frame commands: ``put`` and ``cat`` (a seq range); ``tail`` lives in :mod:`.tail`."""

from __future__ import annotations

import argparse
import json
import sys

from .. import _format as F
from ..errors import FrameLost, Full
from .args import FORMATS, formatter, position_arg
from .base import EXIT_OK, EXIT_USAGE, CliError, open_spool
from .fmt import human_bytes, print_json
from .render import emit


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


def _check_codec(codec, data, n):
    """Raise a usage error if frame ``n`` (1-based) is not valid for ``codec``."""
    if codec == "json":
        try:
            json.loads(data)
        except ValueError as exc:
            return f"frame {n} is not valid JSON ({exc})"
    elif codec == "utf8":
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            return f"frame {n} is not valid UTF-8"
    return None


def cmd_put(a) -> int:
    codec = {"raw": F.CODEC_RAW, "utf8": F.CODEC_UTF8, "json": F.CODEC_JSON}[a.codec]
    streaming = not a.data and not a.file  # stdin lines: put as they arrive
    items = _put_items(a)
    if not streaming:
        # DATA and --file are in memory anyway: validate all before storing any
        items = list(items)
        for n, data in enumerate(items, 1):
            problem = _check_codec(a.codec, data, n)
            if problem:
                raise CliError(f"{problem}; nothing was put", EXIT_USAGE)
    sp = open_spool(a.path)
    first = last = None
    count = nbytes = 0
    try:
        for data in items:
            problem = _check_codec(a.codec, data, count + 1) if streaming else None
            if problem:
                raise CliError(f"{problem}; the {count} frame(s) before it were put"
                               + (f" (seq {first}..{last})" if count else ""), EXIT_USAGE)
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
        print_json({"path": sp.path, "count": count, "bytes": nbytes, "first_seq": first,
                     "last_seq": last})
    elif not a.quiet:
        rng = "" if first is None else f" (seq {first})" if first == last else f" (seq {first}..{last})"
        print(f"put {count} frame{'s' * (count != 1)}, {human_bytes(nbytes)} into {sp.path}{rng}")
    return EXIT_OK


def cmd_cat(a) -> int:
    from ..dump import record_at

    sp = open_spool(a.path)
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
            emit(rec, a.format, a.unsafe_pickle)
        sys.stdout.flush()
    finally:
        sp.close()
    if skipped:
        print(f"shmq cat: skipped {skipped} overwritten frame(s)", file=sys.stderr)
    return EXIT_OK


_PUT_HELP = "put frames into a spool"
_PUT_DESCRIPTION = ("Put each DATA argument as one frame; without DATA (or --file), each line of "
                    "stdin (without its newline).  --file FILE puts a whole file as one frame "
                    "('-': all of stdin).  Options and DATA may be mixed.")


def put_arguments(p):
    p.add_argument("path", metavar="PATH")
    p.add_argument("data", nargs="*", metavar="DATA")
    p.add_argument("--file", action="append", metavar="FILE", help="a file as one frame "
                   "(repeatable)")
    p.add_argument("--codec", choices=("raw", "utf8", "json"), default="raw",
                   help="codec tag of the frames (json and utf8 are validated: DATA and --file "
                   "all before any is put; stdin lines one by one; default raw)")
    p.add_argument("--timeout", type=float, default=5.0, metavar="S",
                   help="how long a put may wait for room (block policy) or the lock "
                   "(default 5)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("-q", "--quiet", action="store_true", help="print nothing")
    p.set_defaults(func=cmd_put, command="put")
    return p



def register(add):
    """Add ``put`` and ``cat`` to the ``shmq`` parser; return the intermixed put parser."""
    put_arguments(add("put", _PUT_HELP, description=_PUT_DESCRIPTION))

    p = add("cat", "print a range of frames by seq",
            description="Print frames --from SEQ --to SEQ (inclusive; default: all in the ring) "
            "with lock-free reads by seq (Spool.read_at).")
    p.add_argument("path", metavar="PATH")
    p.add_argument("--from", dest="from_", type=position_arg, metavar="SEQ")
    p.add_argument("--to", type=position_arg, metavar="SEQ")
    p.add_argument("--format", choices=FORMATS, default="auto", help="as for tail")
    p.add_argument("--unsafe-pickle", action="store_true", help="as for tail")
    p.add_argument("--skip-lost", action="store_true", help="skip overwritten frames instead "
                   "of failing")
    p.set_defaults(func=cmd_cat)

    # `put PATH --codec json DATA...`: DATA after an option needs intermixed parsing,
    # which argparse refuses on a parser with subparsers: parse put on its own.
    return put_arguments(argparse.ArgumentParser(
        prog="shmq put", description=_PUT_DESCRIPTION, formatter_class=formatter))
