"""The build steps pyproject.toml cannot state: the generated layout module, and the
stable-ABI variant of the compiled core.

Everything else about the build is in pyproject.toml.

* ``shmq/_layout.py`` is generated from ``shmq/engine/shmq_layout.h``, the one
  hand-written statement of the spool layout, whenever the extension is built
  (``build_ext``, in place or into a wheel): every ``#define SHMQ_NAME value``
  becomes ``NAME = value``, every field list a struct format and a tuple of
  field names.  :func:`layout_module` is the generator (tests/test_format.py
  checks that the module in the tree is what it makes of the header now).
* With ``SHMQ_LIMITED_API=1`` in the environment, shmq._core is compiled with
  -DPy_LIMITED_API=0x030c0000 (shmq/core/abi.h maps what the binding uses onto
  the limited API of CPython 3.12), named _core.abi3.so, and a wheel is tagged
  cp312-abi3.  docs/install.md, "Stable ABI (abi3)", says how it was measured
  and why the released wheels are not built this way.
"""
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
LAYOUT_HEADER = os.path.join("shmq", "engine", "shmq_layout.h")
LAYOUT_MODULE = os.path.join("shmq", "_layout.py")
LIMITED_API = 0x030C0000  # 3.12: PyObject_Vectorcall is limited API from 3.12 (abi.h)

_DEFINE = re.compile(r"^#define\s+SHMQ_([A-Z0-9_]+)\s+(.+?)\s*(?:/\*.*)?$")
_FIELDS = re.compile(r"^#define\s+SHMQ_([A-Z0-9_]+)_FIELDS\(X\)\s*(.*)$")
_FIELD = re.compile(r"X\(\s*[A-Za-z_0-9]+\s*,\s*([A-Za-z_0-9]+)(?:\[\d+\])?\s*,\s*(\w+)\s*\)")
_INT_SUFFIX = re.compile(r"\b(0[xX][0-9a-fA-F]+|\d+)[uUlL]+\b")


def layout_module(header_text: str) -> str:
    """The source of shmq/_layout.py for the text of shmq_layout.h.

    :raises ValueError: a ``#define`` the generator cannot read (keep to the
        forms the header's comment lists).
    """
    lines = header_text.replace("\\\n", " ").splitlines()
    names, out, fields = {}, [], []
    for line in lines:
        line = line.strip()
        m = _FIELDS.match(line)
        if m:
            entries = _FIELD.findall(m.group(2))
            if not entries:
                raise ValueError(f"shmq_layout.h: cannot read field list {m.group(1)}")
            fields.append((m.group(1), entries))
            continue
        m = _DEFINE.match(line)
        if not m or m.group(1) in ("LAYOUT_H", "LAYOUT_FIELD_") or "(" in m.group(1):
            continue
        name, value = m.group(1), m.group(2)
        if value.startswith('"'):
            names[name] = value
            out.append(f"{name} = {value}")
            continue
        expr = _INT_SUFFIX.sub(r"\1", value).replace("SHMQ_", "")
        if not re.fullmatch(r"[A-Z0-9_xa-f()+\-*/<> ]+", expr):
            raise ValueError(f"shmq_layout.h: cannot read #define SHMQ_{name} {value}")
        expr = expr.replace("/", "//")
        try:
            names[name] = eval(expr, {"__builtins__": {}}, dict(names))  # integer arithmetic only
        except Exception as exc:
            raise ValueError(f"shmq_layout.h: cannot evaluate SHMQ_{name} = {value}: {exc}") from None
        out.append(f"{name} = {names[name]!r}")
    for name, entries in fields:
        fmt = "<" + "".join(code for _n, code in entries)
        out.append(f"{name}_FORMAT = {fmt!r}")
        out.append(f"{name}_FIELD_NAMES = {tuple(n for n, _c in entries)!r}")
    head = ('"""The spool layout, generated from shmq/engine/shmq_layout.h by setup.py at build\n'
            'time: do not edit (change the header and rebuild).  shmq._format re-exports it."""\n\n')
    return head + "\n".join(out) + "\n"


def write_layout_module(root: str = HERE) -> str:
    """Write shmq/_layout.py under ``root`` from its header (only if it changed); its path."""
    with open(os.path.join(HERE, LAYOUT_HEADER)) as f:
        text = layout_module(f.read())
    path = os.path.join(root, LAYOUT_MODULE)
    try:
        with open(path) as f:
            if f.read() == text:
                return path
    except FileNotFoundError:
        pass
    with open(path, "w") as f:
        f.write(text)
    return path


if __name__ == "__main__":  # setuptools runs this file as __main__
    from setuptools import setup
    from setuptools.command.build_ext import build_ext
    from setuptools.command.build_py import build_py

    class build_ext_layout(build_ext):
        """build_ext that writes shmq/_layout.py first (in place: into the tree)."""

        def run(self):
            write_layout_module()  # the tree: in-place and editable builds import it from there
            if not self.inplace:
                os.makedirs(os.path.join(self.build_lib, "shmq"), exist_ok=True)
                write_layout_module(self.build_lib)
            super().run()

    class build_py_layout(build_py):
        """build_py that writes shmq/_layout.py before copying the package."""

        def run(self):
            write_layout_module()
            super().run()

    class build_ext_abi3(build_ext_layout):
        """build_ext that makes every extension a limited-API (abi3) one."""

        def finalize_options(self):
            super().finalize_options()
            for ext in self.extensions:
                ext.py_limited_api = True  # setuptools then names the file _core.abi3.so
                ext.define_macros.append(("Py_LIMITED_API", hex(LIMITED_API)))

    if os.environ.get("SHMQ_LIMITED_API") == "1":
        if sys.version_info < (3, 12):
            sys.exit("SHMQ_LIMITED_API=1 needs CPython >= 3.12 (the core's limited API is 3.12's)")
        setup(cmdclass={"build_ext": build_ext_abi3, "build_py": build_py_layout},
              options={"bdist_wheel": {"py_limited_api": "cp312"}})
    else:
        setup(cmdclass={"build_ext": build_ext_layout, "build_py": build_py_layout})
