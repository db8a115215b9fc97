"""Every argparse program in the repository starts and prints its help on this Python.

CPython 3.14 checks each help string when the argument is added (a stray ``%``
raises ``ValueError: badly formed help string``), and every version fails the
same way when that help is formatted.  So each program runs with ``--help`` in a
child interpreter under a driver that records every ``ArgumentParser`` built
(subcommands' and side parsers' too) and, when the program exits, formats the
help of each one: a bad help string fails here on 3.11 as on 3.14.

The programs are found, not listed: every ``.py`` under ``stress/``, ``.ci/``
and ``examples/`` that builds an ``ArgumentParser``, plus the package's own
command lines (``python -m shmq``, ``python -m shmq.dispatch``).
"""

import glob
import os
import subprocess
import sys
import textwrap

import pytest

from conftest import bound

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: Run in the child: ``DRIVER PROGRAM ARG...`` where PROGRAM is a path or ``-m MODULE``.
#: Prints "formatted N parsers" on stderr after the program's own exit.
DRIVER = textwrap.dedent("""
    import argparse, runpy, sys
    built = []
    init = argparse.ArgumentParser.__init__
    def recording_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        built.append(self)
    argparse.ArgumentParser.__init__ = recording_init
    if sys.argv[1] == "-m":
        target, sys.argv = sys.argv[2], [sys.argv[2]] + sys.argv[3:]
        run = lambda: runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        target, sys.argv = sys.argv[1], sys.argv[1:]
        sys.path.insert(0, __import__("os").path.dirname(target))
        run = lambda: runpy.run_path(target, run_name="__main__")
    code = 0
    try:
        run()
    except SystemExit as exc:
        code = exc.code
    for p in built:  # every parser, including those --help never reached
        p.format_help()
    print(f"formatted {len(built)} parsers", file=sys.stderr)
    sys.exit(code)
""")


def _argparse_programs():
    found = []
    for pattern in ("stress/*.py", ".ci/*.py", "examples/*.py"):
        for path in sorted(glob.glob(os.path.join(ROOT, pattern))):
            with open(path, encoding="utf-8") as f:
                if "ArgumentParser(" in f.read():
                    found.append(os.path.relpath(path, ROOT))
    return found


PROGRAMS = [("-m", "shmq"), ("-m", "shmq.dispatch")] + [(p,) for p in _argparse_programs()]


def _run_help(program, cwd):
    return subprocess.run([sys.executable, "-c", DRIVER, *program, "--help"], cwd=cwd,
                          capture_output=True, text=True, timeout=bound(120))


def test_the_programs_are_found():
    # the discovery itself: soak.py (whose help once held a bare %) and the other
    # stress programs are among them, so a glob gone wrong cannot pass silently
    names = {p[-1] for p in PROGRAMS}
    assert {"stress/soak.py", "stress/tsan.py", ".ci/wheelbench.py", "shmq"} <= names
    assert len(names) >= 20


@pytest.mark.parametrize("program", PROGRAMS, ids=[p[-1] for p in PROGRAMS])
def test_program_prints_help(program):
    proc = _run_help(program, ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.stdout.lstrip().startswith("usage:"), proc.stdout[:500]
    built = int(proc.stderr.rsplit("formatted ", 1)[1].split()[0])
    assert built >= 1, proc.stderr


def test_a_bare_percent_fails_on_every_version(tmp_path):
    # the driver's own check: a help string with an unescaped % fails on 3.11-3.13
    # (when formatted) as on 3.14+ (when added), even in a subcommand --help skips
    prog = tmp_path / "bad.py"
    prog.write_text("import argparse\n"
                    "p = argparse.ArgumentParser()\n"
                    "s = p.add_subparsers().add_parser('sub')\n"
                    "s.add_argument('--growth', help='% per minute')\n"
                    "p.parse_args()\n")
    proc = _run_help((str(prog),), tmp_path)
    assert proc.returncode != 0
    assert "ValueError" in proc.stderr or "TypeError" in proc.stderr, proc.stderr[-2000:]
