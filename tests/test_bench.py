"""The benchmark program runs every row and prints every target (a smoke test:
no timing is asserted here; speed claims come from full runs of stress/bench.py)."""

import json
import os
import subprocess
import sys

import pytest

from conftest import SOURCE_ROOT, bound

STRESS = os.path.join(SOURCE_ROOT, "stress")  # bench.py's C contender builds the engine

#: One fragment of each issue-14 target's label, in the order the table prints them.
ISSUE_14_TARGETS = [
    "Spool 100 B >= 10x mp.Queue", "Spool 100 B >= 2x the inline pure-Python ring",
    "ring wrapped (1 MiB, steady state) >= 8x mp.Queue", "no wrap cliff",
    "shmq.Queue small dict >= 5x mp.Queue", "dict batches of 100 >= 4x faster-fifo",
    "bytes batches of 100 >= 7x mp.Queue", "2->2 100 B >= 4x mp.Queue",
    "ahead of faster-fifo", "ahead of pyzmq", "ahead of posix_ipc.MessageQueue",
    "1 MiB via Spool.reserve", "8 threads x 2 processes share one shmq.Queue",
    "zero syscalls per uncontended put+get", "wake-up p50 <= 1.5x a pipe's",
]
#: The same for issue 42's targets.
ISSUE_42_TARGETS = [
    "1 MiB via Spool.reserve >= 1.0x iceoryx2", "1 MiB via Spool.put >= 1.0x iceoryx2",
    "Arrow 64k x 10 zero-copy read >= 80% of memcpy", "numpy 1 MiB zero-copy read >= 80% of memcpy",
    "full 1 MiB block ring >= 90% of the unbounded spool", "shmq.Queue small dict >= 8x mp.Queue",
    "grown spool, 100 B, >= 90% of a fixed one", "import shmq <= 2x import multiprocessing",
    "wake-up p99 <= 1.5x a pipe's",
]
#: How a contender that did not run explains itself in its row.
REASONS = ("not installed", "n/a", "failed: ")


@pytest.fixture(scope="module")
def bench_module():
    sys.path.insert(0, STRESS)
    try:
        import bench

        yield bench
    finally:
        sys.path.remove(STRESS)


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    proc = subprocess.run([sys.executable, os.path.join(STRESS, "bench.py"), "--smoke", "--out", str(out)],
                          capture_output=True, text=True, timeout=bound(600))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout, json.loads((out / "results.json").read_text()), out


def test_every_scenario_has_every_contender_measured_or_explained(smoke_run, bench_module):
    stdout, data, _out = smoke_run
    assert list(data["throughput"]) == list(bench_module.SCENARIOS)
    for scen, sc in bench_module.SCENARIOS.items():
        row = data["throughput"][scen]
        assert f"\n{scen}\n" in stdout
        assert list(row) == [c.name for c in sc.contenders], scen
        for name, r in row.items():
            if "items_per_s" in r:
                assert r["items_per_s"] > 0 and len(r["runs_s"]) == data["repeats"]
            else:
                assert r["status"].startswith(REASONS), (scen, name, r)
                assert r["status"] in stdout


def test_shmq_and_the_stdlib_always_run(smoke_run):
    """Only optional peers, the future reserve API and the threads row may be missing."""
    _stdout, data, _out = smoke_run
    for scen, row in data["throughput"].items():
        for name, r in row.items():
            if name in ("spool", "spool-batch", "spool-wrapped", "spool-growable", "spool-grown", "shmq.Queue",
                        "shmq.Queue-batch", "mp.Queue"):
                assert "items_per_s" in r, (scen, name, r)
    reserve = data["throughput"]["1->1 1 MiB reserve"]["spool-reserve"]
    assert ("items_per_s" in reserve) == data["machine"]["reserve_api"]
    if not data["machine"]["reserve_api"]:
        assert reserve["status"] == "n/a (no reserve API)"


def test_ratios_pair_each_round_of_the_interleaved_runs(bench_module):
    """A ratio is the median of the rounds' ratios: the phases of a shared machine
    that slow every contender of some rounds do not enter it, as they would enter
    the ratio of the medians (here 6x, where each round says 2x but one)."""
    from bench_targets import ratio, speed_ratio

    def entry(runs):
        return {"items_per_s": 100 / sorted(runs)[len(runs) // 2], "runs_s": runs, "items": 100}

    fast, slow = entry([1.0, 1.0, 1.0, 3.0, 3.0]), entry([2.0, 2.0, 6.0, 6.0, 6.0])
    assert speed_ratio(fast, slow) == 2.0
    assert fast["items_per_s"] / slow["items_per_s"] == 6.0
    assert ratio({"row": {"a": fast, "b": slow}}, "row", "a", "b") == 2.0
    assert ratio({"row": {"a": fast, "b": {"status": "not installed"}}}, "row", "a", "b") is None
    # no run per round (an older results.json, or a contender short of runs): the rates' ratio
    assert speed_ratio({"items_per_s": 6.0}, {"items_per_s": 2.0}) == 3.0
    assert speed_ratio(fast, entry([2.0, 2.0, 6.0, 6.0])) == 6.0


def test_targets_table_lists_every_issue_14_target(smoke_run):
    stdout, data, _out = smoke_run
    table = stdout[stdout.index("targets of issue 14"):]
    labels = [t["target"] for t in data["targets"] if t["issue"] == 14]
    assert len(labels) == len(ISSUE_14_TARGETS)
    for fragment, label in zip(ISSUE_14_TARGETS, labels):
        assert fragment in label
        line = next(line for line in table.splitlines() if label in line)
        assert line.lstrip().startswith(("[         met]", "[     NOT MET]", "[not measured]")), line
    table = stdout[stdout.index("targets of issue 42"):stdout.index("targets of issue 14")]
    labels = [t["target"] for t in data["targets"] if t["issue"] == 42]
    assert len(labels) == len(ISSUE_42_TARGETS)
    for fragment, label in zip(ISSUE_42_TARGETS, labels):
        assert fragment in label and label in table
    assert data["import"]["contenders"]["shmq"]["median_ms"] > 0 and not data["import"]["contenders"]["shmq"][
        "lazy_loaded"]
    # the growable queues' target (group 15): growth measured against the fixed spool in the same rows
    grow, grown = [t for t in data["targets"] if t["issue"] == 15]
    assert "growable spool" in grow["target"] and grow["value"] > 0 and grow["target"] in stdout
    assert "grown spool" in grown["target"] and grown["value"] > 0 and grown["target"] in stdout
    # the extras ran, so their targets have figures
    by_label = {t["target"]: t for t in data["targets"]}
    assert by_label["wake-up p50 <= 1.5x a pipe's"]["value"] > 0


def test_machine_info_names_the_peers_and_limits(smoke_run):
    _stdout, data, _out = smoke_run
    m = data["machine"]
    for key in ("pyzmq", "posix_ipc", "iceoryx2", "mqueue_limits", "reserve_api", "cpu", "python"):
        assert key in m, key
    # the load average at the start and at the end: the docs print it next to the figures
    assert len(m["load_avg"]) == 2 and all(x >= 0 for x in m["load_avg"])


def test_report_renders_every_row_and_target(smoke_run):
    _stdout, data, out = smoke_run
    rep = subprocess.run([sys.executable, os.path.join(STRESS, "report.py"), str(out / "results.json")],
                         capture_output=True, text=True, timeout=bound(60))
    assert rep.returncode == 0, rep.stderr[-3000:]
    for scen, row in data["throughput"].items():
        for name in row:
            assert f"| {scen} | {name} |" in rep.stdout
    for t in data["targets"]:
        assert t["target"] in rep.stdout
    # the docs name the target groups, not issue numbers, and print the load, not the date
    assert "| targets | target |" in rep.stdout and "| speed |" in rep.stdout and "| ring core |" in rep.stdout
    assert "load average" in rep.stdout and data["machine"]["date"] not in rep.stdout


def test_bench_dispatch_runs_and_reports(tmp_path):
    """stress/bench_dispatch.py (a smoke run: tiny, one repeat; no timing asserted)."""
    out = tmp_path / "d.json"
    proc = subprocess.run([sys.executable, os.path.join(STRESS, "bench_dispatch.py"), "--messages",
                           "50", "--repeats", "1", "--json", str(out)],
                          capture_output=True, text=True, timeout=bound(300))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ratio publish/ingress" in proc.stdout and "CPU us/msg" in proc.stdout
    data = json.loads(out.read_text())
    assert set(data["median"]) == {"publish", "ingress"}
    assert all(v > 0 for v in data["median"].values())


def test_bench_service_runs_every_row_against_its_peers(tmp_path):
    """stress/bench_service.py (a smoke run: tiny, one repeat; no timing asserted):
    every measurement and peer runs and is summarized with its target (the concurrency
    sweep's with its quick sizes)."""
    pytest.importorskip("zmq")
    pytest.importorskip("pyarrow")
    out = tmp_path / "s.json"
    proc = subprocess.run([sys.executable, os.path.join(STRESS, "bench_service.py"), "--quick",
                           "--calls", "50", "--pipe-calls", "128", "--arrow-calls", "2",
                           "--json", str(out)], capture_output=True, text=True, timeout=bound(300))
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    conc = ["64 threads"] + [f"async {n}" for n in (100, 1000, 3000)]  # --quick's sweep
    assert set(data["medians"]) == {
        f"small/{k}/{q}" for k in ("shmq", "socket", "pyzmq", "mp.connection") for q in ("p50", "p99")
    } | {"pipelined/shmq/calls/s", "pipelined/socket/calls/s", "arrow/shmq/calls/s",
         "arrow/shmq copy=False/calls/s", "arrow/socket+arrow-ipc/calls/s"} | {
        f"concurrency/{k}/{q}" for k in conc for q in ("calls/s", "rss MiB", "cpu us/call")
    } | {f"concurrency/{k}/wakes/reply" for k in conc[1:]}
    assert all(v > 0 for k, v in data["medians"].items() if not k.endswith("wakes/reply"))
    text = "\n".join(data["summary"])
    assert "target >= 3x" in text and "target >= 1.5x" in text and "Service(copy=False)" in text
    assert "target >= 0.8x" in text and "target >= 1x" in text and "every reply matched" in text


def test_bench_create_runs_and_holders_remove_their_orphans(tmp_path):
    """stress/bench_create.py --quick (one round; no timing asserted): every host state
    and every way of checking a candidate is measured, the resource tracker says
    nothing, and each holder removed its orphan as it exited (exit status 0)."""
    out = tmp_path / "c.json"
    proc = subprocess.run([sys.executable, "-W", "error", os.path.join(STRESS, "bench_create.py"),
                           "--quick", "--others", "20", "--json", str(out)],
                          capture_output=True, text=True, timeout=bound(300))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stderr == ""
    data = json.loads(out.read_text())
    assert set(data["median_ms"]) == {"clean", "held", "busy"} and all(
        v > 0 for v in data["median_ms"].values())
    assert {n for by in data["probe_median_us"].values() for n in by} == {
        "handle lock", "flock", "/proc scan"}
    assert data["orphans_not_removed_by_their_holders"] == []
    assert "target: busy within 1.5x of clean" in proc.stdout


def test_bench_pool_runs_every_target_against_its_peers(tmp_path):
    """stress/bench_pool.py --quick (tiny, one repeat; no timing asserted): every
    target's scenario runs shmq and its stdlib peer and prints the ratio."""
    pytest.importorskip("numpy")
    out = tmp_path / "p.json"
    proc = subprocess.run([sys.executable, os.path.join(STRESS, "bench_pool.py"), "--quick",
                           "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert [t["scenario"] for t in data["targets"]] == ["submit", "map", "numpy"]
    for scen, peer in (("submit", "ProcessPoolExecutor"), ("map", "multiprocessing.Pool"),
                       ("numpy", "ProcessPoolExecutor")):
        assert data["medians"][f"{scen}/shmq"] > 0 and data["medians"][f"{scen}/{peer}"] > 0
    assert all(t["ratio"] > 0 for t in data["targets"])
    assert "load average" in proc.stdout and "target >= 10x" in proc.stdout
