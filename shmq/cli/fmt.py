"""Human formatting for the CLI: sizes, rates, durations, ages, tables, sparklines, JSON."""

from __future__ import annotations

import datetime as _dt
import json
import re
import sys
import time

SPARK = "▁▂▃▄▅▆▇█"


def human_bytes(n) -> str:
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def human_rate(x) -> str:
    """A rate per second: 950, 12.3k, 1.2M."""
    if x is None:
        return "-"
    if x < 1000:
        return f"{x:.0f}" if x == int(x) or x >= 10 else f"{x:.1f}"
    for unit, div in (("k", 1e3), ("M", 1e6), ("G", 1e9)):
        if x < div * 1000 or unit == "G":
            return f"{x / div:.1f}{unit}"
    return str(x)


def human_duration(ns) -> str:
    if ns <= 0:
        return "0"
    if ns < 1_000:
        return f"{ns} ns"
    if ns < 1_000_000:
        return f"{ns / 1e3:.1f} µs"
    if ns < 1_000_000_000:
        return f"{ns / 1e6:.1f} ms"
    s = ns / 1e9
    if s < 60:
        return f"{s:.1f} s"
    s = int(s)
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def human_age(ts_ns, now_ns=None) -> str:
    if not ts_ns:
        return "never"
    now_ns = time.time_ns() if now_ns is None else now_ns
    d = now_ns - ts_ns
    return "just now" if d < 1_000_000 else f"{human_duration(d)} ago"


def plural(n, word) -> str:
    return f"{n:,} {word}{'s' * (n != 1)}"


def age_s(ts_ns, now_ns):
    return None if not ts_ns else round(max(0, now_ns - ts_ns) / 1e9, 6)


def iso_time(ts_ns) -> str:
    t = _dt.datetime.fromtimestamp(ts_ns / 1e9, tz=_dt.timezone.utc)
    return t.strftime("%Y-%m-%dT%H:%M:%S.") + f"{ts_ns % 1_000_000_000 // 1000:06d}Z"


def sparkline(values) -> str:
    """One character per value, scaled to the largest ('▁' for zero)."""
    values = list(values)
    top = max(values, default=0)
    if top <= 0:
        return SPARK[0] * len(values)
    return "".join(SPARK[min(len(SPARK) - 1, int(v * (len(SPARK) - 1) / top + 0.999))] if v else SPARK[0]
                   for v in values)


def table(headers, rows, align=None) -> list[str]:
    """Left/right aligned columns (``align``: a string of 'l'/'r' per column)."""
    align = align or "l" * len(headers)
    widths = [len(h) for h in headers]
    for row in rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(str(cell)))

    def fmt(row):
        cells = [str(c).rjust(widths[i]) if align[i] == "r" else str(c).ljust(widths[i])
                 for i, c in enumerate(row)]
        return "  ".join(cells).rstrip()

    return [fmt(headers)] + [fmt(r) for r in rows]




def print_json(obj, compact=False, out=None):
    out = out or sys.stdout
    if compact:
        out.write(json.dumps(obj, separators=(",", ":"), sort_keys=False) + "\n")
    else:
        # indented, with short lists of numbers (the rate series' pairs) kept on one line
        text = json.dumps(obj, indent=2)
        text = re.sub(r"\[\s+(-?[\d.e+-]+),\s+(-?[\d.e+-]+)\s+\]", r"[\1, \2]", text)
        out.write(text + "\n")
    out.flush()


