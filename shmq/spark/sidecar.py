"""``call_sidecar``: each Arrow batch of a DataFrame answered by the host's shmq service.

A sidecar is a :class:`shmq.Service` running on every executor host (a
model loaded once per host, in its worker processes).  ``call_sidecar``
maps each partition with ``mapInArrow``: every Arrow batch (sliced to
``batch_rows``) is sent with :meth:`shmq.Client.call_many` to the service
at ``service`` *on the host the task runs on*, and the reply batches make
up the resulting DataFrame.

Guarantees are the service's: every batch gets exactly one reply (a
worker or the whole sidecar killed and restarted mid-call: the task's
client sends the call again, a duplicate answer is dropped), within ``timeout`` seconds per
group of ``window`` batches, or the task fails with :class:`shmq.Timeout`
(and Spark retries it: a retried task resends its batches, which the
handler sees again: make it a pure function of the batch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from _typeshed import StrPath
    from pyspark.sql import DataFrame
    from pyspark.sql.types import StructType

__all__ = ["call_sidecar"]

def _batches(reply, service):
    import pyarrow as pa

    if isinstance(reply, pa.RecordBatch):
        return [reply]
    if isinstance(reply, pa.Table):
        return reply.to_batches()
    raise TypeError(f"sidecar {service!r} answered a {type(reply).__name__}; call_sidecar needs "
                    "a pyarrow.RecordBatch or Table matching the schema")


def call_sidecar(df: DataFrame, service: StrPath, schema: StructType | str, *,
                 batch_rows: int = 10_000, window: int = 2,
                 timeout: float | None = 300.0) -> DataFrame:
    """The DataFrame of the replies of the service ``service`` to ``df``'s Arrow batches.

    ``service``: the service's name or path, the same on every host (a bare
    name lives in the private directory of the user the Spark Python
    workers run as, who must be the sidecar's user).  ``schema``: the
    replies' schema (DDL string or StructType), as for ``mapInArrow``; each
    reply is a ``pyarrow.RecordBatch`` or ``Table`` with those columns, any
    number of rows.  ``batch_rows``: at most this many rows per call;
    ``window``: calls a task keeps in flight (pipelining).

    :raises ValueError: ``batch_rows`` or ``window`` below 1.
    """
    for name, v in (("batch_rows", batch_rows), ("window", window)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1")

    def answer(batches):
        import shmq

        # One client (one reply queue) per task, closed when the task's
        # iterator ends: Spark ends idle Python workers without exit handlers,
        # so a client cached in the worker would leave its reply queue behind.
        with shmq.Client(service) as cl:
            out = []
            for b in batches:
                for off in range(0, b.num_rows, batch_rows):
                    out.append(b.slice(off, batch_rows))
                    if len(out) >= window:
                        for reply in cl.call_many(out, timeout=timeout):
                            yield from _batches(reply, service)
                        out = []
            if out:
                for reply in cl.call_many(out, timeout=timeout):
                    yield from _batches(reply, service)

    return df.mapInArrow(answer, schema)
