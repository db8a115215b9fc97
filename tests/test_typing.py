"""Type information: the public API is annotated and type-checks (docs/guide.md, "Type checking").

Runs mypy (``sys.executable -m mypy``) twice, concurrently, each with a cache in
``tmp_path``:

* over the package with the ``[tool.mypy]`` configuration of pyproject.toml,
  which makes a missing annotation an error in the public modules; and again
  with one public function's annotations stripped (``--shadow-file``), which
  must fail: the configuration really covers that module;
* over ``tests/typing/client.py`` (the API used as the README and docs use it,
  ``assert_type`` on the key return types) and ``tests/typing/bad_client.py``
  (wrong uses, each of which must be an error) with ``--strict``, shmq's own
  modules followed silently as for an installed package.

Public names of modules that mix API with process internals (the dispatcher's
worker and board modules, the Spark data source classes) are checked for
complete annotations by inspection.
"""

from __future__ import annotations

import importlib
import inspect
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

from conftest import SOURCE_ROOT, bound

pytest.importorskip("mypy", reason="mypy is not installed (it comes with the test extra)")

ROOT = Path(SOURCE_ROOT)
TYPING = ROOT / "tests" / "typing"
TIMEOUT_S = bound(600)  # a cold cache on a loaded 2-vCPU machine; normally 15-40 s

#: The client check: --strict for the client, shmq followed silently (errors inside the
#: package are the package check's business), untyped third-party modules ignored.
CLIENT_INI = """\
[mypy]
strict = True
python_version = 3.11
[mypy-shmq,shmq.*]
follow_imports = silent
[mypy-inotify_simple,pyarrow,pyarrow.*]
ignore_missing_imports = True
"""

#: (module, public function) stripped of its annotations for the negative package check.
STRIPPED = ("shmq/dedupe.py", "def pop_stamp(record: object) -> Stamp | None:", "def pop_stamp(record):")


def _mypy(args, cache):
    cmd = [sys.executable, "-m", "mypy", "--cache-dir", str(cache), "--no-color-output",
           "--no-error-summary", *args]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def _finish(proc):
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    return proc.returncode, out


def _run_all(tmp):
    """The mypy runs' (returncode, output), keyed by name."""
    ini = tmp / "client.ini"
    ini.write_text(CLIENT_INI)
    path, old, new = STRIPPED
    src = (ROOT / path).read_text()
    assert src.count(old) == 1, f"{path} no longer has {old!r}: update STRIPPED"
    shadow = tmp / "stripped.py"
    shadow.write_text(src.replace(old, new))
    package = _mypy(["--config-file", "pyproject.toml"], tmp / "package-cache")
    client = _mypy(["--config-file", str(ini), str(TYPING / "client.py"),
                    str(TYPING / "bad_client.py")], tmp / "client-cache")
    out = {"package": _finish(package), "client": _finish(client)}
    # incremental on the package run's cache: only the shadowed module and its importers
    out["stripped"] = _finish(_mypy(["--config-file", "pyproject.toml", "--shadow-file",
                                     str(ROOT / path), str(shadow)], tmp / "package-cache"))
    out["stripped_line"] = src[:src.index(old)].count("\n") + 1
    return out


def _errors(output):
    return [line for line in output.splitlines() if ": error:" in line]


def test_mypy_checks_the_public_api(tmp_path):
    # One test for all runs: they share caches, and xdist would otherwise repeat them.
    pytest.importorskip("pyspark", reason="pyspark is not installed: the package check types "
                                          "shmq/spark against pyspark's own annotations")
    runs = _run_all(tmp_path)
    check_package_type_checks(runs)
    check_an_unannotated_public_function_fails_the_package_check(runs)
    check_client_uses_the_api_under_strict(runs)
    check_revealed_types_of_key_methods(runs)
    check_wrong_uses_are_rejected(runs)


def check_package_type_checks(runs):
    code, out = runs["package"]
    assert code == 0 and not _errors(out), out


def check_an_unannotated_public_function_fails_the_package_check(runs):
    code, out = runs["stripped"]
    line = runs["stripped_line"]
    assert code == 1, out
    assert re.search(rf"shmq/dedupe\.py:{line}: error: Function is missing a type annotation"
                     r".*\[no-untyped-def\]", out), out


def check_client_uses_the_api_under_strict(runs):
    code, out = runs["client"]
    client_errors = [e for e in _errors(out) if "client.py" in e and "bad_client.py" not in e]
    assert not client_errors, out
    assert code == 1  # bad_client.py's errors, checked below


def check_revealed_types_of_key_methods(runs):
    _code, out = runs["client"]
    revealed = dict(re.findall(r"client\.py:(\d+): note: Revealed type is \"(.*)\"", out))
    src = (TYPING / "client.py").read_text().splitlines()
    by_expr = {src[int(n) - 1].strip().split("#")[0].strip(): t for n, t in revealed.items()}
    assert re.fullmatch(r"def \(data: \S*Buffer, \*, block: bool =, timeout: float \| None =, "
                        r"codec: int =\) -> int", by_expr["reveal_type(sp.put)"]), by_expr
    assert re.fullmatch(r"def \(block: bool =, timeout: float \| None =\) -> "
                        r"tuple\[int, int, bytes \| bytearray \| memoryview\[int\], fallback=shmq\._core\.Frame\]",
                        by_expr["reveal_type(r.get)"]), by_expr
    assert by_expr["reveal_type(q.get)"] == "def (block: bool =, timeout: float | None =) -> Any"
    # Dispatcher.handler(...) returns the handler with its own signature, not Any
    assert by_expr["reveal_type(handler)"] == ("def (ctx: shmq.dispatch.worker.Context, "
                                               "body: Any)"), by_expr


def check_wrong_uses_are_rejected(runs):
    _code, out = runs["client"]
    src = (TYPING / "bad_client.py").read_text().splitlines()
    marked = {i + 1 for i, line in enumerate(src) if line.rstrip().endswith("# E")}
    got = [int(m) for m in re.findall(r"bad_client\.py:(\d+): error:", out)]
    assert len(marked) >= 10
    assert sorted(got) == sorted(marked), out


# -- annotations of public names, by inspection ------------------------------------------

#: Public modules (docs/guide.md, "Type checking"); their ``__all__`` is the public API.
PUBLIC_MODULES = ["shmq", "shmq.codec", "shmq.columnar", "shmq.workqueue", "shmq.dispatch",
                  "shmq.metrics", "shmq.dedupe", "shmq.rpc", "shmq.gc", "shmq.spark"]
#: Methods not defined by shmq (inherited, or generated by dataclasses) are not checked.
_SKIP_DUNDERS = {"__init_subclass__", "__subclasshook__", "__class_getitem__"}


_checked: list[str] = []


def _unannotated(fn, where):
    """Parameters (and the return) of ``fn`` without an annotation."""
    fn = inspect.unwrap(fn)
    if not isinstance(fn, types.FunctionType) or not fn.__module__.startswith("shmq"):
        return []
    if fn.__code__.co_filename == "<string>" or fn.__name__ == "<lambda>":
        # generated by dataclasses; or shmq.dispatch.metrics, a view of the annotated
        # Dispatcher._metrics (which the strict package check covers)
        return []
    sig = inspect.signature(fn)
    params = list(sig.parameters.values())
    if params and params[0].name in ("self", "cls"):
        params = params[1:]
    _checked.append(where)
    missing = [f"{where}({p.name})" for p in params if p.annotation is inspect.Parameter.empty]
    if sig.return_annotation is inspect.Signature.empty:
        missing.append(f"{where} -> ?")
    return missing


def _public_names(modname):
    mod = importlib.import_module(modname)
    names = getattr(mod, "__all__", None)
    if names is None:
        names = [n for n, v in vars(mod).items() if not n.startswith("_")
                 and getattr(v, "__module__", None) == modname]
    return mod, names


def test_public_names_are_annotated():
    missing = []
    for modname in PUBLIC_MODULES:
        if modname == "shmq.spark":
            pytest.importorskip("pyspark")
        mod, names = _public_names(modname)
        for name in names:
            obj = getattr(mod, name)
            where = f"{modname}.{name}"
            if inspect.isclass(obj) and obj.__module__.startswith("shmq"):
                for attr, value in vars(obj).items():
                    if attr.startswith("_") and not (attr.endswith("__") and attr not in _SKIP_DUNDERS):
                        continue
                    if isinstance(value, property):
                        value = value.fget
                    elif isinstance(value, (classmethod, staticmethod)):
                        value = value.__func__
                    missing += _unannotated(value, f"{where}.{attr}")
            elif callable(obj):
                missing += _unannotated(obj, where)
    assert not missing, "public functions without annotations:\n" + "\n".join(missing)
    # not vacuous: Spool, the readers, Queue, WorkQueue, Message, Dispatcher, Context...
    for name in ("shmq.Spool.put", "shmq.NamedReader.commit", "shmq.Queue.get", "shmq.Message.ack",
                 "shmq.dispatch.Context.publish", "shmq.dispatch.format_status",
                 "shmq.columnar.PinnedView.release", "shmq.dedupe.Deduper.seen",
                 "shmq.Client.call_many", "shmq.Service.serve", "shmq.gc.sweep"):
        assert name in _checked, name
    assert len(_checked) > 150, len(_checked)


def test_type_only_imports_are_not_layer_edges(tmp_path):
    # Annotations make lower layers name upper layers' classes (codec -> Spool, reader ->
    # Spool): under `if TYPE_CHECKING:` that is no runtime dependency, and the structure
    # check (stress/structure.py, "Import cycles") does not count it; a real import does.
    sys.path.insert(0, str(ROOT / "stress"))
    try:
        import structure
    finally:
        sys.path.remove(str(ROOT / "stress"))
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "low.py").write_text("from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
                                "    from .high import High\n\n\ndef f(h: High) -> None:\n"
                                "    pass\n")
    (pkg / "high.py").write_text("from .low import f\n\n\nclass High:\n    pass\n")
    assert structure.analyse(str(pkg))["cycles"] == []
    (pkg / "low.py").write_text("from .high import High\n")
    assert len(structure.analyse(str(pkg))["cycles"]) == 1
