"""Every example script runs to completion (smoke test)."""

import glob
import os
import subprocess
import sys

import pytest
from conftest import bound, pyspark_unsupported

EXAMPLES = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "examples", "*.py")))
OPTIONAL = {"spark_pipeline.py": "pyspark", "spark_sidecar.py": "pyspark"}


VARIANTS = [(s, []) for s in EXAMPLES] + [(s, ["--columnar"]) for s in EXAMPLES
                                           if os.path.basename(s) == "spark_pipeline.py"]


@pytest.mark.parametrize("script,args", VARIANTS,
                         ids=[os.path.basename(s) + "".join(a) for s, a in VARIANTS])
def test_example_runs(script, args):
    needs = OPTIONAL.get(os.path.basename(script))
    if needs == "pyspark" and pyspark_unsupported():
        pytest.skip(pyspark_unsupported())
    if needs:
        pytest.importorskip(needs)
    proc = subprocess.run([sys.executable, script, *args], capture_output=True, text=True,
                          timeout=bound(240))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.stdout.strip(), "an example should show what it did"


def test_demo_runs_and_cleans_up():
    def demo_dirs():  # other xdist workers create their own files concurrently
        return {n for n in os.listdir("/dev/shm") if n.startswith("shmq-demo-")}

    before = demo_dirs()
    proc = subprocess.run([sys.executable, "-m", "shmq", "demo", "--seconds", "1.5"],
                          capture_output=True, text=True, timeout=bound(120))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "exactly every frame" in proc.stdout and "spool removed" in proc.stdout
    assert demo_dirs() - before == set()
