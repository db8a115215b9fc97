"""Operating spools from the command line: the CLI package's error mapping, damaged spools,
recovery without debris, and the operator commands (driven as a user would, via
``python -m shmq``)."""

import os
import pickle
import subprocess
import sys

import pytest

import shmq
from shmq import cli
from shmq.dump import DumpError, NotADump
from shmq.errors import (
    Empty, FrameLost, Full, LeaseLost, NotASpool, ReaderBusy, ShmqError, SpoolFormatError, Timeout,
    TooLarge,
)


def shmq_cmd(*args, timeout=60, **kw):
    return subprocess.run([sys.executable, "-m", "shmq", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, **kw)


def one_error_line(err):
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


# --- errors carry their kind ------------------------------------------------------------

@pytest.mark.parametrize("cls, code", [
    (Full, cli.EXIT_FULL), (Timeout, cli.EXIT_FULL), (TooLarge, cli.EXIT_FULL),
    (FrameLost, cli.EXIT_LOST), (SpoolFormatError, cli.EXIT_CORRUPT),
    (NotASpool, cli.EXIT_NOT_SPOOL), (ReaderBusy, cli.EXIT_BUSY), (DumpError, cli.EXIT_CORRUPT),
    (NotADump, cli.EXIT_NOT_SPOOL), (ShmqError, cli.EXIT_ERROR), (Empty, cli.EXIT_ERROR),
    (LeaseLost, cli.EXIT_ERROR)])
def test_exit_code_follows_the_error_kind_not_its_message(cls, code):
    # the message says something misleading on purpose: only the kind may decide
    exc = cls("not a shmq spool; symbolic link; is full")
    assert cli.classify(exc)[0] == code
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is cls and back.kind == exc.kind


def test_symlink_is_not_a_spool(spool_dir, make_spool):
    sp = make_spool(name="real")
    link = os.path.join(spool_dir, "link")
    os.symlink(sp.path, link)
    with pytest.raises(NotASpool, match="symbolic link"):
        shmq.Spool.open(link)
    res = shmq_cmd("stat", link)
    assert res.returncode == cli.EXIT_NOT_SPOOL and "symbolic link" in one_error_line(res.stderr)


def test_version():
    res = shmq_cmd("--version")
    assert res.returncode == 0 and res.stdout.strip() == f"shmq {shmq.__version__}"
