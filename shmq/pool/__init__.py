"""Process pools that survive killed workers: :class:`ProcessPoolExecutor` (a
``concurrent.futures.Executor``) and :class:`Pool` (``multiprocessing.pool.Pool``'s API).

Parts, bottom up: :mod:`.wire` (what travels), :mod:`.worker` (a worker
process), :mod:`.engine` (the parent's side: workers, ring, result queue,
crash recovery), :mod:`.executor` and :mod:`.pool` (the two faces).  Both
stand on the worker platform (:mod:`shmq.workers`).  See docs/pool.md.

This module only re-exports.
"""

from ..errors import WorkerCrashed
from .executor import ProcessPoolExecutor
from .pool import ApplyResult, AsyncResult, IMapIterator, MapResult, Pool

__all__ = ["ProcessPoolExecutor", "Pool", "AsyncResult", "ApplyResult", "MapResult", "IMapIterator",
           "WorkerCrashed"]
