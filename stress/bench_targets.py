"""The targets stress/bench.py checks, computed from one run's own figures.

Four groups, in this order: speed where users still wait (group 42), the
compiled ring core's (14), the growable queues' (15) and the first targets,
still tracked (4).  Each row: ``{"issue", "target", "value", "goal", "met",
"shown"}``, where ``issue`` numbers the group (the key the printed titles and
stress/report.py group by), with ``met`` True, False, or None when the run could not measure it (a peer
not installed, an API not there yet); ``shown`` says what was measured or why not.
"""

from __future__ import annotations

import statistics

#: 1 MiB frames through Spool.put/get with a pure-Python ring (GB/s on the
#: benchmark machine): the baseline of the reservation target when iceoryx2
#: cannot run here.
TODAY_1MIB_GBPS = 6.7
SHMQ_PREFIXES = ("spool", "shmq.")


def measured(r):
    return bool(r) and "items_per_s" in r


def status(row, name):
    r = row.get(name)
    if r is None:
        return "not in this run"
    return r.get("status", "measured")


def rate(results, scen, name):
    r = results.get(scen, {}).get(name)
    return r["items_per_s"] if measured(r) else None


def speed_ratio(a, b):
    """How many times as fast contender ``a`` ran as ``b``, two measured entries of one row.

    The median of the per-round ratios: bench.py interleaves the repeats
    (one run of each contender per round), so a round's runs meet the same
    phase of a shared machine, and a phase that slows some rounds cancels
    out of their ratio.  The ratio of the two medians instead compares runs
    of different rounds, which swings with the phases the medians happened
    to land in.  Entries without a run per round (a results.json from before
    ``runs_s`` was recorded): the ratio of their rates.
    """
    ta, tb = a.get("runs_s"), b.get("runs_s")
    if ta and tb and len(ta) == len(tb) and a.get("items") == b.get("items"):
        return statistics.median(y / x for x, y in zip(ta, tb))
    return a["items_per_s"] / b["items_per_s"]


def ratio(results, scen, a, b):
    row = results.get(scen, {})
    x, y = row.get(a), row.get(b)
    return speed_ratio(x, y) if measured(x) and measured(y) else None


def why_not(results, scen, *names):
    """Why a ratio between ``names`` in ``scen`` is missing (the first unmeasured one)."""
    row = results.get(scen)
    if row is None:
        return f"{scen!r} not run"
    for n in names:
        if not measured(row.get(n)):
            return f"{n}: {status(row, n)}"
    return "n/a"


def _rate_of(r):
    return r["items_per_s"]


def worst_against(results, peer_prefix):
    """Across every row where a contender named ``peer_prefix*`` ran: the lowest
    ratio of the row's best shmq contender to the row's best such peer."""
    worst = None
    for scen, row in results.items():
        peers = [r for c, r in row.items() if c.startswith(peer_prefix) and measured(r)]
        ours = [r for c, r in row.items() if c.startswith(SHMQ_PREFIXES) and measured(r)
                and ("wrapped" in c or "wrapped" not in scen)  # a wrapped row races the wrapped spool
                and c != "spool-grown"]  # it had an untimed pass: not a peer's equal
        if peers and ours:
            v = speed_ratio(max(ours, key=_rate_of), max(peers, key=_rate_of))
            if worst is None or v < worst[0]:
                worst = (v, scen)
    return worst


def targets(results, lat, sys_, misc, imp=None):
    rows = []

    def add(issue, label, value, goal, fmt="{:.2f}x", why="not measured", at_most=False, extra=""):
        met = None if value is None else (value <= goal if at_most else value >= goal)
        if value is not None and met is False and fmt.format(value) == fmt.format(goal):
            fmt = "{:.1%}" if fmt.endswith("%}") else "{:.3f}x"  # 39.8% must not print as "40%"
        shown = why if value is None else fmt.format(value) + extra
        rows.append({"issue": issue, "target": label, "value": value, "goal": goal, "met": met, "shown": shown})

    def add_ratio(label, scen, a, b, goal):
        add(14, label, ratio(results, scen, a, b), goal, why=why_not(results, scen, a, b))

    def add_ratio42(label, scen, a, b, goal, fmt="{:.2f}x"):
        x, y = rate(results, scen, a), rate(results, scen, b)
        extra = f" (ratio of the medians: {fmt.format(x / y)})" if x and y else ""
        add(42, label, ratio(results, scen, a, b), goal, fmt, why=why_not(results, scen, a, b), extra=extra)

    # issue 42: speed where users still wait
    add_ratio42("1 MiB via Spool.reserve >= 1.0x iceoryx2's loaned samples (GB/s)", "1->1 1 MiB reserve",
                "spool-reserve", "iceoryx2", 1.0)
    add_ratio42("1 MiB via Spool.put >= 1.0x iceoryx2's loaned samples (GB/s)", "1->1 1 MiB reserve",
                "spool", "iceoryx2", 1.0)
    add_ratio42("Arrow 64k x 10 zero-copy read >= 80% of memcpy of the same bytes", "arrow 64k rows x 10 cols",
                "spool-arrow-view", "memcpy", 0.8, "{:.0%}")
    add_ratio42("numpy 1 MiB zero-copy read >= 80% of memcpy of the same bytes", "1->1 1 MiB numpy array",
                "spool-array-view", "memcpy", 0.8, "{:.0%}")
    add_ratio42("100 B through a full 1 MiB block ring >= 90% of the unbounded spool",
                "1->1 100 B wrapped 1 MiB", "spool-wrapped", "spool", 0.9, "{:.0%}")
    add_ratio42("shmq.Queue small dict >= 8x mp.Queue", "1->1 small dict", "shmq.Queue", "mp.Queue", 8)
    add_ratio42("grown spool, 100 B, >= 90% of a fixed one", "1->1 100 B", "spool-grown", "spool", 0.9, "{:.0%}")
    if imp:
        c = imp["contenders"]
        add(42, f"import shmq <= 2x import multiprocessing (median of {imp['runs']} fresh interpreters each)",
            imp["ratio"], 2.0, at_most=True,
            extra=f" ({c['shmq']['median_ms']:.1f} vs {c['multiprocessing']['median_ms']:.1f} ms)")
    else:
        add(42, "import shmq <= 2x import multiprocessing", None, 2.0, why="not measured (--skip-extras)")
    if lat:
        add(42, "wake-up p99 <= 1.5x a pipe's", lat["spool"]["p99_us"] / lat["pipe"]["p99_us"], 1.5, at_most=True,
            extra=f" ({lat['spool']['p99_us']:.0f} vs {lat['pipe']['p99_us']:.0f} us)")
    else:
        add(42, "wake-up p99 <= 1.5x a pipe's", None, 1.5, why="not measured (--skip-extras)")

    add_ratio("Spool 100 B >= 10x mp.Queue", "1->1 100 B", "spool", "mp.Queue", 10)
    add_ratio("Spool 100 B >= 2x the inline pure-Python ring", "1->1 100 B", "spool", "ring", 2)
    add_ratio("Spool 100 B, ring wrapped (1 MiB, steady state) >= 8x mp.Queue",
              "1->1 100 B wrapped 1 MiB", "spool-wrapped", "mp.Queue", 8)
    cliff = [(ratio(results, s, "spool-wrapped", "spool"), s) for s in
             ("1->1 100 B wrapped 1 MiB", "1->1 1 KiB wrapped 1 MiB", "1->1 100 B wrapped 64 MiB")]
    cliff = [c for c in cliff if c[0] is not None]
    w = min(cliff) if cliff else None
    add(14, "no wrap cliff: wrapped >= 90% of unwrapped Spool (100 B, 1 KiB; 1 MiB and 64 MiB rings)",
        w and w[0], 0.9, "{:.0%}",
        why=why_not(results, "1->1 100 B wrapped 1 MiB", "spool-wrapped", "spool"),
        extra=w and f" ({w[1]})" or "")
    add_ratio("shmq.Queue small dict >= 5x mp.Queue", "1->1 small dict", "shmq.Queue", "mp.Queue", 5)
    add_ratio("shmq.Queue dict batches of 100 >= 4x faster-fifo batches", "1->1 small dict batch 100",
              "shmq.Queue-batch", "faster-fifo-batch", 4)
    add_ratio("shmq.Queue bytes batches of 100 >= 7x mp.Queue", "1->1 100 B batch 100",
              "shmq.Queue-batch", "mp.Queue", 7)
    add_ratio("shmq.Queue 2->2 100 B >= 4x mp.Queue", "2->2 100 B", "shmq.Queue", "mp.Queue", 4)
    for label, prefix in (("faster-fifo", "faster-fifo"), ("pyzmq PUSH/PULL ipc://", "pyzmq"),
                          ("posix_ipc.MessageQueue", "posix-mq")):
        w = worst_against(results, prefix)
        add(14, f"ahead of {label} in every row it runs in", w and w[0], 1.0,
            why=f"{prefix}: not measured (see its rows)", extra=w and f" (worst: {w[1]})" or "")
    scen = "1->1 1 MiB reserve"
    res_gb = results.get(scen, {}).get("spool-reserve", {}).get("gb_per_s")
    iox = results.get(scen, {}).get("iceoryx2", {})
    if measured(iox):
        add(14, "1 MiB via Spool.reserve >= 50% of iceoryx2's loan GB/s",
            ratio(results, scen, "spool-reserve", "iceoryx2"), 0.5, "{:.0%}", why=why_not(results, scen, "spool-reserve"),
            extra=res_gb and f" ({res_gb:.2f} vs {iox['gb_per_s']:.2f} GB/s)" or "")
    else:
        add(14, f"1 MiB via Spool.reserve >= 2x {TODAY_1MIB_GBPS} GB/s (iceoryx2: {status(results.get(scen, {}), 'iceoryx2')})",
            res_gb and res_gb / TODAY_1MIB_GBPS, 2, why=why_not(results, scen, "spool-reserve"),
            extra=res_gb and f" ({res_gb:.2f} GB/s)" or "")
    scen = "8 threads x 2 processes small dict"
    name = "shmq.Queue 8 threads"
    r = results.get(scen, {}).get(name)
    v = ratio(results, scen, name, "mp.Queue 8 threads")
    failed = r is not None and r.get("status", "").startswith("failed")
    rows.append({"issue": 14, "target": "8 threads x 2 processes share one shmq.Queue: no error, loss or duplicate",
                 "value": v, "goal": None, "met": True if measured(r) else (False if failed else None),
                 "shown": (f"ran: {v:.2f}x mp.Queue" if v else "ran") if measured(r) else status(results.get(scen, {}), name)})
    if sys_:
        add(14, "zero syscalls per uncontended put+get", sys_["per_put_get"], 0.01, "{:.4f}/op", at_most=True)
    else:
        add(14, "zero syscalls per uncontended put+get", None, 0.01, why="not measured (strace missing or --skip-extras)")
    if lat:
        v = lat["spool"]["p50_us"] / lat["pipe"]["p50_us"]
        add(14, "wake-up p50 <= 1.5x a pipe's", v, 1.5, at_most=True,
            extra=f" ({lat['spool']['p50_us']:.0f} vs {lat['pipe']['p50_us']:.0f} us)")
    else:
        add(14, "wake-up p50 <= 1.5x a pipe's", None, 1.5, why="not measured (--skip-extras)")

    # growable queues: growth costs nothing measurable on the steady-state fast path,
    # with growth inside the timed run and once grown (an untimed pass first)
    def add_growth(label, contender):
        got = [(ratio(results, s, contender, "spool"), s) for s in ("1->1 100 B", "1->1 1 MiB")]
        got = [g for g in got if g[0] is not None]
        w = min(got) if got else None
        add(15, label, w and w[0], 0.9, "{:.0%}", why=why_not(results, "1->1 100 B", contender, "spool"),
            extra=w and f" (worst: {w[1]}; " + ", ".join(f"{s}: {v:.0%}" for v, s in got) + ")" or "")

    add_growth("growable spool >= 90% of a fixed one (100 B, 1 MiB; 1 MiB growing to 64 MiB)",
               "spool-growable")
    add_growth("grown spool >= 90% of a fixed one (100 B, 1 MiB; after one untimed pass)", "spool-grown")

    # the first targets, still tracked
    def add4(label, value, goal, fmt="{:.2f}x"):
        add(4, label, value, goal, fmt)

    add4("1 MiB bytes >= 1.5x faster-fifo GB/s", ratio(results, "1->1 1 MiB", "spool", "faster-fifo"), 1.5)
    add4("records 100 B x1000 >= 10 M records/s",
         (rate(results, "records 100 B x1000", "spool-records") or 0) / 1e6 or None, 10, "{:.2f} M/s")
    add4("records >= 40% of the inline numpy ring",
         ratio(results, "records 100 B x1000", "spool-records", "numpy-ring"), 0.4, "{:.0%}")
    add4("records >= 50x faster-fifo put_many/get_many",
         ratio(results, "records 100 B x1000", "spool-records", "faster-fifo-batch"), 50)
    add4("1 MiB numpy copy=False >= 3x faster-fifo",
         ratio(results, "1->1 1 MiB numpy array", "spool-array-view", "faster-fifo"), 3)
    add4("Arrow 64k x 10 >= 50% of memcpy bandwidth",
         ratio(results, "arrow 64k rows x 10 cols", "spool-arrow-view", "memcpy"), 0.5, "{:.0%}")
    if misc:
        add(4, "idle blocked reader CPU < 1%", misc["idle_reader_cpu_pct"], 1, "{:.2f}%", at_most=True)
        add(4, "reader RSS independent of capacity", misc["reader_rss_growth_mb_1gib_spool"], 16,
            "+{:.1f} MB for a 1 GiB spool", at_most=True)
    return rows


def print_targets(rows, out):
    for issue, title in ((42, "targets of issue 42 (speed where users still wait)"),
                         (14, "targets of issue 14 (the ring core in C)"), (15, "targets of issue 15 (growable queues)"),
                         (4, "earlier targets (issue 4)")):
        print(f"\n{title}", file=out)
        for r in rows:
            if r["issue"] == issue:
                mark = {True: "met", False: "NOT MET", None: "not measured"}[r["met"]]
                print(f"  [{mark:>12}] {r['target']}: {r['shown']}", file=out)
