"""The ``shmq`` command line (``python -m shmq``): create, inspect, tail, repair, export.

stdlib only (argparse, termios for ``top``): the core library stays free of
CLI dependencies.  Every subcommand has ``--help``; exit codes are listed
in :data:`EXIT_CODES` and in docs/cli.md.  Errors are one line on stderr
(set ``SHMQ_DEBUG=1`` for a traceback).

The package is split by what each part owns: :mod:`.base` (exit codes,
error classification), :mod:`.fmt` and :mod:`.render` (output), :mod:`.args`
and :mod:`.parser` (arguments), and one module per command family.
"""

from __future__ import annotations

import argparse
import os
import sys

# re-exported: the exit codes are part of the CLI's contract
from ..errors import ShmqError
from .base import (
    EXIT_BUSY, EXIT_CODES, EXIT_CORRUPT, EXIT_ERROR, EXIT_EXISTS, EXIT_FULL, EXIT_INTERRUPTED,
    EXIT_LOST, EXIT_NOT_FOUND, EXIT_NOT_SPOOL, EXIT_OK, EXIT_PERMISSION, EXIT_PIPE, EXIT_PROBLEMS,
    EXIT_USAGE, CliError, classify, resolve,
)
from .fmt import SPARK
from .manage import cmd_dispatch
from .parser import build_parser

__all__ = [
    "main", "build_parser", "CliError", "classify", "SPARK", "EXIT_CODES", "EXIT_OK", "EXIT_PROBLEMS",
    "EXIT_USAGE", "EXIT_NOT_FOUND", "EXIT_NOT_SPOOL", "EXIT_CORRUPT", "EXIT_PERMISSION", "EXIT_BUSY",
    "EXIT_FULL", "EXIT_LOST", "EXIT_EXISTS", "EXIT_ERROR", "EXIT_INTERRUPTED", "EXIT_PIPE",
]


def main(argv=None) -> int:
    """Run the command line; return the exit code (never raises SystemExit)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    extra = parser.readers_verbs
    use = parser
    if len(argv) >= 2 and argv[0] == "readers" and argv[1] in extra:
        use, argv = extra[argv[1]], argv[2:]
    if argv[:1] == ["put"]:
        use, argv = parser.put_parser, argv[1:]
    if argv[:1] == ["dispatch"]:  # everything after it is the dispatcher CLI's
        return cmd_dispatch(argparse.Namespace(args=argv[1:]))
    try:
        args = use.parse_intermixed_args(argv) if use is parser.put_parser else use.parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error (2)
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    name = getattr(args, "command", None) or "shmq"
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader of our stdout went away (e.g. `shmq tail ... | head`).
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except OSError:
            pass
        return EXIT_PIPE
    except Exception as exc:
        if os.environ.get("SHMQ_DEBUG"):
            raise
        spool = None
        if isinstance(getattr(args, "path", None), str):
            try:
                spool = resolve(args.path)
            except (TypeError, ValueError, ShmqError):
                pass
        code, message = classify(exc, spool)
        print(f"shmq {name}: {message}", file=sys.stderr)
        return code
