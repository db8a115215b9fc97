"""The benchmark program runs (a smoke test: no timing is asserted here)."""

import json
import os
import subprocess
import sys

STRESS = os.path.join(os.path.dirname(__file__), "..", "stress")


def test_bench_quick_subset_runs_and_reports(tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(STRESS, "bench.py"), "--quick", "--repeats", "1",
                           "--only", "1->1 4 KiB", "--skip-extras", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "1->1 4 KiB" in proc.stdout and "targets" in proc.stdout
    data = json.loads((tmp_path / "results.json").read_text())
    row = data["throughput"]["1->1 4 KiB"]
    assert row["spool"]["items_per_s"] > 0 and row["mp.Queue"]["items_per_s"] > 0
    rep = subprocess.run([sys.executable, os.path.join(STRESS, "report.py"), str(tmp_path / "results.json")],
                         capture_output=True, text=True, timeout=60)
    assert rep.returncode == 0 and "| 1->1 4 KiB | spool |" in rep.stdout


def test_bench_dispatch_runs_and_reports(tmp_path):
    """stress/bench_dispatch.py (a smoke run: tiny, one repeat; no timing asserted)."""
    out = tmp_path / "d.json"
    proc = subprocess.run([sys.executable, os.path.join(STRESS, "bench_dispatch.py"), "--messages",
                           "50", "--repeats", "1", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ratio publish/ingress" in proc.stdout and "CPU us/msg" in proc.stdout
    data = json.loads(out.read_text())
    assert set(data["median"]) == {"publish", "ingress"}
    assert all(v > 0 for v in data["median"].values())
