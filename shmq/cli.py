"""The ``shmq`` command line (``python -m shmq``)."""

from __future__ import annotations

import argparse
import sys


def _cmd_demo(args) -> int:
    from .demo import run

    return run(seconds=args.seconds, writers=args.writers, capacity=args.capacity)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shmq", description="Inspect and operate shmq spools.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo = sub.add_parser("demo", help="run a live demo of writers and readers over a spool")
    demo.add_argument("--seconds", type=float, default=5.0, help="how long to run (default 5)")
    demo.add_argument("--writers", type=int, default=2, help="writer processes (default 2)")
    demo.add_argument("--capacity", default="4MiB", help="ring size (default 4MiB)")
    demo.set_defaults(func=_cmd_demo)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return 2
    return args.func(args)
