"""``shmq metrics``: the spools' Prometheus metrics, printed once or served over HTTP."""

from __future__ import annotations

import os
import signal
import sys
import threading

from .. import _mapping
from .base import EXIT_ERROR, EXIT_NOT_FOUND, EXIT_OK, EXIT_USAGE, CliError, resolve_target


def parse_addr(text):
    """``HOST:PORT``, ``[IPv6]:PORT`` or a bare ``PORT`` (loopback) -> (host, port)."""
    host, sep, port = text.rpartition(":")
    if not sep:
        host, port = "127.0.0.1", text
    host = host.strip("[]") or "127.0.0.1"
    try:
        port = int(port)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise CliError(f"--serve expects HOST:PORT (e.g. 127.0.0.1:9464), not {text!r}",
                       EXIT_USAGE)
    return host, port


def cmd_metrics(a) -> int:
    targets = [resolve_target(t) for t in (a.targets or [_mapping.default_dir()])]
    for t in targets:
        if not os.path.exists(t) and t != _mapping.default_dir():
            raise CliError(f"{t}: no such spool or directory", EXIT_NOT_FOUND)
    addr = parse_addr(a.serve) if a.serve else None
    try:
        from prometheus_client import CollectorRegistry, generate_latest, start_http_server
    except ImportError:
        raise CliError("needs prometheus_client: pip install 'shmq[metrics]'", EXIT_ERROR) from None
    from ..metrics import ShmqCollector

    registry = CollectorRegistry()
    registry.register(ShmqCollector(targets))
    if addr is None:
        sys.stdout.write(generate_latest(registry).decode())
        return EXIT_OK
    httpd, _thread = start_http_server(addr[1], addr[0], registry=registry)
    host, port = httpd.server_address[:2]
    shown = f"[{host}]" if ":" in host else host
    print(f"shmq metrics: serving {', '.join(targets)} on http://{shown}:{port}/metrics "
          "(Ctrl-C or SIGTERM stops)", file=sys.stderr, flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        while not stop.wait(3600):  # the server runs in its own thread; wake on SIGTERM
            pass
    except KeyboardInterrupt:
        pass
    finally:
        httpd.shutdown()
        httpd.server_close()
    return EXIT_OK


def register(add):
    """Add ``metrics`` to the ``shmq`` parser."""
    p = add("metrics", "print or serve the spools' Prometheus metrics",
            description="Print the Prometheus metrics of the spools in DIR (default "
            "/dev/shm/shmq-UID) or of the given spools once, or with --serve ADDR serve them over "
            "HTTP at /metrics until Ctrl-C or SIGTERM (each scrape re-reads the spools, so "
            "spools created later are picked up).  Needs prometheus_client "
            "(pip install 'shmq[metrics]').")
    p.add_argument("targets", nargs="*", metavar="DIR|PATH")
    p.add_argument("--serve", metavar="ADDR", help="HOST:PORT to listen on (a bare PORT binds "
                   "127.0.0.1; 0.0.0.0:PORT exposes it to the network; PORT 0 picks a free one)")
    p.set_defaults(func=cmd_metrics)
