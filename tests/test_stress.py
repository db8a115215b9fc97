"""The fault-injection and fuzzing programs in stress/, in their quick modes.

They fail on any violation, and on a run that killed or checked nothing.
"""

import json
import os
import subprocess
import sys

import pytest

from conftest import bound

STRESS = os.path.join(os.path.dirname(__file__), "..", "stress")


@pytest.mark.parametrize("scenario", ["fanout", "queue", "lock", "restart", "workqueue", "soak",
                                      "segments"])
def test_kill9_quick(scenario, tmp_path):
    out = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, os.path.join(STRESS, "kill9.py"), "--quick", "--seed", "3",
                           "--scenario", scenario, "--json", str(out)],
                          capture_output=True, text=True, timeout=bound(300))
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    res = json.loads(out.read_text())[scenario]
    assert res["violations"] == 0 and res["frames_checked"] > 0
    if scenario != "soak":
        assert res["kills"] > 0
    print(proc.stdout)


def test_fuzz_quick(tmp_path):
    out = tmp_path / "fuzz.json"
    proc = subprocess.run([sys.executable, os.path.join(STRESS, "fuzz.py"), "--quick", "--seed", "2",
                           "--json", str(out)], capture_output=True, text=True, timeout=bound(300))
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert rep["outcomes"]["violation"] == 0
    assert rep["outcomes"]["ok"] > 0 and rep["outcomes"]["shmq_error"] > 0  # both paths exercised


def test_soak_quick(tmp_path):
    """stress/soak.py --quick: the mixed load with SIGKILLs runs, samples, cleans up."""
    proc = subprocess.run([sys.executable, os.path.join(STRESS, "soak.py"), "--quick", "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=bound(240))
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    rep = json.loads((tmp_path / "soak.json").read_text())
    assert rep["failures"] == [] and rep["leftover_files"] == []
    assert rep["kills"] > 0 and len(rep["samples"]) >= 5
    work = rep["work"]
    assert work["spool_frames"] > 0 and work["wq_acked"] > 0 and work["dispatcher_acked"] > 0
    s = rep["samples"][-1]
    assert s["processes"] > 10 and s["rss"] > 0 and s["fds"] > 0 and s["sem_files"] > 0
    print(proc.stdout)


def test_hostile_quick(tmp_path):
    """stress/hostile.py --quick: a co-writer flips control, slot and frame-header words
    while writers, readers, stats and verify run: no crash, no hang, only shmq errors."""
    out = tmp_path / "hostile.json"
    proc = subprocess.run([sys.executable, os.path.join(STRESS, "hostile.py"), "--quick", "--json",
                           str(out)], capture_output=True, text=True, timeout=bound(240))
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert rep["crashes"] == [] and rep["hangs"] == [] and rep["non_shmq_exceptions"] == 0
    assert all(rep["flips"][k] > 0 for k in ("control", "slot", "header"))
    assert all(v["ops"] > 0 for v in rep["victims"].values()) and len(rep["victims"]) == 8


def _spin(flag, w):
    os.write(w, b"x")
    while not flag.is_set():
        pass
    os._exit(0)


def test_stop_flag_survives_pollers_killed_mid_poll():
    """The harnesses' stop flag stays usable after SIGKILLs land inside ``is_set()``:
    a multiprocessing.Event's condition lock is left taken by such a kill, and the
    harness's ``set()`` then blocked forever (a CI hang of soak.py --quick)."""
    import multiprocessing as mp
    import select
    import signal
    import threading

    sys.path.insert(0, STRESS)
    try:
        from stopflag import StopFlag
    finally:
        sys.path.remove(STRESS)
    ctx = mp.get_context("fork")
    flag = StopFlag(ctx)
    r, w = os.pipe()
    try:
        for _ in range(20):  # an Event's lock is left taken after the first kill or two
            p = ctx.Process(target=_spin, args=(flag, w))
            p.start()
            assert select.select([r], [], [], 30)[0], "the poller did not start"
            os.read(r, 1)
            os.kill(p.pid, signal.SIGKILL)
            p.join(bound(30))
        last = ctx.Process(target=_spin, args=(flag, w))
        last.start()
        assert select.select([r], [], [], 30)[0]
        setter = threading.Thread(target=flag.set, daemon=True)  # an Event's set() would block
        setter.start()
        setter.join(bound(30))
        assert not setter.is_alive(), "set() blocked on a lock a killed poller held"
        last.join(bound(30))
        assert last.exitcode == 0, "a poller did not see the flag set"
    finally:
        os.close(r)
        os.close(w)
