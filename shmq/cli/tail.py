"""``shmq tail``: the last frames of a spool, or follow it (across removal and re-creation),
with include/exclude filters on the payload text or on JSON fields."""

from __future__ import annotations

import json
import os
import re
import sys
import time

from .. import _format as F
from ..errors import ShmqError
from .args import FORMATS, count_arg, position_arg, positive_arg
from .base import EXIT_OK, EXIT_USAGE, CliError, open_spool
from .render import emit

#: How often ``tail -f`` checks that the file it follows is still the spool at PATH.
FOLLOW_CHECK_S = 1.0
_FIELD = re.compile(r"^([A-Za-z_][\w.-]*)=(.*)$", re.S)


class Filter:
    """``--grep``/``--exclude`` patterns: a frame is shown when it matches any --grep (or
    there is none) and no --exclude.  ``FIELD=VALUE`` matches JSON frames whose field
    (dotted path into objects) equals VALUE (as JSON if VALUE parses, else as a string);
    anything else is a regular expression searched in the payload as UTF-8 text.
    Pickled frames are never unpickled to be matched: only field-free regexes see them,
    and they see nothing (a pickled frame matches no pattern)."""

    def __init__(self, grep=(), exclude=()):
        self.grep = [self._compile(p) for p in grep or ()]
        self.exclude = [self._compile(p) for p in exclude or ()]

    @staticmethod
    def _compile(pattern):
        m = _FIELD.match(pattern)
        if m:
            key, raw = m.groups()
            try:
                value = json.loads(raw)
            except ValueError:
                value = raw
            return ("field", key.split("."), value)
        try:
            return ("re", re.compile(pattern), None)
        except re.error as exc:
            raise CliError(f"bad pattern {pattern!r}: {exc}", EXIT_USAGE) from None

    def __bool__(self):
        return bool(self.grep or self.exclude)

    def wants(self, rec) -> bool:
        cache = {}
        if self.grep and not any(self._match(p, rec, cache) for p in self.grep):
            return False
        return not any(self._match(p, rec, cache) for p in self.exclude)

    @staticmethod
    def _match(pattern, rec, cache):
        kind, what, value = pattern
        if rec.codec in (F.CODEC_PICKLE, F.CODEC_PICKLE_OOB, F.CODEC_WORKQ, F.CODEC_VALUES):
            return False
        if kind == "re":
            if "text" not in cache:
                cache["text"] = rec.data.decode("utf-8", "replace")
            return what.search(cache["text"]) is not None
        if "json" not in cache:
            try:
                cache["json"] = json.loads(rec.data)
            except ValueError:
                cache["json"] = None
        doc = cache["json"]
        for key in what:
            if not isinstance(doc, dict) or key not in doc:
                return False
            doc = doc[key]
        return doc == value or (isinstance(value, str) and str(doc) == value)


def _identity(path):
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def cmd_tail(a) -> int:
    from ..dump import iter_records

    flt = Filter(a.grep, a.exclude)
    sp = open_spool(a.path)
    path = sp.path
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
        if not a.follow:
            # Without -f, stop at the end seen now: busy writers must not make tail endless.
            try:
                for rec in iter_records(sp, start, sp.next_seq, info=info, clamp=True):
                    if flt and not flt.wants(rec):
                        continue
                    emit(rec, a.format, a.unsafe_pickle)
                    shown += 1
                    if limit is not None and shown >= limit:
                        break
            except ShmqError:
                raise
            except ValueError as exc:  # start beyond next_seq
                raise CliError(f"{path}: {exc}", EXIT_USAGE) from None
            sys.stdout.flush()
            lost = info.get("lost", 0)
        else:
            sp, lost = _follow(sp, path, start, limit, flt, a)
        if lost:
            print(f"shmq tail: {lost} frame(s) were overwritten before they could be read",
                  file=sys.stderr)
    finally:
        sp.close()
    return EXIT_OK


def _follow(sp, path, start, limit, flt, a):
    """``tail -f``: print new frames until Ctrl-C, --timeout idle seconds or -n frames.
    Every FOLLOW_CHECK_S without a frame it checks that PATH is still the same file:
    a removed spool is reported and waited for; a re-created one is followed from its
    first frame.  Returns (the spool handle now open, frames lost)."""
    from ..dump import iter_records

    shown = lost = 0
    me = _identity(path)
    idle_since = time.monotonic()
    try:
        while True:
            info = {}
            chunk = FOLLOW_CHECK_S
            if a.timeout:
                chunk = max(0.0, min(chunk, a.timeout - (time.monotonic() - idle_since)))
            try:
                for rec in iter_records(sp, start, None, follow=True, timeout=chunk, info=info,
                                        clamp=True):
                    start = rec.seq + 1
                    idle_since = time.monotonic()
                    if flt and not flt.wants(rec):
                        continue
                    emit(rec, a.format, a.unsafe_pickle)
                    sys.stdout.flush()
                    shown += 1
                    if limit is not None and shown >= limit:
                        return sp, lost + info.get("lost", 0)
            except ValueError as exc:  # start beyond next_seq
                raise CliError(f"{path}: {exc}", EXIT_USAGE) from None
            lost += info.get("lost", 0)
            if start in ("latest", "earliest"):
                start = info.get("position", start)
            if a.timeout and time.monotonic() - idle_since >= a.timeout:
                return sp, lost
            now = _identity(path)
            if now == me:
                continue
            if now is None:
                print(f"shmq tail: {path} was removed; waiting for it to be created again",
                      file=sys.stderr)
                while now is None:
                    if a.timeout and time.monotonic() - idle_since >= a.timeout:
                        return sp, lost
                    time.sleep(min(0.2, FOLLOW_CHECK_S))  # polling: the file does not exist
                    now = _identity(path)
            try:
                new = open_spool(path)
            except (FileNotFoundError, ShmqError):
                continue  # being created right now (or not a spool yet): look again
            sp.close()
            sp, me, start = new, _identity(path), "earliest"
            print(f"shmq tail: {path} was created again; following the new spool",
                  file=sys.stderr)
    except KeyboardInterrupt:
        return sp, lost


def register(add):
    """Add ``tail`` to the ``shmq`` parser."""
    p = add("tail", "print the last frames of a spool (or follow it)",
            description="Print frames through an anonymous reader (it holds no writer back and "
            "leaves no trace).  Without --from: the last N frames (-n, default 10).  With "
            "--from: frames from there on, at most -n of them.  Payloads are decoded by the "
            "frame's codec tag; pickled frames are only unpickled with --unsafe-pickle.  "
            "With -f, a spool removed meanwhile is reported and waited for, and a re-created "
            "one is followed from its first frame.")
    p.add_argument("path", metavar="PATH")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing new frames")
    p.add_argument("--from", dest="from_", type=position_arg, metavar="earliest|latest|SEQ")
    p.add_argument("-n", "--lines", type=count_arg, metavar="N", help="number of frames "
                   "(without --from: the last N frames, before filtering)")
    p.add_argument("--grep", action="append", metavar="PATTERN",
                   help="show only frames matching PATTERN: a regular expression on the payload "
                   "text, or FIELD=VALUE on a JSON field (dotted path); repeatable (any matches)")
    p.add_argument("--exclude", action="append", metavar="PATTERN",
                   help="hide frames matching PATTERN (same forms as --grep); repeatable")
    p.add_argument("--format", choices=FORMATS, default="auto",
                   help="auto (by codec), raw (payload bytes only), hex, json (one object per "
                   "line), repr (default auto)")
    p.add_argument("--unsafe-pickle", action="store_true",
                   help="unpickle pickled frames to show their repr (runs code from the spool)")
    p.add_argument("--timeout", type=positive_arg(float), metavar="S",
                   help="with -f: exit after S seconds without a new frame")
    p.set_defaults(func=cmd_tail)
