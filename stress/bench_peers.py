"""The IPC a Python user would pick instead of shmq, raced by stress/bench.py:
pyzmq PUSH/PULL over ``ipc://``, ``posix_ipc.MessageQueue``, and iceoryx2's
publish/subscribe with loaned samples.

Each is optional: when its package is missing (or the system's limits rule a
row out) ``unavailable`` says so and the row prints that reason.  See
bench_contenders.py for the contender protocol.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import time
import uuid

from bench_contenders import CTX, Contender, distinct

try:
    import zmq
except ImportError:  # optional peer
    zmq = None
try:
    import posix_ipc
except ImportError:  # a core dependency of shmq, but the row must never crash
    posix_ipc = None
try:
    import iceoryx2 as iox2

    iox2.set_log_level(iox2.LogLevel.Error)  # it announces "no config file" otherwise
    try:
        from importlib.metadata import version as _version

        IOX_STATUS = _version("iceoryx2")
    except Exception:  # installed some other way than pip
        IOX_STATUS = "installed"
except ImportError as e:  # optional peer; `pip install iceoryx2` brings a prebuilt wheel
    iox2 = None
    IOX_STATUS = f"not installed ({e}; pip install iceoryx2)"

CONNECT_TIMEOUT_S = 30.0


def mqueue_limits():
    """The kernel's POSIX message queue limits an unprivileged process gets."""
    limits = {}
    for key in ("msg_max", "msgsize_max", "queues_max"):
        try:
            with open(f"/proc/sys/fs/mqueue/{key}") as f:
                limits[key] = int(f.read())
        except (OSError, ValueError):
            limits[key] = None
    return limits


def versions():
    return {"pyzmq": zmq.__version__ if zmq else "not installed",
            "libzmq": zmq.zmq_version() if zmq else None,
            "posix_ipc": getattr(posix_ipc, "VERSION", "installed") if posix_ipc else "not installed",
            "mqueue_limits": mqueue_limits(), "iceoryx2": IOX_STATUS}


class PyZmq(Contender):
    """PUSH -> PULL over ipc:// (a Unix socket in the run's private temp dir).

    The batch variant sends each batch as one multipart message (zmq's atomic
    batch).  The consumer binds; each producer connects and sends one warm-up
    message before the start line, so connecting is not timed.
    """

    def __init__(self, batch=False):
        self.batch = batch
        self.name = "pyzmq-batch" if batch else "pyzmq"

    def unavailable(self, sc):
        if zmq is None:
            return "not installed (pip install pyzmq)"
        if sc.consumers != 1 or sc.kind != "bytes":
            return "n/a (one PULL socket, bytes)"
        return None

    def setup(self, tmp, sc):
        path = os.path.join(tmp, f"zmq-{time.monotonic_ns()}.sock")
        return {"addr": f"ipc://{path}", "path": path, "bound": CTX.Event(), "drained": CTX.Event()}

    def open(self, chan, role, index, sc):
        ctx = zmq.Context()
        if role == "producer":
            if not chan["bound"].wait(CONNECT_TIMEOUT_S):
                raise RuntimeError("the PULL socket was not bound in time")
            s = ctx.socket(zmq.PUSH)
            s.connect(chan["addr"])
            s.send(b"warm-up")
        else:
            s = ctx.socket(zmq.PULL)
            s.bind(chan["addr"])
            chan["bound"].set()
            for _ in range(sc.producers):
                if not s.poll(CONNECT_TIMEOUT_S * 1000):
                    raise RuntimeError("no producer connected in time")
                s.recv()
        return ctx, s, chan["drained"]

    def producer(self, h, item, n, sc):
        s = h[1]
        if self.batch:
            items = distinct(item, sc.batch)
            for _ in range(n // sc.batch):
                s.send_multipart(items)
        else:
            send = s.send
            for _ in range(n):
                send(item)

    def consumer(self, h, n, index, sc):
        s = h[1]
        got = 0
        if self.batch:
            while got < n:
                got += len(s.recv_multipart())
        else:
            recv = s.recv
            for _ in range(n):
                recv()
        h[2].set()

    def close(self, h):
        ctx, s, drained = h
        # A PUSH socket closed (even with linger=-1) and its context ended right
        # after the last send lost the last message in about 1 run of 15 here:
        # the producer keeps its socket until the consumer has everything.
        if not drained.wait(CONNECT_TIMEOUT_S):
            raise RuntimeError("the consumer did not drain in time")
        s.close(linger=0)
        ctx.term()

    def teardown(self, chan):
        try:
            os.unlink(chan["path"])
        except FileNotFoundError:
            pass


class PosixMQ(Contender):
    """posix_ipc.MessageQueue: the kernel's queue, sized by the system's limits
    (depth ``msg_max``, messages of the payload's size).  Raising the limits
    needs root (fs.mqueue sysctls), which most users do not have."""

    name = "posix-mq"

    def unavailable(self, sc):
        if posix_ipc is None:
            return "not installed (pip install posix_ipc)"
        if sc.kind != "bytes":
            return "n/a (bytes only)"
        limit = mqueue_limits()["msgsize_max"]
        if limit is not None and sc.size > limit:
            return f"n/a ({sc.size} B messages > fs.mqueue.msgsize_max {limit} B)"
        return None

    def setup(self, tmp, sc):
        name = f"/shmq-bench-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        depth = mqueue_limits()["msg_max"] or 10
        mq = posix_ipc.MessageQueue(name, posix_ipc.O_CREX, max_messages=depth,
                                    max_message_size=max(1, sc.size))
        mq.close()
        return name

    def open(self, name, role, index, sc):
        return posix_ipc.MessageQueue(name)

    def producer(self, mq, item, n, sc):
        send = mq.send
        for _ in range(n):
            send(item)

    def consumer(self, mq, n, index, sc):
        receive = mq.receive
        for _ in range(n):
            receive()

    def close(self, mq):
        mq.close()

    def teardown(self, name):
        try:
            posix_ipc.unlink_message_queue(name)
        except posix_ipc.ExistentialError:
            pass


class Iceoryx2(Contender):
    """iceoryx2 publish/subscribe of byte slices with a loan: the publisher writes
    the payload straight into a loaned sample (one copy), the subscriber copies
    it out into ``bytes`` (as shmq's get() does) and releases the sample.

    No loss: safe overflow off and the publisher retries until delivered.  The
    subscriber busy-polls ``receive()`` (as the inline ring does).
    """

    name = "iceoryx2"

    def unavailable(self, sc):
        if iox2 is None:
            return IOX_STATUS
        if sc.producers != 1 or sc.consumers != 1 or sc.kind != "bytes":
            return "n/a (1->1 bytes only)"
        return None

    def setup(self, tmp, sc):
        # A prefix of our own for every iceoryx2 file of this run, so teardown can
        # remove what iceoryx2 leaves behind by design (its global management
        # segment in /dev/shm) without touching another iceoryx2 user's files.
        tag = uuid.uuid4().hex[:12]
        return {"service": f"shmq-bench-{tag}", "prefix": f"iox2_shmqbench_{tag}_",
                "subscribed": CTX.Event(), "drained": CTX.Event()}

    @staticmethod
    def _service(node, name):
        return (node.service_builder(iox2.ServiceName.new(name))
                .publish_subscribe(iox2.Slice[ctypes.c_uint8])
                .enable_safe_overflow(False)
                .subscriber_max_buffer_size(4)
                .history_size(0)
                .open_or_create())

    def open(self, chan, role, index, sc):
        cfg = iox2.config.default()
        cfg.global_cfg.prefix = iox2.FileName.new(chan["prefix"])
        node = iox2.NodeBuilder.new().config(cfg).create(iox2.ServiceType.Ipc)
        svc = self._service(node, chan["service"])
        if role == "producer":
            port = (svc.publisher_builder().initial_max_slice_len(sc.size)
                    .backpressure_strategy(iox2.BackpressureStrategy.RetryUntilDelivered).create())
            if not chan["subscribed"].wait(CONNECT_TIMEOUT_S):
                raise RuntimeError("no subscriber in time")
            port.update_connections()
        else:
            port = svc.subscriber_builder().create()
            chan["subscribed"].set()
        # One holder owns node, service and port, so close() can drop them in order.
        return {"port": port, "service": svc, "node": node, "drained": chan["drained"]}

    def producer(self, h, item, n, sc):
        pub = h["port"]
        size = len(item)
        for _ in range(n):
            sample = pub.loan_slice_uninit(size)
            sample.payload().as_memory_view().cast("B")[:] = item
            sample.assume_init().send()

    def consumer(self, h, n, index, sc):
        sub = h["port"]
        got = 0
        while got < n:
            sample = sub.receive()
            if sample is None:
                continue
            bytes(sample.payload().as_memory_view())
            sample.delete()
            got += 1
        h["drained"].set()

    def close(self, h):
        if "drained" in h and not h["drained"].wait(CONNECT_TIMEOUT_S):
            raise RuntimeError("the subscriber did not drain in time")  # the publisher keeps samples alive
        # Dropping the port, then the service, then the node removes their shared
        # memory and the node's files (a process that exits without it leaves them).
        h.pop("port").delete()
        h.pop("service")
        h.pop("node")

    def teardown(self, chan):
        # Every node of the run is gone (close() dropped them): what is left with our
        # prefix is iceoryx2's own bookkeeping, in /dev/shm and under its root path.
        root = iox2.config.default().global_cfg.root_path.to_string()
        for d in ("/dev/shm", root):
            for name in os.listdir(d) if os.path.isdir(d) else ():
                if name.startswith(chan["prefix"]):
                    p = os.path.join(d, name)
                    shutil.rmtree(p) if os.path.isdir(p) and not os.path.islink(p) else os.unlink(p)
