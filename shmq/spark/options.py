"""The data source's options: parsed and validated on the driver, with clear errors.

Spark hands options as strings; each helper names the option in its error.
Also where a task opens its host's spool (:func:`open_spool`) and the
source's errors.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Mapping
from typing import Any

from pyspark.sql import types as T

from .. import _format as F
from ..errors import ShmqError
from ..spool import Spool

# --- errors ------------------------------------------------------------------


class WrongHost(ShmqError):
    """A read task ran on another host than the driver whose spool it must read."""


class DataLoss(ShmqError):
    """Frames a query still needed were overwritten (``failOnDataLoss=true``)."""


# --- options -----------------------------------------------------------------

_TRUE = ("true", "1", "yes")
_FALSE = ("false", "0", "no")


def opt_bool(options, key, default):
    v = options.get(key)
    if v is None:
        return default
    s = str(v).strip().lower()
    if s in _TRUE:
        return True
    if s in _FALSE:
        return False
    raise ValueError(f"option {key!r} must be true or false, not {v!r}")


def opt_int(options, key, default, minimum=0):
    v = options.get(key)
    if v is None:
        return default
    try:
        n = int(str(v).strip())
    except ValueError:
        raise ValueError(f"option {key!r} must be an integer, not {v!r}") from None
    if n < minimum:
        raise ValueError(f"option {key!r} must be >= {minimum}, not {n}")
    return n


def opt_float_or_none(options, key):
    v = options.get(key)
    if v is None or str(v).strip().lower() in ("", "none", "inf"):
        return None
    try:
        x = float(v)
    except ValueError:
        raise ValueError(f"option {key!r} must be a number of seconds, not {v!r}") from None
    if x < 0:
        raise ValueError(f"option {key!r} must be >= 0")
    return x


def offset_option(options, key, words):
    """'earliest'/'latest'/'committed' (those in ``words``), a seq, or '{"seq": n}'."""
    v = options.get(key)
    if v is None:
        return None
    s = str(v).strip()
    if s.lower() in words:
        return s.lower()
    try:
        if s.startswith("{"):
            n = json.loads(s)["seq"]
        else:
            n = int(s)
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError
        return n
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"option {key!r} must be one of {', '.join(words)}, a seq, "
                         f"or '{{\"seq\": n}}', not {v!r}") from None


def spool_path(options):
    path = options.get("path")
    if not path:
        raise ValueError("the shmq data source needs a spool: .option('path', '/dev/shm/shmq/NAME') "
                         "(or .save(path) / .load(path))")
    return str(path)


def open_spool(path, options=None, create=False, reading=False):
    """Open (or, with ``create``, create) the spool at ``path`` on this host."""
    try:
        return Spool.open(path)
    except FileNotFoundError:
        if reading:
            raise FileNotFoundError(f"no shmq spool at {path!r} on host {socket.gethostname()} "
                                    "(the driver's host, where shmq reads are planned)") from None
        if not create:
            raise FileNotFoundError(
                f"no shmq spool at {path!r} on host {socket.gethostname()}: create it on every "
                "host first (e.g. by the sidecar that consumes it), or set option create=true") from None
    opts = options or {}
    return Spool.create(path, capacity=opts.get("capacity") or "64MiB",
                        on_full=opts.get("onFull") or "overwrite", exist_ok=True)


class ReaderOptions:
    def __init__(self, options: Mapping[str, str], streaming: bool) -> None:
        self.path = spool_path(options)
        self.num_partitions = opt_int(options, "numPartitions", 1, minimum=1)
        self.fail_on_data_loss = opt_bool(options, "failOnDataLoss", True)
        self.reader_name = options.get("readerName") or None
        self.max_frames = opt_int(options, "maxFramesPerTrigger", 0, minimum=1) or None
        default_start = "committed" if (streaming and self.reader_name) else ("latest" if streaming else "earliest")
        words = ("earliest", "latest", "committed") if streaming else ("earliest",)
        self.starting = offset_option(options, "startingOffsets", words) or default_start
        if self.starting == "committed" and not self.reader_name:
            raise ValueError("startingOffsets=committed needs option readerName (the named reader "
                             "whose committed position to start from)")
        self.ending = None if streaming else (offset_option(options, "endingOffsets", ("latest",)) or "latest")


_ENCODINGS = ("value", "json", "pickle", "arrow")
_STAMPS = ("auto", "none", "field", "prefix")


class WriterOptions:
    def __init__(self, options: Mapping[str, str], schema: Any) -> None:
        self.path = spool_path(options)
        names = {f.name: f.dataType for f in schema.fields}
        enc = (options.get("encoding") or "auto").lower()
        if enc == "auto":
            enc = "value" if isinstance(names.get("value"), (T.BinaryType, T.StringType)) else "json"
        if enc not in _ENCODINGS:
            raise ValueError(f"option encoding must be one of auto, {', '.join(_ENCODINGS)}, not {enc!r}")
        if enc == "value" and not isinstance(names.get("value"), (T.BinaryType, T.StringType)):
            raise ValueError("encoding=value needs a 'value' column of type binary or string "
                             f"(columns: {', '.join(names) or 'none'}); use encoding=json or pickle")
        stamp = (options.get("stamp") or "auto").lower()
        if stamp not in _STAMPS:
            raise ValueError(f"option stamp must be one of {', '.join(_STAMPS)}, not {stamp!r}")
        if stamp == "auto":
            stamp = "none" if enc == "value" else "field"
        if stamp == "field" and enc == "value":
            raise ValueError("stamp=field needs encoding json, pickle or arrow (a raw value has no "
                             "fields); use stamp=prefix to stamp raw values")
        if stamp == "prefix" and enc == "arrow":
            raise ValueError("stamp=prefix would break Arrow IPC frames: arrow frames are stamped "
                             "in their schema metadata (stamp=field)")
        self.encoding = enc
        self.stamp = stamp
        self.create = opt_bool(options, "create", False)
        self.options = {"capacity": options.get("capacity"), "onFull": options.get("onFull")}
        self.put_timeout = opt_float_or_none(options, "putTimeout")
        self.batch_frames = opt_int(options, "batchFrames", 1000, minimum=1)
        self.codec = {"value": F.CODEC_RAW, "json": F.CODEC_JSON, "pickle": F.CODEC_PICKLE,
                      "arrow": F.CODEC_ARROW}[enc]
        if enc == "value" and isinstance(names["value"], T.StringType):
            self.codec = F.CODEC_UTF8
