"""``import shmq`` stays light: what loads with it, what loads on first use.

Every spawned worker pays for ``import shmq``; stress/import_time.py times it
against ``import multiprocessing`` (the figures are in docs/benchmarks.md).
These tests check, in fresh interpreters, that the modules it leaves for first
use are not loaded by the import itself, and that each still loads when used.
"""

import subprocess
import sys

import pytest

import shmq

from conftest import bound

#: Modules ``import shmq`` must leave for first use.
NOT_AT_IMPORT = ("asyncio", "numpy", "psutil", "multiprocessing", "inotify_simple", "logging",
                 "dataclasses", "typing", "hashlib", "shmq.workqueue", "shmq.stats", "shmq.rpc",
                 "shmq.dispatch", "shmq.spark", "shmq.columnar")


def _child(code):
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=bound(120))
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


#: What a child prints: the modules of ``names`` loaded since its ``before`` (what the
#: interpreter's start loaded, a site .pth included: .ci/aarch64's imports psutil).
_LOADED = "print(sorted(m for m in {names!r} if m in sys.modules and m not in before))"


def test_import_shmq_loads_neither_asyncio_nor_numpy():
    out = _child("import sys; before = set(sys.modules); import shmq\n" + _LOADED.format(names=NOT_AT_IMPORT))
    assert out == "[]"


def test_lazy_names_load_on_first_use():
    out = _child("import sys, shmq, shmq.workqueue as w, shmq.stats as s\n"
                 "assert shmq.WorkQueue is w.WorkQueue and shmq.DeadLetter is w.DeadLetter\n"
                 "assert shmq.SpoolStats is s.SpoolStats and shmq.ReaderStats is s.ReaderStats\n"
                 "assert {'WorkQueue', 'SpoolStats', 'Dispatcher', 'Service'} <= set(dir(shmq))\n"
                 "print('asyncio' in sys.modules)")
    assert out == "False"  # the work queue and the statistics need no asyncio either


def test_unknown_attribute_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        shmq.Nope  # noqa: B018


def test_spool_use_loads_nothing_lazy(tmp_path):
    # A process that creates, writes, reads and takes statistics of a spool
    # (blocking waits included) never needs asyncio, numpy or psutil.
    code = (f"import sys; before = set(sys.modules); import shmq\n"
            f"sp = shmq.Spool.create({str(tmp_path / 's')!r}, capacity='1MiB')\n"
            f"r = sp.reader('r'); sp.put(b'x'); assert r.get(timeout=5).data == b'x'\n"
            f"assert sp.stats().frames == 1\n"
            f"r.close(); sp.close(); shmq.Spool.destroy(sp.path)\n"
            + _LOADED.format(names=("asyncio", "numpy", "psutil", "inotify_simple")))
    assert _child(code) == "[]"


def test_asyncio_waits_load_asyncio_when_used(tmp_path):
    code = (f"import asyncio, shmq\n"
            f"sp = shmq.Spool.create({str(tmp_path / 's')!r}, capacity='1MiB')\n"
            f"r = sp.reader()\n"
            f"async def main():\n"
            f"    asyncio.get_running_loop().call_later(0.05, sp.put, b'late')\n"
            f"    return await r.get_async(timeout=10)\n"
            f"print(asyncio.run(main()).data)\n"
            f"sp.close(); shmq.Spool.destroy(sp.path)")
    assert _child(code) == "b'late'"


def test_shmq_spark_still_imports_as_documented():
    pytest.importorskip("pyspark", reason="pyspark is not installed (it comes with the test extra)")
    assert _child("import shmq.spark; print(callable(shmq.spark.register))") == "True"
