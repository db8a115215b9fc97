#!/usr/bin/env python3
"""The candidate encodings of a shmq.Queue item, timed in one process: what chose the values codec.

A queue item of small objects spends most of its time in pickle
(``pickle.dumps`` and ``loads``).  The candidates, each encoding then decoding
the same objects, interleaved (A, B, C, D, A, B, ...), medians of the repeats:

* ``pickle``: ``pickle.dumps(obj, 5)`` / ``pickle.loads`` (what the queue did);
* ``pickler``: pickle protocol 5 through one cached ``Pickler`` and
  ``Unpickler`` over reused ``BytesIO`` buffers (memos cleared per item);
* ``marshal``: ``marshal.dumps`` / ``loads`` (its subset of builtin types;
  an encoder would have to check exact types first, as marshal writes a
  subclass as its base type and any buffer as bytes);
* ``values``: shmq's values codec (``shmq._core.values_dumps`` / ``values_loads``,
  shmq/core/values.c), exact builtin types only, the rest pickled.

    python stress/codec_bench.py                 # ns per item, payload bytes
    python stress/codec_bench.py --json out.json
"""

from __future__ import annotations

import argparse
import io
import json
import marshal
import os
import pickle
import statistics
import sys
import timeit

from shmq import _core

#: What a queue carries: the benchmark's dict first (stress/bench_contenders.py).
OBJECTS = {
    "small dict": {"id": 12345, "name": "sensor-7", "value": 3.25, "ok": True, "tags": ["a", "b"]},
    "tuple (int, float, str)": (12345, 3.25, "sensor-7"),
    "str, 20 chars": "sensor-7 reading ok.",
    "int": 12345,
    "list of 100 floats": [i * 0.5 for i in range(100)],
    "dict of 100 str: int": {f"key-{i}": i for i in range(100)},
}


def _cached_pickle():
    out, inp = io.BytesIO(), io.BytesIO()
    p = pickle.Pickler(out, 5)

    def dumps(obj):
        out.seek(0)
        out.truncate()
        p.clear_memo()
        p.dump(obj)
        return out.getvalue()

    def loads(data):
        inp.seek(0)
        inp.truncate()
        inp.write(data)
        inp.seek(0)
        return pickle.Unpickler(inp).load()  # an Unpickler keeps its memo: a fresh one per item

    return dumps, loads


CANDIDATES = {
    "pickle": (lambda o: pickle.dumps(o, 5), pickle.loads),
    "pickler": _cached_pickle(),
    "marshal": (marshal.dumps, marshal.loads),
    "values": (_core.values_dumps, _core.values_loads),
}


def per_call(fn, arg, number):
    return timeit.timeit(lambda: fn(arg), number=number) / number


def measure(repeats: int, number: int) -> dict:
    res: dict = {}
    for oname, obj in OBJECTS.items():
        row = res[oname] = {}
        payloads = {c: enc(obj) for c, (enc, _dec) in CANDIDATES.items()}
        for c, p in payloads.items():
            back = CANDIDATES[c][1](p)
            assert back == obj, (c, oname)
        times = {c: ([], []) for c in CANDIDATES}
        for _ in range(repeats):
            for c, (enc, dec) in CANDIDATES.items():  # interleaved
                times[c][0].append(per_call(enc, obj, number))
                times[c][1].append(per_call(dec, payloads[c], number))
        for c, (e, d) in times.items():
            row[c] = {"encode_ns": statistics.median(e) * 1e9, "decode_ns": statistics.median(d) * 1e9,
                      "bytes": len(payloads[c])}
    return res


def report(res: dict, out) -> None:
    print(f"ns per item (median of interleaved repeats), payload bytes; load average {os.getloadavg()[0]:.2f}",
          file=out)
    names = list(CANDIDATES)
    print(f"  {'object':<24}" + "".join(f"{c:>22}" for c in names), file=out)
    for oname, row in res.items():
        cells = "".join(f"{row[c]['encode_ns']:7.0f} +{row[c]['decode_ns']:6.0f} {row[c]['bytes']:5d}B"
                        for c in names)
        print(f"  {oname:<24}{cells}", file=out)
    base = res["small dict"]["pickle"]
    for c in names:
        r = res["small dict"][c]
        print(f"  small dict, encode + decode, {c}: {(r['encode_ns'] + r['decode_ns']):.0f} ns, "
              f"{(base['encode_ns'] + base['decode_ns']) / (r['encode_ns'] + r['decode_ns']):.2f}x pickle", file=out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--number", type=int, default=20000, help="calls per timing")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    res = measure(args.repeats, args.number)
    report(res, sys.stdout)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
