"""shmq._core in an isolated subinterpreter with its own GIL (PEP 684).

The module declares ``Py_MOD_PER_INTERPRETER_GIL_SUPPORTED`` (multi-phase
init, state per module object, heap types; docs/format.md, "The compiled
core").  What is checked, in a child process so that a crash fails the
test instead of killing pytest:

* inside an isolated interpreter (``_interpreters`` on 3.13,
  ``_xxsubinterpreters`` on 3.12) the extension loads, opens a spool the
  main interpreter created, puts a frame and gets it back through its own
  Ring and Cursor; the main interpreter then reads the same frame;
* ``import shmq`` (the package) there: on 3.13 it imports, and the
  package's own ``Spool.open`` and ``put`` work in the isolated interpreter
  (asserted).  The engine opens its semaphores itself, so no single-phase
  extension module (posix_ipc was one) stands in the way.  On 3.12 the
  import raises ImportError, from ``_ctypes``, which 3.12 does not load in
  an isolated interpreter (inotify_simple imports ctypes); reported by name.

CPython 3.11 has no per-interpreter GIL: skipped there.
"""

import json
import os
import subprocess
import sys

import pytest

from conftest import bound

pytestmark = pytest.mark.skipif(sys.version_info < (3, 12),
                                reason="isolated subinterpreters with their own GIL need CPython 3.12+")

CHILD = r'''
import json, os, sys
import shmq
from shmq import _core, _format as F
from shmq._lock import holder_word
from shmq._mapping import SEM_READ_WAITERS, SEM_SPACE_WAITERS, SEM_WRITER, sem_name

path, out = sys.argv[1], sys.argv[2]
sp = shmq.Spool.create(path, capacity="1MiB", on_full="overwrite")
try:
    m = sp.mapping
    geo = m.geo
    fseq, fpos = sp.core.first_cursor()
    ring_args = [path, geo["ring_offset"], geo["ring_bytes"], geo["slot_offset"], geo["slot_count"],
                 F.POLICIES.index(geo["policy"]), geo["checksum"],
                 sem_name(geo["sem_prefix"], SEM_WRITER), sem_name(geo["sem_prefix"], SEM_READ_WAITERS),
                 sem_name(geo["sem_prefix"], SEM_SPACE_WAITERS)]
    code = f"""
import importlib.util, json, mmap, os
res = {{}}
try:
    import shmq
    res["package"] = "ok"
except ImportError as exc:
    res["package"] = "ImportError: " + str(exc)
spec = importlib.util.spec_from_file_location("shmq._core", {_core.__file__!r})
core = importlib.util.module_from_spec(spec)
spec.loader.exec_module(core)
a = {ring_args!r}
fd = os.open(a[0], os.O_RDWR)
mm = mmap.mmap(fd, os.fstat(fd).st_size)
ring = core.Ring(mm, a[0], *a[1:7], *a[7:10], fd, {holder_word()}, 5.0)
cur = core.Cursor(ring, 0, -1, {fseq}, {fpos}, False, True, None)
res["seq"] = ring.put(b"hello from a subinterpreter")
f = cur.get()
res["got"] = [f.seq, f.data.decode()]
res["module_is_own"] = core is not None and core.Ring is not None
ring.close()
mm.close()
os.close(fd)
if res["package"] == "ok":
    sp2 = shmq.Spool.open(a[0])
    res["package_seq"] = sp2.put(b"from the package")
    sp2.close()
with open({out!r}, "w") as fh:
    json.dump(res, fh)
"""
    try:
        import _interpreters as interpreters  # 3.13
        iid = interpreters.create("isolated")
        err = interpreters.exec(iid, code)
        if err is not None:
            raise RuntimeError(f"the subinterpreter raised: {err}")
    except ImportError:
        import _xxsubinterpreters as interpreters  # 3.12
        iid = interpreters.create(isolated=True)
        interpreters.run_string(iid, code)
    interpreters.destroy(iid)
    with open(out) as fh:
        res = json.load(fh)
    f = sp.reader(start="earliest").get(timeout=5)  # the main interpreter reads the same frame
    res["main_got"] = [f.seq, f.data.decode()]
    if res["package"] == "ok":
        f = sp.reader(start=1).get(timeout=5)
        res["main_got_package"] = [f.seq, f.data.decode()]
    with open(out, "w") as fh:
        json.dump(res, fh)
finally:
    sp.close()
'''


def test_core_in_an_isolated_subinterpreter(spool_dir, tmp_path):
    path = os.path.join(spool_dir, "sub")
    out = tmp_path / "res.json"
    proc = subprocess.run([sys.executable, "-c", CHILD, path, str(out)], capture_output=True, text=True,
                          timeout=bound(120))
    assert proc.returncode == 0, f"child failed ({proc.returncode}): {proc.stderr[-3000:]}"
    res = json.loads(out.read_text())
    # The core works there: its own module state, a put and a get over a shared spool.
    assert res["seq"] == 0 and res["got"] == [0, "hello from a subinterpreter"], res
    assert res["main_got"] == [0, "hello from a subinterpreter"], res
    # The package imports and works there on 3.13; on 3.12 it says clearly why not (_ctypes).
    if sys.version_info >= (3, 13):
        assert res["package"] == "ok", res
    assert res["package"] == "ok" or res["package"].startswith("ImportError: "), res
    if res["package"] == "ok":
        assert res["package_seq"] == 1 and res["main_got_package"] == [1, "from the package"], res
    else:
        assert "subinterpreter" in res["package"], res["package"]
    print("import shmq in the isolated interpreter:", res["package"])

