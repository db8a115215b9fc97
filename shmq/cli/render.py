"""How frames are shown: payloads by codec tag, hex dumps, JSON lines.

Pickled payloads are only unpickled when the user passed ``--unsafe-pickle``.
"""

from __future__ import annotations

import base64
import json
import sys

from .. import _format as F
from .base import one_line
from .fmt import iso_time

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
    from ..codec import TRUSTED, decode

    return decode(data, codec, TRUSTED)


def render_payload(codec, data, unsafe_pickle=False) -> str:
    """The ``--format auto`` rendering of a payload, by its codec tag."""
    name = F.CODEC_NAMES.get(codec, f"codec {codec}") if codec is not None else "raw"
    if codec in (F.CODEC_PICKLE, F.CODEC_PICKLE_OOB, F.CODEC_VALUES):
        verb = "decode" if codec == F.CODEC_VALUES else "unpickle"
        if not unsafe_pickle:
            return f"<{name}: {len(data)} bytes; pass --unsafe-pickle to {verb}>"
        try:
            return repr(_unpickle(codec, data))
        except Exception as exc:  # a bad payload is data, not a crash
            return f"<{name}: {len(data)} bytes; {verb[:-1]}ing failed: {one_line(exc)}>"
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
    from ..columnar import decode_array

    try:
        arr = decode_array(data)
    except Exception as exc:
        return f"<numpy: {len(data)} bytes; undecodable: {one_line(exc)}>"
    import numpy as np

    head = np.array2string(arr.reshape(-1)[:3] if arr.ndim != 1 else arr[:3], threshold=6,
                           max_line_width=200)
    more = " ..." if arr.size > 3 else ""
    return f"<numpy {arr.dtype} shape {tuple(arr.shape)}: {head}{more}>"


def _render_arrow(data) -> str:
    """Schema and the first rows of an Arrow frame (needs pyarrow)."""
    try:
        from ..columnar import decode_arrow

        table = decode_arrow(bytes(data))
    except ImportError:
        return f"<arrow: {len(data)} bytes; install pyarrow to show it>"
    except Exception as exc:
        return f"<arrow: {len(data)} bytes; undecodable: {one_line(exc)}>"
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
    elif codec in (F.CODEC_PICKLE, F.CODEC_PICKLE_OOB, F.CODEC_VALUES) and unsafe_pickle:
        try:
            d["repr"] = repr(_unpickle(codec, rec.data))
        except Exception as exc:
            d["error"] = one_line(exc)
    d["base64"] = base64.b64encode(rec.data).decode("ascii")
    return d


def emit(rec, fmt, unsafe_pickle):
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


