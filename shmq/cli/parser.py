"""The ``shmq`` argument parser, assembled from each command family's ``register``."""

from __future__ import annotations

import argparse

from . import bench, frames, gc, manage, metrics, net, readers, recover, stat, tail, tee, top
from .args import EPILOG, formatter


def build_parser() -> argparse.ArgumentParser:
    """The ``shmq`` parser.

    ``parser.readers_verbs`` maps "rm"/"seek"/"list" to the parsers of
    ``shmq readers VERB ...`` (argparse cannot mix a positional PATH with
    sub-verbs); ``parser.put_parser`` parses ``put`` with intermixed options.
    """
    from .. import __version__

    parser = argparse.ArgumentParser(
        prog="shmq", description="Create, inspect, tail, repair and move shmq spools.",
        epilog=EPILOG, formatter_class=formatter)
    parser.add_argument("--version", action="version", version=f"shmq {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    def add(name, help, description=None, epilog=None):
        return sub.add_parser(name, help=help, description=description or help.capitalize() + ".",
                              epilog=epilog, formatter_class=formatter)

    manage.register(add)
    gc.register(add)
    stat.register(add)
    top.register(add)
    tail.register(add)
    parser.put_parser = frames.register(add)
    parser.readers_verbs = readers.register(add)
    recover.register(add)
    tee.register(add)
    net.register(add)
    bench.register(add)
    metrics.register(add)
    return parser
