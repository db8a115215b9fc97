"""The stable-ABI variant of the compiled core, for measuring it (issue 27).

Everything about the build is in pyproject.toml; this file changes nothing unless
SHMQ_LIMITED_API=1 is in the environment.  Then shmq._core is compiled with
-DPy_LIMITED_API=0x030c0000 (shmq/core/abi.h maps what the core uses onto the
limited API of CPython 3.12), named _core.abi3.so, and a wheel is tagged
cp312-abi3.  docs/install.md, "Stable ABI (abi3)", says how it was measured and
why the released wheels are not built this way.
"""
import os
import sys

from setuptools import setup
from setuptools.command.build_ext import build_ext

LIMITED_API = 0x030C0000  # 3.12: PyObject_Vectorcall is limited API from 3.12 (abi.h)


class build_ext_abi3(build_ext):
    """build_ext that makes every extension a limited-API (abi3) one."""

    def finalize_options(self):
        super().finalize_options()
        for ext in self.extensions:
            ext.py_limited_api = True  # setuptools then names the file _core.abi3.so
            ext.define_macros.append(("Py_LIMITED_API", hex(LIMITED_API)))


if os.environ.get("SHMQ_LIMITED_API") == "1":
    if sys.version_info < (3, 12):
        sys.exit("SHMQ_LIMITED_API=1 needs CPython >= 3.12 (the core's limited API is 3.12's)")
    setup(cmdclass={"build_ext": build_ext_abi3}, options={"bdist_wheel": {"py_limited_api": "cp312"}})
else:
    setup()
