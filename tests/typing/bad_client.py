"""Wrong uses of shmq's API that the type check must reject (tests/test_typing.py).

Each line ending in ``# E`` must get exactly one mypy error, and no other line may
get one: proof that the check of tests/typing/client.py can fail.  Never run.
"""

from __future__ import annotations

import shmq
from shmq.dispatch import Context, Dispatcher


def misuse(sp: shmq.Spool, q: shmq.Queue, wq: shmq.WorkQueue, d: Dispatcher) -> None:
    sp.put("text is not bytes-like")  # E
    sp.put(b"x", timeout="soon")  # E
    seq: str = sp.put(b"x")  # E
    frame = sp.reader().get()
    frame.seq.decode()  # E
    sp.reader("name", group=True).committed  # E
    shmq.Spool.create("x", capacity=[1])  # E
    n: int = sp.reader().get_many()  # E
    msg: str = wq.get()  # E
    wq.put("x", key=42)  # E
    d.publish(1, "body")  # E
    q.get_many("ten")  # E
    ctx: Context = d  # E
    print(seq, n, msg, ctx)


def misuse_service(svc: shmq.Service, cl: shmq.Client) -> None:
    shmq.Client("svc", window="8")  # E
    cl.call("x", timeout="soon")  # E
    replies: str = cl.call_many(["a"])  # E
    svc.serve(print, workers="2")  # E
    call_id: str = svc.get().id  # E
    print(replies, call_id)
