"""The stable-ABI variant of the compiled core keeps building.

The released wheels use the full C API.  ``SHMQ_LIMITED_API=1`` (setup.py) builds
``_core.abi3.so`` with ``-DPy_LIMITED_API=0x030c0000`` through shmq/core/abi.h, so
that it can be measured against the full build (stress/abi3_ab.py; docs/install.md,
"Stable ABI (abi3)").  These tests compile that variant from the current sources
with the running interpreter's headers, so a core change that uses a full-API
macro abi.h does not map fails here, not at the next measurement.  They skip on
CPython < 3.12 (the variant's floor) and without a C compiler.
"""

import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib

import pytest

from conftest import SOURCE_ROOT, bound

ROOT = SOURCE_ROOT
LIMITED = "-DPy_LIMITED_API=0x030c0000"
# What a full-API macro or struct access under the limited API turns into.
STRICT = ["-Werror=implicit-function-declaration", "-Werror=incompatible-pointer-types", "-Werror=int-conversion"]

pytestmark = pytest.mark.skipif(sys.version_info < (3, 12), reason="the limited-API core needs CPython >= 3.12")


def _cc():
    cc = shutil.which("cc") or shutil.which("gcc")
    if not cc:
        pytest.skip("no C compiler (cc)")
    return cc


def _core():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        (core,) = [e for e in tomllib.load(f)["tool"]["setuptools"]["ext-modules"] if e["name"] == "shmq._core"]
    return ([os.path.join(ROOT, s) for s in core["sources"]],
            ["-I" + os.path.join(ROOT, d) for d in core["include-dirs"]] + ["-I" + sysconfig.get_paths()["include"]],
            core["extra-compile-args"])


def _stable_abi_names():
    try:
        from test.test_stable_abi_ctypes import SYMBOL_NAMES
    except ImportError:
        return None
    return set(SYMBOL_NAMES)


def test_limited_api_build_links_only_stable_abi_symbols(tmp_path):
    """Every core file compiles with Py_LIMITED_API=3.12 (no undeclared or mistyped call), and the
    linked module imports from libpython only what CPython's stable ABI exports."""
    cc = _cc()
    srcs, incs, args = _core()
    so = tmp_path / "_core.abi3.so"
    proc = subprocess.run([cc, "-shared", "-fPIC", *args, "-O0", *STRICT, LIMITED, *incs, *srcs, "-o", str(so)],
                          capture_output=True, text=True, timeout=bound(300))
    assert proc.returncode == 0, proc.stderr[-4000:]
    names = _stable_abi_names()
    if names is None:
        pytest.skip("this CPython has no test.test_stable_abi_ctypes (the stable ABI's symbol list)")
    nm = subprocess.run(["nm", "-D", "--undefined-only", str(so)], capture_output=True, text=True, check=True)
    used = {line.split()[-1].split("@")[0] for line in nm.stdout.splitlines() if line.strip()}
    python = {s for s in used if s.startswith(("Py", "_Py"))}
    assert len(python) > 50, python  # it really is the core
    assert python - names == set()


def test_limited_api_older_than_312_is_refused(tmp_path):
    """3.11's limited API has no PyObject_Vectorcall: abi.h stops the build with the reason."""
    cc = _cc()
    srcs, incs, args = _core()
    proc = subprocess.run([cc, "-fsyntax-only", *args, "-DPy_LIMITED_API=0x030b0000", *incs, srcs[0]],
                          capture_output=True, text=True, timeout=bound(120))
    assert proc.returncode != 0
    assert "needs Py_LIMITED_API >= 0x030c0000" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.parametrize("arg,compiles", [("t", False), ("(PyObject *)t", True)])
def test_a_struct_pointer_passed_as_object_is_an_error(tmp_path, arg, compiles):
    """What GCC 14+ rejects by default, the build above rejects with any GCC and any 3.12+ headers:
    abi.h must not hide a mistyped Py_TYPE() behind a casting macro (3.14's limited-API headers
    define Py_TYPE as a macro without the cast, 3.12's and 3.13's as a function of PyObject *)."""
    cc = _cc()
    _, incs, args = _core()
    src = tmp_path / "mistyped.c"
    src.write_text('#define PY_SSIZE_T_CLEAN\n#include <Python.h>\n#include "abi.h"\n'
                   "typedef struct { PyObject_HEAD int x; } Thing;\n"
                   f"PyTypeObject *type_of(Thing *t) {{ return Py_TYPE({arg}); }}\n")
    proc = subprocess.run([cc, "-fsyntax-only", *args, *STRICT, LIMITED, *incs, str(src)],
                          capture_output=True, text=True, timeout=bound(120))
    assert (proc.returncode == 0) == compiles, proc.stderr[-2000:]
    if not compiles:
        assert "incompatible-pointer-types" in proc.stderr, proc.stderr[-2000:]
