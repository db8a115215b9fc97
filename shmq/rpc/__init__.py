"""Request/reply on one host: ``Service`` answers calls that ``Client`` makes.

Parts: :mod:`.wire` (what travels), :mod:`.requests` (the request ring),
:mod:`.board` (the service's status file ``PATH.svc``: serving processes,
call counts, latency histograms), :mod:`.replies` (a worker's handles on
its callers' reply queues), :mod:`.service` (the serving side),
:mod:`.client` (the calling side) and :mod:`.waiters` (a client's waiting
callers: its window, the reading role, wake-ups of one caller at a time).

How it maps onto the layers below (docs/service.md has the full design):

* **Requests** are frames of the service's request ring at its path
  (:mod:`.requests`): ``(call id, reply queue path, caller identity,
  deadline, attempt, request)``.  Workers take them as one group, in the
  compiled core; each publishes the seqs in its hands on the board.  A
  worker SIGKILLed mid-call (or the whole service) leaves its call in no
  live worker's hands: its caller, which keeps every call it waits for,
  sees that and sends it again (at-least-once to handlers).  The ring is a
  fixed-size ``block`` spool: a slow service makes callers wait in
  ``put`` (bounded memory), never an unbounded backlog.  ``call_many``
  puts several calls in one frame (a bundle, answered with one reply).
* **Replies** go to one anonymous :class:`shmq.Queue` per client process,
  named by its path in each request: only that process reads it, so a
  reply can never reach another caller.  The queue is removed when the
  client closes, exits, or is SIGKILLed (the multiprocessing resource
  tracker; and a worker that finds the caller's pid gone removes it).
* **Exactly one reply per call**: a call id (per client, increasing) is
  in each reply; the client keeps the calls it waits for and drops a reply
  whose call is not pending (a duplicate from a redelivery, or a call that
  timed out).
* **Trust**: requests are unpickled only from a ring that is
  ours and private (:func:`shmq.codec.require_trust`), replies only from a
  queue we created; ``trusted=True`` opts in as elsewhere.

A call whose deadline passed before a worker took it is dropped by the
service (the caller has raised :class:`shmq.Timeout` already).
"""

from ..errors import RemoteError
from .client import Client
from .service import Call, Service, ServiceStats

__all__ = ["Service", "Client", "Call", "ServiceStats", "RemoteError"]
