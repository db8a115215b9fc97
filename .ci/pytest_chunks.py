"""Run a pytest selection as N consecutive pytest runs, each with fresh xdist workers.

    python3 .ci/pytest_chunks.py --chunks 4 [--workers 2] -- [selection args: -m EXPR, paths]

Used by ``.ci/aarch64 --full``: Debian 12's qemu-user 7.2 keeps about 280 KB of
host memory for every emulated thread that has started and ended, so one xdist
worker that runs the whole suite (tens of thousands of threads: pools, services,
dispatchers) grows past 14 GB and the OOM killer takes it.  Each chunk's workers
exit with it and give that memory back.

The selection is collected once (``--collect-only``), cut into ``--chunks``
consecutive slices of node ids (a file's tests stay together but at a slice's
edge), and each slice runs as ``pytest -q -rfEs -p no:cacheprovider -n WORKERS
[-m EXPR] @slice``.  Prints each run's summary and the totals; exits with the
worst exit code (0 only if every chunk passed).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

COUNT = re.compile(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed|deselected)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--workers", default="2")
    ap.add_argument("selection", nargs=argparse.REMAINDER, help="after --: -m EXPR and paths")
    a = ap.parse_args(argv)
    sel = [s for s in a.selection if s != "--"]
    marker = []
    if "-m" in sel:
        i = sel.index("-m")
        marker = sel[i:i + 2]
    found = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *sel],
                           capture_output=True, text=True)
    ids = [line for line in found.stdout.splitlines() if "::" in line]
    if found.returncode not in (0, 5) or not ids:
        sys.stdout.write(found.stdout[-3000:] + found.stderr[-3000:])
        print(f"pytest_chunks: collection failed (exit {found.returncode}, {len(ids)} tests)")
        return found.returncode or 5
    n = max(1, min(a.chunks, len(ids)))
    per = -(-len(ids) // n)
    totals: dict[str, int] = {}
    worst, t0 = 0, time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(n):
            part = ids[k * per:(k + 1) * per]
            if not part:
                continue
            path = os.path.join(tmp, f"chunk{k}")
            with open(path, "w") as f:
                f.write("\n".join(part) + "\n")
            print(f"\n== chunk {k + 1}/{n}: {len(part)} tests, {part[0].split('::')[0]} .. "
                  f"{part[-1].split('::')[0]}", flush=True)
            cmd = [sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider", "-n", a.workers,
                   *marker, f"@{path}"]
            run = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
            last = ""
            assert run.stdout is not None
            for line in run.stdout:
                sys.stdout.write(line)
                sys.stdout.flush()
                if line.strip():
                    last = line
            rc = run.wait()
            for num, what in COUNT.findall(last):
                what = "errors" if what.startswith("error") else what
                totals[what] = totals.get(what, 0) + int(num)
            worst = max(worst, rc)
    summary = ", ".join(f"{v} {k}" for k, v in totals.items())
    print(f"\n== {n} chunks, {len(ids)} tests collected: {summary} in {time.monotonic() - t0:.0f} s "
          f"(exit {worst})")
    return worst


if __name__ == "__main__":
    sys.exit(main())
