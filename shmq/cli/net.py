"""``shmq pub SPOOL tcp://...`` and ``shmq sub tcp://... SPOOL``: a spool across hosts over
ZeroMQ (kvspool's kvsp-pub/kvsp-sub), resumable without loss.

Protocol (one ROUTER socket on the publisher, bound only where told; one
DEALER per subscriber; every message is a multipart ZeroMQ message whose
first part is the command):

- sub -> pub ``HELLO {"name": N, "from": SEQ|null}``: attach (or re-attach)
  subscriber N, starting at source seq SEQ (null: where its cursor is).
  The publisher keeps a durable named reader ``pub-N`` on its spool.
- pub -> sub ``WELCOME {"start": S, "lost": K}``: frames will start at S;
  K frames the subscriber asked for are no longer in the spool (exact loss).
- pub -> sub ``FRAMES {"n": n}``, then a header part (n x ``<QQB``: seq,
  timestamp, codec), then n payload parts.  One batch in flight per
  subscriber: the next goes after its ACK.
- sub -> pub ``ACK {"next": SEQ}``: frames before SEQ are stored; the
  publisher commits ``pub-N`` there (in a block-policy spool, writers wait
  for subscribers that are behind, as for any named reader).
- pub -> sub ``HB`` every second without frames; a subscriber that hears
  nothing for ``--silence`` seconds says HELLO again (the publisher may
  have restarted).  ``ERROR {"message": ...}`` ends the session.

The subscriber stores frames through a :class:`~shmq.cli.ledger.Ledger`,
so frames it already holds (a re-sent batch, a restart) are dropped by
seq: exactly once, whoever was killed.  It copies payload bytes and codec
tags and never unpickles them, and it marks its spool as fed from the
network (:func:`shmq._format.from_network`), so ``shmq.Queue`` refuses to
unpickle from it unless the caller passes ``trusted=True``.

CURVE (``--curve-secret``/``--curve-clients`` on pub, ``--curve-secret``/
``--curve-server`` on sub; key files as ``zmq.auth.create_certificates``
writes them) authenticates both ends and encrypts the traffic; a publisher
with CURVE on refuses subscribers whose public key is not in its
``--curve-clients`` directory.
"""

from __future__ import annotations

import json
import os
import signal
import struct
import sys
import time

from .. import _format as F
from ..errors import Empty, FrameLost, ShmqError
from .args import positive_arg
from .base import EXIT_ERROR, EXIT_OK, EXIT_USAGE, CliError, open_spool, resolve
from .ledger import Ledger, codec_runs, state_path

HDR = struct.Struct("<QQB")
HEARTBEAT_S = 1.0
POLL_MS = 50  # idle publisher: how often it looks for new frames in the spool


def _zmq():
    try:
        import zmq
        import zmq.auth  # noqa: F401
    except ImportError:
        raise CliError("needs pyzmq: pip install 'shmq[net]'", EXIT_ERROR) from None
    return zmq


def _check_endpoint(ep):
    if not ep.startswith("tcp://") or ":" not in ep[6:]:
        raise CliError(f"expected an endpoint like tcp://127.0.0.1:5555, not {ep!r}", EXIT_USAGE)
    return ep


def _dumps(obj):
    return json.dumps(obj).encode()


def _send(zmq, sock, parts):
    """Send without blocking: a DEALER with no connected peer (publisher down, or the CURVE
    handshake refused) would block send forever.  A dropped HELLO or ACK is repeated (HELLO
    after --silence; an unacknowledged batch is sent again after the new HELLO)."""
    try:
        sock.send_multipart(parts, zmq.NOBLOCK)
    except zmq.Again:
        pass


def _stopper():
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    return stop


# --- publisher ----------------------------------------------------------------------------


class _Sub:
    def __init__(self, ident, name, reader):
        self.ident, self.name, self.reader = ident, name, reader
        self.inflight = None  # seq after the batch in flight
        self.last_sent = time.monotonic()


def cmd_pub(a) -> int:
    zmq = _zmq()
    ep = _check_endpoint(a.endpoint)
    sp = open_spool(a.path)
    ctx = zmq.Context()
    auth = None
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    subs = {}
    sent = 0
    try:
        if a.curve_secret:
            from zmq.auth.thread import ThreadAuthenticator

            if not a.curve_clients or not os.path.isdir(a.curve_clients):
                raise CliError("--curve-secret needs --curve-clients DIR (the subscribers' "
                               "public keys)", EXIT_USAGE)
            pub_key, sec_key = zmq.auth.load_certificate(a.curve_secret)
            if sec_key is None:
                raise CliError(f"{a.curve_secret}: not a secret key file", EXIT_USAGE)
            auth = ThreadAuthenticator(ctx)
            auth.start()
            auth.configure_curve(domain="*", location=a.curve_clients)
            sock.curve_secretkey, sock.curve_publickey, sock.curve_server = sec_key, pub_key, True
        try:
            sock.bind(ep)
        except zmq.ZMQError as exc:
            raise CliError(f"cannot bind {ep}: {exc}", EXIT_ERROR) from None
        where = sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        print(f"shmq pub: {sp.path} on {where}{' (CURVE)' if auth else ''}", file=sys.stderr,
              flush=True)
        stop = _stopper()
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        while not stop:
            if dict(poller.poll(POLL_MS)).get(sock):
                while True:
                    try:
                        msg = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    _pub_handle(sp, sock, subs, msg)
            now = time.monotonic()
            for s in list(subs.values()):
                if s.inflight is None:
                    sent += _pub_send(sp, sock, s, a.batch)
                if now - s.last_sent >= HEARTBEAT_S:
                    sock.send_multipart([s.ident, b"HB"])
                    s.last_sent = now
    except KeyboardInterrupt:
        pass
    finally:
        for s in subs.values():
            s.reader.close()
        sock.close()
        if auth is not None:
            auth.stop()
        ctx.term()
        sp.close()
    return EXIT_OK


def _pub_handle(sp, sock, subs, msg):
    ident, cmd, body = msg[0], msg[1], (json.loads(msg[2]) if len(msg) > 2 else {})
    if cmd == b"HELLO":
        name = str(body.get("name", "sub"))[:40]
        old = subs.pop(ident, None) or next((s for s in subs.values() if s.name == name), None)
        if old is not None:  # a reconnect: release the reader, attach again
            subs.pop(old.ident, None)
            old.reader.close()
        reader = sp.reader(f"pub-{name}", auto_commit=False)
        want, lost = body.get("from"), 0
        if want is not None:
            if want > sp.next_seq:
                sock.send_multipart([ident, b"ERROR", _dumps({
                    "message": f"the subscriber wants seq {want} but the publisher's spool ends "
                               f"at {sp.next_seq} (was it re-created?)"})])
                reader.close()
                return
            try:
                reader.seek(want)
            except FrameLost:
                reader.seek("earliest")
                lost = reader.position - want
            reader.commit()
        s = _Sub(ident, name, reader)
        subs[ident] = s
        sock.send_multipart([ident, b"WELCOME", _dumps({"start": reader.position, "lost": lost})])
    elif cmd == b"ACK" and ident in subs:
        s = subs[ident]
        if s.inflight is not None and body.get("next") == s.inflight:
            s.reader.commit()  # the subscriber stored everything before ``inflight``
            s.inflight = None


def _pub_send(sp, sock, s, batch):
    from ..dump import record_at

    r = s.reader
    try:
        frames = r.get_many(batch, block=False)
    except Empty:
        return 0
    hdr = bytearray()
    for f in frames:
        try:
            codec = record_at(sp, f.seq).codec
        except ShmqError:
            codec = None  # overwritten since it was read: the bytes are good, not the tag
        hdr += HDR.pack(f.seq, f.timestamp_ns, F.CODEC_RAW if codec is None else codec)
    sock.send_multipart([s.ident, b"FRAMES", _dumps({"n": len(frames)}), bytes(hdr)]
                        + [bytes(f.data) for f in frames], copy=False)
    s.inflight = frames[-1].seq + 1
    s.last_sent = time.monotonic()
    return len(frames)


# --- subscriber ---------------------------------------------------------------------------


def cmd_sub(a) -> int:
    zmq = _zmq()
    ep = _check_endpoint(a.endpoint)
    from .._mapping import mark_from_network

    path = resolve(a.path)
    sp = open_spool(path)
    mark_from_network(path)
    ledger = Ledger(sp, state_path(sp.path, "sub", a.name), f"{ep}#{a.name}")
    src_next, note = ledger.recover()
    if note and not a.quiet:
        print(f"shmq sub: recovered: {note}", file=sys.stderr)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    got = lost = 0
    welcomed = False
    try:
        if a.curve_secret:
            if not a.curve_server:
                raise CliError("--curve-secret needs --curve-server FILE (the publisher's "
                               "public key)", EXIT_USAGE)
            pub_key, sec_key = zmq.auth.load_certificate(a.curve_secret)
            server_key, _ = zmq.auth.load_certificate(a.curve_server)
            if sec_key is None:
                raise CliError(f"{a.curve_secret}: not a secret key file", EXIT_USAGE)
            sock.curve_secretkey, sock.curve_publickey = sec_key, pub_key
            sock.curve_serverkey = server_key
        sock.connect(ep)
        if not a.quiet:
            print(f"shmq sub: {ep} -> {sp.path} as {a.name!r}, from "
                  f"{'its cursor' if src_next is None else f'seq {src_next}'}", file=sys.stderr,
                  flush=True)
        stop = _stopper()
        heard = idle = time.monotonic()
        _send(zmq, sock, [b"HELLO", _dumps({"name": a.name, "from": src_next})])
        while not stop:
            now = time.monotonic()
            if a.timeout and now - idle >= a.timeout:
                break
            if now - heard >= a.silence:  # the publisher went away (or restarted): hello again
                _send(zmq, sock, [b"HELLO", _dumps({"name": a.name, "from": ledger.src_next})])
                heard = now
            if not sock.poll(200):
                continue
            msg = sock.recv_multipart()
            heard = time.monotonic()
            cmd = msg[0]
            if cmd == b"WELCOME":
                body = json.loads(msg[1])
                welcomed = True
                if ledger.src_next is None:
                    ledger.src_next = body["start"]
                if body["lost"]:
                    lost += body["lost"]
                    print(f"shmq sub: lost {body['lost']} frame(s) (seq {body['start'] - body['lost']}"
                          f"..{body['start'] - 1}): no longer in the publisher's spool",
                          file=sys.stderr, flush=True)
                    ledger.src_next = body["start"]
            elif cmd == b"FRAMES":
                n = json.loads(msg[1])["n"]
                hdrs = [HDR.unpack_from(msg[2], i * HDR.size) for i in range(n)]
                items, expect = [], ledger.src_next
                for (seq, _ts, codec), data in zip(hdrs, msg[3:3 + n]):
                    if seq < expect:
                        continue  # already stored (a batch sent again after a reconnect)
                    if seq > expect:
                        lost += seq - expect
                        print(f"shmq sub: lost {seq - expect} frame(s) (seq {expect}..{seq - 1}):"
                              " overwritten in the publisher's spool before they were sent",
                              file=sys.stderr, flush=True)
                    items.append((seq, codec, bytes(data)))  # copied as bytes: never unpickled
                    expect = seq + 1
                for codec, datas, after in codec_runs(items):
                    ledger.append(codec, datas, after)
                if items:
                    got += len(items)
                    idle = time.monotonic()
                _send(zmq, sock, [b"ACK", _dumps({"next": hdrs[-1][0] + 1 if hdrs else
                                                  ledger.src_next})])
            elif cmd == b"ERROR":
                raise CliError(f"publisher refused: {json.loads(msg[1])['message']}", EXIT_ERROR)
    except KeyboardInterrupt:
        pass
    finally:
        sock.close()
        ctx.term()
        sp.close()
    if not welcomed:
        raise CliError(f"no answer from {ep} (is a publisher there, with the same CURVE "
                       "keys?)", EXIT_ERROR)
    if not a.quiet:
        print(f"received {got:,} frame(s) into {path}" + (f"; {lost:,} lost" if lost else ""))
    return EXIT_OK


def register(add):
    """Add ``pub`` and ``sub`` to the ``shmq`` parser."""
    p = add("pub", "publish a spool over ZeroMQ to shmq sub processes",
            description="Serve SPOOL's frames on ENDPOINT (bound only there, e.g. "
            "tcp://127.0.0.1:5555; port * picks one, printed on stderr) to `shmq sub` "
            "subscribers, each through a durable named reader pub-NAME, until Ctrl-C or "
            "SIGTERM.  Needs pyzmq (pip install 'shmq[net]').")
    p.add_argument("path", metavar="SPOOL")
    p.add_argument("endpoint", metavar="ENDPOINT")
    p.add_argument("--batch", type=positive_arg(int), default=1024, metavar="N",
                   help="frames per message (default 1024)")
    p.add_argument("--curve-secret", metavar="FILE", help="this server's secret key file "
                   "(zmq.auth format): CURVE authentication and encryption")
    p.add_argument("--curve-clients", metavar="DIR", help="directory of the public key files "
                   "of the subscribers allowed in")
    p.set_defaults(func=cmd_pub)

    p = add("sub", "copy a published spool from another host into a local spool",
            description="Connect to a `shmq pub` ENDPOINT and store its frames (payload bytes "
            "and codec tags, never unpickled) into the local SPOOL, exactly once across "
            "restarts of either side; frames no longer in the publisher's spool are reported "
            "as lost, exactly.  SPOOL is marked as fed from the network (untrusted for "
            "pickles).  Needs pyzmq (pip install 'shmq[net]').")
    p.add_argument("endpoint", metavar="ENDPOINT")
    p.add_argument("path", metavar="SPOOL")
    p.add_argument("--name", default="sub", metavar="NAME", help="this subscriber's name (its "
                   "reader on the publisher is pub-NAME; default sub)")
    p.add_argument("--timeout", type=positive_arg(float), metavar="S",
                   help="exit after S seconds without a new frame")
    p.add_argument("--silence", type=positive_arg(float), default=3.0, metavar="S",
                   help="say hello again after S seconds without a word from the publisher "
                   "(default 3)")
    p.add_argument("--curve-secret", metavar="FILE", help="this client's secret key file")
    p.add_argument("--curve-server", metavar="FILE", help="the publisher's public key file")
    p.add_argument("-q", "--quiet", action="store_true", help="print nothing but errors")
    p.set_defaults(func=cmd_sub)
