#!/usr/bin/env python3
"""Render stress/bench.py's results.json as Markdown, and update the docs with it.

    python stress/report.py bench-out/results.json            # print the tables
    python stress/report.py bench-out/results.json --update   # rewrite the marked
        sections of docs/benchmarks.md, docs/queue.md and README.md

Sections are delimited by ``<!-- bench:NAME -->`` ... ``<!-- /bench:NAME -->``
markers, so the numbers in the docs always come from one real run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

from bench_targets import measured, speed_ratio

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: Ratio columns of the throughput table, each shown only if the run has that peer.
PEERS = ("mp.Queue", "faster-fifo", "ring", "pyzmq", "posix-mq", "iceoryx2")


def fmt_rate(r):
    if not measured(r):
        return r.get("status", "not run") if r else "not run"
    v = r["items_per_s"]
    s = f"{v / 1e6:.3f} M/s" if v >= 1e5 else f"{v / 1e3:.1f} k/s"
    if r["gb_per_s"]:
        s += f" ({r['gb_per_s']:.2f} GB/s)"
    return s


def _peer_entry(row, peer, c):
    """The peer's entry to compare contender ``c`` with: its batch variant for a batch contender."""
    cand = [p for p in row if p.startswith(peer) and measured(row[p])]
    if len(cand) > 1:
        cand = [p for p in cand if ("batch" in p) == ("batch" in c)] or cand
    return cand[0] if cand else None


def throughput_table(results, scenarios=None, contenders=None):
    peers = [p for p in PEERS if any(_peer_entry(row, p, "") or _peer_entry(row, p, "batch")
                                     for row in results.values())]
    lines = ["| scenario | contender | median | " + " | ".join(f"vs {p}" for p in peers) + " |",
             "|---|---|---|" + "---|" * len(peers)]
    for scen, row in results.items():
        if scenarios and scen not in scenarios:
            continue
        for c, r in row.items():
            if contenders and not any(c.startswith(x) for x in contenders):
                continue
            cells = []
            for peer in peers:
                other = _peer_entry(row, peer, c)
                if not measured(r) or other is None or other == c or c.startswith(peer):
                    cells.append("")
                else:
                    cells.append(f"{speed_ratio(r, row[other]):.2f}x")
            lines.append(f"| {scen} | {c} | {fmt_rate(r)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


#: What each target group (the JSON's ``issue`` key) is called in the docs.
GROUPS = {42: "speed", 14: "ring core", 15: "growable queues", 4: "first"}


def targets_table(targets):
    lines = ["| targets | target | this run | status |", "|---|---|---|---|"]
    for t in targets:
        status = {True: "met", False: "**not met**", None: "not measured"}[t["met"]]
        group = GROUPS.get(t.get("issue"), t.get("issue", ""))
        lines.append(f"| {group} | {t['target']} | {t['shown']} | {status} |")
    return "\n".join(lines)


def latency_table(lat):
    if not lat:
        return "(not measured)"
    lines = ["| channel | p50 | p90 | p99 |", "|---|---|---|---|"]
    for k, r in lat.items():
        lines.append(f"| {k} | {r['p50_us']:.1f} us | {r['p90_us']:.1f} us | {r['p99_us']:.1f} us |")
    return "\n".join(lines)


def machine_line(data):
    m = data["machine"]
    mode = "quick" if data.get("quick") else "full"
    mode = data.get("mode", mode)
    peers = f"faster-fifo {m.get('faster_fifo') or 'not installed'}"
    if "pyzmq" in m:
        peers += (f", pyzmq {m['pyzmq']}, posix_ipc {m['posix_ipc']} (fs.mqueue msg_max "
                  f"{m['mqueue_limits'].get('msg_max')}, msgsize_max {m['mqueue_limits'].get('msgsize_max')}), "
                  f"iceoryx2 {m['iceoryx2']}, Spool.reserve {'present' if m.get('reserve_api') else 'absent'}")
    load = ""
    if "load_avg" in m:  # (runs before it was recorded lack it)
        load = f", load average {m['load_avg'][0]:.1f} at the start, {m['load_avg'][-1]:.1f} at the end"
    return (f"{m['cpu']} x{m['cpus']}, {m['platform']}, Python {m['python']}, shmq {m['shmq']}, "
            f"{peers}; {mode} run, median of {data['repeats']} interleaved runs{load}")


def readme_line(data):
    row = data["throughput"].get("1->1 100 B", {})
    if not measured(row.get("spool")):
        return "(no run)"
    sp = row["spool"]["items_per_s"]
    parts = [f"`Spool.put`/`get`: **{sp / 1e6:.2f} M frames/s**"]
    for peer in ("mp.Queue", "faster-fifo", "ring", "pyzmq", "posix-mq"):
        if measured(row.get(peer)):
            v = row[peer]["items_per_s"]
            parts.append(f"{peer}: {v / 1e6:.2f} M/s (shmq {speed_ratio(row['spool'], row[peer]):.2f}x)")
    return "; ".join(parts) + f". Machine: {machine_line(data)}."


def sections(data):
    t = data["throughput"]
    misc = data.get("misc") or {}
    extra = []
    if data.get("syscalls"):
        extra.append(f"- syscalls per put+get on the uncontended fast path: "
                     f"{data['syscalls']['per_put_get']:.4f} (strace -c)")
    if misc:
        extra.append(f"- CPU of an idle blocked reader: {misc['idle_reader_cpu_pct']:.2f} %")
        extra.append(f"- reader RSS growth after opening a 1 GiB spool and reading 1 MB: "
                     f"{misc['reader_rss_growth_mb_1gib_spool']:.1f} MB")
        extra.append(f"- per-frame overhead (header + 8-byte alignment) by payload size: "
                     f"{misc['frame_overhead_bytes']}")
    imp = data.get("import")
    if imp:
        c = imp["contenders"]
        extra.append(f"- `import shmq` in a fresh interpreter: {c['shmq']['median_ms']:.1f} ms against "
                     f"{c['multiprocessing']['median_ms']:.1f} ms for `import multiprocessing` "
                     f"({imp['ratio']:.2f}x; median of {imp['runs']} each, `stress/import_time.py`)")
    return {
        "machine": machine_line(data),
        "throughput": throughput_table(t),
        "targets": targets_table(data.get("targets", [])),
        "latency": latency_table(data.get("latency")),
        "extras": "\n".join(extra) or "(not measured)",
        "readme": readme_line(data),
        "queue": throughput_table(t, scenarios=[k for k, row in t.items()
                                                if any(c.startswith("shmq.Queue") for c in row)],
                                  contenders=("shmq.Queue", "mp.Queue", "faster-fifo")),
        "growable": throughput_table(t, scenarios=[k for k, row in t.items() if "spool-growable" in row],
                                     contenders=("spool", "spool-growable", "spool-grown")).replace(
            "| spool |", "| spool (fixed 64 MiB) |"),
        "columnar": throughput_table(t, scenarios=("records 100 B x1000", "1->1 1 MiB numpy array",
                                                   "arrow 64k rows x 10 cols")),
    }


def update(path, secs):
    with open(path) as f:
        text = f.read()
    for name, body in secs.items():
        # (an empty section, the two markers on consecutive lines, matches too)
        text = re.sub(rf"(<!-- bench:{name} -->\n)(?:.*?\n)??(<!-- /bench:{name} -->)",
                      lambda m: m.group(1) + body + "\n" + m.group(2), text, flags=re.S)
    with open(path, "w") as f:
        f.write(text)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results")
    ap.add_argument("--update", action="store_true", help="rewrite the marked doc sections")
    args = ap.parse_args(argv)
    with open(args.results) as f:
        data = json.load(f)
    secs = sections(data)
    if args.update:
        for doc in ("docs/benchmarks.md", "docs/queue.md", "docs/columnar.md", "README.md"):
            update(os.path.join(ROOT, doc), secs)
    else:
        for name, body in secs.items():
            print(f"## {name}\n\n{body}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
