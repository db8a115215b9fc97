"""The release files `.ci/wheels OUTDIR` builds: tags, symbols, contents, installs.

Two kinds of test:

- always (cheap, no build): the script's usage, and the cibuildwheel
  configuration in pyproject.toml agreeing with the script's CPythons and
  architectures;
- on built files, only when ``SHMQ_WHEELS_DIR`` names a directory that
  `.ci/wheels` filled (it runs this file on its OUTDIR itself, with
  ``--noconftest``: this file needs no shmq installed in the running
  interpreter): `auditwheel show` reports the manylinux tag each wheel carries;
  the extension is an ELF of the wheel's architecture whose GLIBC symbol
  versions stay within that tag; each wheel ships every file of the source
  package; every x86_64 wheel installs into a fresh venv whose PATH has no C
  compiler and runs ``python -m shmq demo`` and a smoke test from there; the
  aarch64 cp311 wheel imports and round-trips frames under qemu-aarch64-static
  when ``SHMQ_WHEELS_ARM64_ROOT`` names an arm64 root with python3.11.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile

import pytest

from conftest import bound

try:
    import tomllib
except ImportError:  # pragma: no cover - requires-python is 3.11
    tomllib = None

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, ".ci", "wheels")
WHEELS_DIR = os.environ.get("SHMQ_WHEELS_DIR")
WHEELS = sorted(glob.glob(os.path.join(WHEELS_DIR, "shmq-*.whl"))) if WHEELS_DIR else []
ARM64_ROOT = os.environ.get("SHMQ_WHEELS_ARM64_ROOT")
ELF_MACHINE = {"x86_64": "Advanced Micro Devices X86-64", "aarch64": "AArch64"}
COMPILERS = ("cc", "gcc", "clang", "c99", "tcc", "zig", "x86_64-linux-gnu-gcc", "aarch64-linux-gnu-gcc")

needs_wheels = pytest.mark.skipif(not WHEELS, reason="no wheels: run .ci/wheels OUTDIR "
                                  "(or set SHMQ_WHEELS_DIR to its OUTDIR)")


def script_list(name: str) -> list[str]:
    """A bash array assigned in .ci/wheels, e.g. SUPPORTED=(3.11 3.12 3.13)."""
    with open(SCRIPT) as f:
        m = re.search(rf"^{name}=\(([^)]*)\)", f.read(), re.M)
    assert m, f"{name}=(...) not found in .ci/wheels"
    return m.group(1).split()


# --- always: cheap checks of the script and of pyproject's cibuildwheel table ---------------

def test_script_usage():
    assert os.access(SCRIPT, os.X_OK), ".ci/wheels must be executable"
    for args in ([], ["a", "b"], ["--help"]):
        r = subprocess.run([SCRIPT, *args], capture_output=True, text=True, timeout=bound(30))
        assert r.returncode == 2 and "usage: .ci/wheels OUTDIR" in r.stderr, (args, r)


@pytest.mark.skipif(tomllib is None, reason="tomllib is 3.11+")
def test_cibuildwheel_config_matches_script():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)
    versions = script_list("SUPPORTED")
    cibw = project["tool"]["cibuildwheel"]
    assert cibw["build"].split() == [f"cp{v.replace('.', '')}-*" for v in versions]
    assert "*-musllinux_*" in cibw["skip"].split()  # the core is built and tested on glibc only
    linux = cibw["linux"]
    assert linux["archs"] == script_list("ARCHS")
    with open(SCRIPT) as f:
        glibc = re.search(r"^GLIBC=(\d+)\.(\d+)", f.read(), re.M).groups()
    for arch in linux["archs"]:  # the same baseline as .ci/wheels builds against
        assert linux[f"manylinux-{arch}-image"] == f"manylinux_{glibc[0]}_{glibc[1]}" or (
            glibc == ("2", "17") and linux[f"manylinux-{arch}-image"] == "manylinux2014")
    classifiers = project["project"]["classifiers"]
    for v in versions:
        assert f"Programming Language :: Python :: {v}" in classifiers
    assert project["project"]["requires-python"] == f">={versions[0]}"
    # the test command names markers and paths that exist
    command = cibw["test-command"]
    for marker in re.findall(r"not (\w+)", command):
        assert any(m.startswith(marker + ":") for m in project["tool"]["pytest"]["ini_options"]["markers"])
    assert "{project}/tests" in command


# --- on the files .ci/wheels built --------------------------------------------------------

def wheel_tags(path: str) -> tuple[str, str, str]:
    """(python tag, manylinux_X_Y platform tag, architecture) from a wheel's file name.

    A manylinux_2_17 wheel also carries the legacy alias manylinux2014."""
    _name, _ver, py, _abi, plats = os.path.basename(path)[:-len(".whl")].split("-")
    pep600 = [p for p in plats.split(".") if re.match(r"manylinux_\d+_\d+_", p)]
    assert len(pep600) == 1, plats
    return py, pep600[0], pep600[0].split("_", 3)[-1]


def source_package_files() -> set[str]:
    """Every file of the shmq package in the source tree a wheel must ship (C sources aside)."""
    try:
        r = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "shmq"],
                           cwd=ROOT, capture_output=True, text=True)
    except FileNotFoundError:  # no git at all (the chroot's install test)
        r = None
    if r is not None and r.returncode == 0:
        files = [f for f in r.stdout.split() if os.path.exists(os.path.join(ROOT, f))]
    else:  # not a git checkout (an unpacked sdist)
        files = [os.path.relpath(os.path.join(d, f), ROOT) for d, _, fs in os.walk(os.path.join(ROOT, "shmq"))
                 for f in fs if "__pycache__" not in d]
    return {f for f in files if not f.endswith((".c", ".h", ".so"))}


#: Package files the wheel leaves out: the Makefile builds libshmq from the C sources,
#: which only the sdist has (MANIFEST.in puts it there).
BUILD_ONLY = {"shmq/engine/Makefile"}
#: Generated by the build from shmq/engine/shmq_layout.h (setup.py), so in every wheel.
GENERATED_LAYOUT = "shmq/_layout.py"


def extension_name(py: str, arch: str) -> str:
    return f"shmq/_core.cpython-{py[2:]}-{arch}-linux-gnu.so"


def wheel_package_files(py: str, arch: str) -> set[str]:
    """The files under shmq/ a wheel for ``py`` on ``arch`` ships (and installs)."""
    return (source_package_files() - BUILD_ONLY) | {extension_name(py, arch), GENERATED_LAYOUT}


def readelf(*args: str) -> str:
    return subprocess.run(["readelf", "-W", *args], check=True, capture_output=True, text=True).stdout


@needs_wheels
def test_every_architecture_and_sdist_present():
    archs = {wheel_tags(w)[2] for w in WHEELS}
    assert archs == set(script_list("ARCHS")), archs
    assert len(glob.glob(os.path.join(WHEELS_DIR, "shmq-*.tar.gz"))) == 1


@needs_wheels
@pytest.mark.parametrize("wheel", WHEELS, ids=os.path.basename)
def test_auditwheel_show_reports_the_tag(wheel):
    pytest.importorskip("auditwheel", reason="auditwheel (PyPI) is in .ci/wheels' tool venv")
    out = subprocess.run([sys.executable, "-m", "auditwheel", "show", wheel], check=True,
                         capture_output=True, text=True).stdout
    m = re.search(r'platform tag:\s*"([^"]+)"', out)
    assert m, out
    _py, plat, arch = wheel_tags(wheel)
    assert m.group(1).startswith("manylinux_") and m.group(1) == plat, (m.group(1), plat)
    print(f"{os.path.basename(wheel)}: auditwheel show: {m.group(1)}")


@needs_wheels
@pytest.mark.parametrize("wheel", WHEELS, ids=os.path.basename)
def test_extension_elf_and_glibc_versions(wheel, tmp_path):
    py, plat, arch = wheel_tags(wheel)
    so = extension_name(py, arch)
    with zipfile.ZipFile(wheel) as z:
        z.extract(so, tmp_path)
    path = str(tmp_path / so)
    header = readelf("-h", path)
    assert re.search(rf"Machine:\s+{re.escape(ELF_MACHINE[arch])}\s*$", header, re.M), header
    assert "ELF64" in header and "little endian" in header
    # The highest GLIBC_x.y the extension needs must not exceed the tag's baseline.
    versions = {tuple(map(int, v.split("."))) for v in re.findall(r"Name: GLIBC_([\d.]+)", readelf("-V", path))}
    assert versions, "no GLIBC version needed at all: readelf output not understood"
    baseline = tuple(map(int, re.match(r"manylinux_(\d+)_(\d+)_", plat).groups()))
    assert max(versions) <= baseline, (sorted(versions), plat)
    # Every undefined symbol is either versioned (libc's, checked above) or the
    # interpreter's own C API (resolved from the python process, never from a library).
    unversioned = set()
    for line in readelf("--dyn-syms", path).splitlines():
        f = line.split()
        if len(f) >= 8 and f[6] == "UND" and f[7] and "@" not in f[7]:
            unversioned.add(f[7])
    stray = {s for s in unversioned if not s.startswith(("Py", "_Py", "__gmon_start__", "_ITM", "__cxa_finalize"))}
    assert not stray, f"undefined symbols with no version that are not CPython's: {sorted(stray)}"
    needed = set(re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", readelf("-d", path)))
    # The dynamic loader is on every system: the engine's thread-locals (its error text,
    # a writer's view of a full ring) need __tls_get_addr from it on x86-64, and auditwheel
    # never counts the loader as an external library.
    loaders = {"ld-linux-x86-64.so.2", "ld-linux-aarch64.so.1"}
    assert needed <= {"libc.so.6", "libpthread.so.0", "libm.so.6", "librt.so.1", "libdl.so.2"} | loaders, needed
    print(f"{os.path.basename(wheel)}: {ELF_MACHINE[arch]}, max GLIBC_{'.'.join(map(str, max(versions)))}, "
          f"NEEDED {sorted(needed)}")


@needs_wheels
@pytest.mark.parametrize("wheel", WHEELS, ids=os.path.basename)
def test_wheel_ships_the_whole_package(wheel):
    py, _plat, arch = wheel_tags(wheel)
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        entry_points = z.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    package = {n for n in names if n.startswith("shmq/") and not n.endswith("/")}  # files, not directories
    expected = wheel_package_files(py, arch)
    assert package == expected, {"missing": sorted(expected - package), "extra": sorted(package - expected)}
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert re.search(r"^shmq = shmq\.cli:main$", entry_points, re.M), entry_points


@needs_wheels
def test_sdist_ships_the_sources():
    (sdist,) = glob.glob(os.path.join(WHEELS_DIR, "shmq-*.tar.gz"))
    with tarfile.open(sdist) as t:
        names = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        ext = tomllib.load(f)["tool"]["setuptools"]["ext-modules"]
    c_sources = {s for e in ext for s in e["sources"]}
    missing = (source_package_files() | c_sources | {"pyproject.toml", "README.md", "LICENSE"}) - names
    assert not missing, sorted(missing)


def x86_64_cases():
    """(wheel, python) for every x86_64 wheel with a matching interpreter in SHMQ_WHEELS_PYTHONS."""
    cases = []
    tags = {}
    for exe in os.environ.get("SHMQ_WHEELS_PYTHONS", "").split():
        r = subprocess.run([exe, "-c", "import sys; print('cp%d%d' % sys.version_info[:2])"],
                           capture_output=True, text=True)
        if r.returncode == 0:
            tags[r.stdout.strip()] = exe
    for wheel in WHEELS:
        py, _plat, arch = wheel_tags(wheel)
        if arch == "x86_64" and py in tags:
            cases.append(pytest.param(wheel, tags[py], id=py))
    return cases


#: Runtime dependencies allowed to have no wheel for an interpreter, and so to be built
#: from their sdist (with a compiler) before the compiler-free install of shmq's wheel.
#: None: the engine makes the semaphores itself (posix_ipc, which has no cp314/cp315
#: wheel, is a test dependency only), so any runtime dependency without a wheel fails.
SDIST_DEPENDENCIES: set[str] = set()


def dependencies_without_wheels(vbin, wheel, env, cwd):
    """The wheel's runtime requirements that pip cannot get as a wheel for this interpreter."""
    with zipfile.ZipFile(wheel) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    reqs = [r.strip() for r in re.findall(r"^Requires-Dist: (.+)$", meta, re.M) if "extra ==" not in r]
    missing = []
    for req in reqs:
        r = subprocess.run([str(vbin / "python"), "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                            "-d", str(cwd / "probe"), req], env=env, cwd=cwd, capture_output=True, text=True,
                           timeout=bound(600))
        if r.returncode != 0:
            missing.append(re.split(r"[<>=!~; ]", req, maxsplit=1)[0])
    return missing


SMOKE = r"""
import functools, multiprocessing as mp, os, shutil, sys, tempfile
import shmq, shmq._core
prefix, method = sys.argv[1], sys.argv[2]
# the installed copy, never a source tree
assert shmq.__file__.startswith(prefix) and shmq._core.__file__.startswith(prefix), shmq._core.__file__
d = tempfile.mkdtemp(prefix="shmq-wheeltest-", dir="/dev/shm")
try:
    path = os.path.join(d, "smoke")
    sp = shmq.Spool.create(path, capacity="1MiB")
    assert [sp.put(bytes([i]) * 100) for i in range(100)] == list(range(100))
    r = sp.reader("smoke")
    assert [r.get(timeout=10).data for _ in range(100)] == [bytes([i]) * 100 for i in range(100)]
    sp.close()
    shmq.Spool.destroy(path)
    q = shmq.Queue()
    # Queue.put by name, not q.put: a queue's put is its core's C method, which
    # cannot be pickled for spawn (a queue handle itself can)
    p = mp.get_context(method).Process(target=functools.partial(shmq.Queue.put, q), args=({"n": 1},))
    p.start()
    assert q.get(timeout=60) == {"n": 1}
    p.join(60)
    assert p.exitcode == 0
    q.close()
finally:
    shutil.rmtree(d, ignore_errors=True)
print("smoke ok:", shmq._core.__file__)
"""


@needs_wheels
@pytest.mark.parametrize("wheel,python", x86_64_cases())
def test_installs_and_runs_without_a_compiler(wheel, python, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([python, "-m", "venv", str(venv)], check=True)
    vbin = venv / "bin"
    # PATH: the venv's bin and nothing else (pip, the demo and the smoke test need no
    # other program).  Prove no C compiler can be found on it, then install: a source
    # build could not happen, and --only-binary forbids one for the dependencies too.
    env = {k: v for k, v in os.environ.items() if k not in ("CC", "LDSHARED", "CFLAGS", "PYTHONPATH")}
    env["PATH"] = str(vbin)
    found = subprocess.run([str(vbin / "python"), "-c", "import shutil, sys; "
                            "print([c for c in sys.argv[1:] if shutil.which(c)])", *COMPILERS],
                           env=env, check=True, capture_output=True, text=True).stdout.strip()
    assert found == "[]", f"a C compiler on the test PATH: {found}"
    from_sdist = dependencies_without_wheels(vbin, wheel, env, tmp_path)
    assert set(from_sdist) <= SDIST_DEPENDENCIES, f"dependencies with no wheel here: {from_sdist}"
    if from_sdist:  # built first, with the compiler on PATH; shmq's wheel and the rest: none
        subprocess.run([str(vbin / "python"), "-m", "pip", "install", "-q", *from_sdist],
                       env=dict(env, PATH=f"{vbin}:{os.environ['PATH']}"), check=True, cwd=tmp_path, timeout=bound(900))
        print(f"{os.path.basename(wheel)}: {', '.join(from_sdist)} built from its sdist (no wheel for "
              f"{wheel_tags(wheel)[0]}); everything else installs as wheels")
    subprocess.run([str(vbin / "python"), "-m", "pip", "install", "-q", "--only-binary=:all:", wheel],
                   env=env, check=True, cwd=tmp_path, timeout=bound(600))
    # The installed package ships everything the source package has.
    site = subprocess.run([str(vbin / "python"), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          env=env, cwd=tmp_path, check=True, capture_output=True, text=True).stdout.strip()
    installed = {os.path.relpath(os.path.join(d, f), site) for d, _, fs in os.walk(os.path.join(site, "shmq"))
                 for f in fs if "__pycache__" not in d}
    py, _plat, arch = wheel_tags(wheel)
    assert installed == wheel_package_files(py, arch)
    assert os.access(vbin / "shmq", os.X_OK)  # the console script
    demo = subprocess.run([str(vbin / "python"), "-m", "shmq", "demo"], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=bound(300))
    assert demo.returncode == 0, demo.stdout + demo.stderr
    for method in ("fork", "spawn"):
        smoke = subprocess.run([str(vbin / "python"), "-c", SMOKE, str(venv), method], env=env, cwd=tmp_path,
                               capture_output=True, text=True, timeout=bound(300))
        assert smoke.returncode == 0 and "smoke ok" in smoke.stdout, smoke.stdout + smoke.stderr
    print(f"{os.path.basename(wheel)}: installed with PATH={vbin} (no compiler), demo and smoke ok; "
          f"demo's last line: {demo.stdout.strip().splitlines()[-1]}")


@needs_wheels
@pytest.mark.skipif(not ARM64_ROOT or not shutil.which("qemu-aarch64-static"),
                    reason="no arm64 root (SHMQ_WHEELS_ARM64_ROOT) or no qemu-aarch64-static")
def test_aarch64_wheel_imports_under_qemu(tmp_path):
    found = [w for w in WHEELS if wheel_tags(w)[0] == "cp311" and wheel_tags(w)[2] == "aarch64"]
    if not found:  # Debian 12's arm64 CPython is 3.11
        pytest.skip("no cp311 aarch64 wheel (CPython 3.11 absent at build time)")
    (wheel,) = found
    target = tmp_path / "site"
    # pip installs the aarch64 wheel and its dependencies' aarch64 wheels for CPython 3.11
    # into a plain directory; the arm64 python3.11 then runs with it on its path.
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--only-binary=:all:", "--target", str(target),
                    "--platform", "manylinux2014_aarch64", "--python-version", "3.11",
                    "--implementation", "cp", wheel], check=True, timeout=bound(600))
    py = os.path.join(ARM64_ROOT, "usr", "bin", "python3.11")
    env = dict(os.environ, PYTHONPATH=str(target))
    r = subprocess.run(["qemu-aarch64-static", "-L", ARM64_ROOT, py, "-c",
                        "import platform; assert platform.machine() == 'aarch64', platform.machine()\n" + SMOKE,
                        str(target), "fork"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=bound(600))
    assert r.returncode == 0 and "smoke ok" in r.stdout and "aarch64-linux-gnu.so" in r.stdout, r.stdout + r.stderr
    print(f"{os.path.basename(wheel)} under qemu-aarch64-static: {r.stdout.strip()}")
