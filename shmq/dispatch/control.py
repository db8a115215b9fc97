"""Remote control of a running dispatcher: its socket, the client calls, the CLI.

A running supervisor listens on an abstract Unix socket named after the
real path's hash (no file to clean up; the kernel frees the name when the
process dies).  One JSON request per connection, one JSON reply; only the
same user (or root) is served (``SO_PEERCRED``).
"""

from __future__ import annotations

import argparse
import errno
import hashlib
import json
import os
import socket
import struct
import sys
from typing import TYPE_CHECKING, Any

from .._mapping import resolve_path
from ..errors import ShmqError
from .board import format_status, status

if TYPE_CHECKING:
    from _typeshed import StrPath

_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def control_address(path):
    """The abstract socket name of the dispatcher on ``path``."""
    real = os.path.realpath(resolve_path(path))
    return "\0shmq-dispatch-" + hashlib.sha256(real.encode()).hexdigest()[:40]


def listen(path):
    """Bind the control socket of ``path`` (non-blocking, listening).

    :raises shmq.ShmqError: another process already listens for ``path``.
    """
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        s.bind(control_address(path))
    except OSError as exc:
        s.close()
        if exc.errno == errno.EADDRINUSE:
            raise ShmqError(f"another process is listening for dispatcher commands on "
                            f"{path}") from None
        raise
    s.listen(8)
    s.setblocking(False)
    return s


def serve_one(sock, command):
    """Accept one pending connection on ``sock`` and answer it with ``command(request)``.

    Never raises for a bad client: errors become ``{"ok": false, "error": ...}``.
    """
    try:
        conn, _ = sock.accept()
    except (BlockingIOError, InterruptedError):
        return
    with conn:
        try:
            conn.settimeout(2.0)
            cred = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size)
            _pid, uid, _gid = _CRED.unpack(cred)
            if uid not in (os.geteuid(), 0):
                conn.sendall(b'{"ok": false, "error": "permission denied"}\n')
                return
            data = b""
            while not data.endswith(b"\n") and len(data) < 65536:
                chunk = conn.recv(4096)
                if not chunk:
                    break
                data += chunk
            req = json.loads(data or b"{}")
            reply = command(req)
        except Exception as exc:
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        try:
            conn.sendall(json.dumps(reply).encode() + b"\n")
        except OSError:
            pass


def request(path, req, timeout=5.0):
    """Send ``req`` to the dispatcher running on ``path``; return its reply.

    :raises shmq.ShmqError: none runs there, it closed without replying, or it refused.
    """
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        s.settimeout(timeout)
        try:
            s.connect(control_address(path))
        except (ConnectionRefusedError, FileNotFoundError):
            raise ShmqError(f"no dispatcher is running on {resolve_path(path)}") from None
        s.sendall(json.dumps(req).encode() + b"\n")
        data = b""
        while not data.endswith(b"\n"):
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    finally:
        s.close()
    if not data:
        raise ShmqError("the dispatcher closed the connection without replying")
    reply = json.loads(data)
    if not reply.get("ok"):
        raise ShmqError(f"dispatcher refused: {reply.get('error')}")
    return reply


def scale(path: StrPath, type: str, n: int, timeout: float = 5.0) -> dict[str, Any]:
    """Ask the dispatcher running on ``path`` to run ``n`` workers for ``type``.

    :raises shmq.ShmqError: no dispatcher is running there, or it refused.
    """
    return request(path, {"op": "scale", "type": type, "n": n}, timeout)


def stop(path: StrPath, grace: float | None = None, timeout: float = 5.0) -> dict[str, Any]:
    """Ask the dispatcher running on ``path`` to stop (as SIGTERM would).

    :raises shmq.ShmqError: no dispatcher is running there, or it refused.
    """
    return request(path, {"op": "stop", "grace": grace}, timeout)


def main(argv: list[str] | None = None, prog: str = "python -m shmq.dispatch") -> int:
    """``python -m shmq.dispatch {scale PATH TYPE N | status PATH [--json] | stop PATH}``
    (``shmq dispatch ...`` passes its own ``prog``)."""
    p = argparse.ArgumentParser(prog=prog,
                                description="Control and inspect a running shmq Dispatcher.")
    sub = p.add_subparsers(dest="cmd", required=True)
    sp = sub.add_parser("scale", help="set the number of workers of a message type")
    sp.add_argument("path")
    sp.add_argument("type")
    sp.add_argument("n", type=int)
    sp.add_argument("--timeout", type=float, default=5.0)
    st = sub.add_parser("status", help="workers, counters, latencies and queue depths per type")
    st.add_argument("path")
    st.add_argument("--json", action="store_true")
    st.add_argument("--no-queues", action="store_true", help="skip queue depths")
    so = sub.add_parser("stop", help="stop the dispatcher (running handlers get the grace period)")
    so.add_argument("path")
    so.add_argument("--grace", type=float, default=None)
    so.add_argument("--timeout", type=float, default=5.0)
    args = p.parse_args(argv)
    try:
        if args.cmd == "scale":
            r = scale(args.path, args.type, args.n, timeout=args.timeout)
            print(f"{args.type}: {r['previous']} -> {r['target']} workers")
        elif args.cmd == "stop":
            stop(args.path, grace=args.grace, timeout=args.timeout)
            print("stopping")
        else:
            s = status(args.path, queues=not args.no_queues)
            print(json.dumps(s, indent=2) if args.json else format_status(s))
    except FileNotFoundError:
        print(f"error: no dispatcher has run on {resolve_path(args.path)}", file=sys.stderr)
        return 1
    except (ShmqError, OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0
