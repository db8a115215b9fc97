"""The worker platform: what a service, a dispatcher and a process pool share.

* :mod:`.processes`: the one supervisor of long-lived worker processes
  (:class:`~.processes.Crew`: start, restart, the parent-death signal, a
  grace period, stop; a single-threaded zygote forks ``fork`` workers) and
  the wake pipe its owner's thread waits on (:class:`~.processes.WakePipe`);
* :mod:`.board`: the status board, a file (or ``memfd``) of u64 words with
  one row per worker process: hostile-file-safe opening, ``flock`` claims,
  holder rows, checked ``pread`` reads;
* :mod:`.holdings`: the at-least-once bookkeeping: what each worker holds,
  published on its row before it acts on it, and who puts back what a dead
  worker held.

docs/workers.md describes the three together.  This module only re-exports.
"""

from .board import Board, BoardBusy, Layout, Row, live_rows, read_words
from .holdings import Hands, Held, Lookout, held_ranges, reclaim
from .processes import Crew, WakePipe, Worker, arm_parent_death, exit_text

__all__ = ["Board", "BoardBusy", "Layout", "Row", "live_rows", "read_words", "Hands", "Held",
           "Lookout", "held_ranges", "reclaim", "Crew", "WakePipe", "Worker", "arm_parent_death",
           "exit_text"]
