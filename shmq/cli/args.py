"""Argument types and shared parser pieces of the ``shmq`` command line."""

from __future__ import annotations

import argparse

FORMATS = ("auto", "raw", "hex", "json", "repr")
EPILOG = ("PATH is a spool file; a bare name (no slash) means /dev/shm/shmq-UID/NAME, your "
          "private directory (docs/security.md).  "
          "Exit codes: 0 ok, 1 fsck problems, 2 usage, 3 not found, 4 not a spool, "
          "5 corrupt, 6 permission denied, 7 busy, 8 full, 9 frame lost, "
          "10 exists, 11 other error.  See docs/cli.md.")


def formatter(prog):
    return argparse.RawDescriptionHelpFormatter(prog, max_help_position=32)


def mode_arg(text):
    try:
        mode = int(text, 8)
    except ValueError:
        raise argparse.ArgumentTypeError(f"mode must be octal like 0660, not {text!r}") from None
    if not 0 <= mode <= 0o7777:
        raise argparse.ArgumentTypeError(f"mode {text} is out of range")
    return mode


def position_arg(text):
    if text in ("earliest", "latest"):
        return text
    try:
        seq = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected 'earliest', 'latest' or a seq number, not {text!r}") from None
    if seq < 0:
        raise argparse.ArgumentTypeError("a seq is a non-negative integer")
    return seq


def positive_arg(kind):
    def parse(text):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, not {text!r}") from None
        if v <= 0:
            raise argparse.ArgumentTypeError(f"expected a positive number, not {text}")
        return v
    return parse


def count_arg(text):
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, not {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError("expected a non-negative integer")
    return v

