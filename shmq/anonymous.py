"""The files of anonymous queues (``shmq.Queue()`` without ``path``): naming, tracking,
and removing those no process can use any more.

An anonymous queue lives at ``/dev/shm/shmq-q-<pid>-<start>-<random>``: its
creator's pid and start time (so a survivor can tell the creator is dead), then
64 random bits.  Its creator removes it when it closes it, collects it or exits
(:func:`destroy_owned`); the multiprocessing resource tracker removes it if the
creator is killed and nothing below did (:func:`track`).  A queue whose creator
died is an **orphan** once no handle to it exists anywhere: then nobody can
reach it (handles pickle by path and attach by opening it), and it is removed
(:func:`reclaim`) by the last handle that closes or exits, by the next anonymous
``Queue()`` this user creates (:func:`reclaim_orphans`), or by ``shmq gc``.

Whether a handle exists is one fcntl call, whatever the number of processes on
the host: every handle holds :data:`shmq._format.HANDLE_LOCK_BYTE` shared while
it has the file mapped (:func:`shmq._lock.hold_handle_lock`), so a
non-blocking exclusive attempt succeeds only if there is none.  A handle being
opened meanwhile waits for that exclusive lock, then finds the file unlinked
(``FileNotFoundError``, as for any removed spool).  For a file an older shmq
created (without :data:`shmq._format.GEO_FLAG_HANDLE_LOCKS`) the lock tells
nothing: those are left to ``shmq gc``, which scans ``/proc`` for them
(:mod:`shmq.gc`), and to the resource tracker.

A queue found in use (a handle to it exists) is not probed again by the same
process for :data:`BACKOFF_FIRST_S` seconds, doubling each time it is found in
use again, up to :data:`BACKOFF_MAX_S`, unless its creator dies meanwhile
(a ``kill(pid, 0)`` per queue tells): so the next ``Queue()`` after a creator's
death probes its queue, and a queue that a live process keeps is probed at most
every 8 s.
"""

from __future__ import annotations

import os
import stat as _stat
import time

from . import _format as F
from ._lazy import LazyModule
from ._lock import holder_word, ofd_lock, ofd_locked_by_other, process_alive
from ._mapping import destroy_file, open_file, sem_name, semaphore_file, unlink_semaphores
from .errors import ShmqError

# Loaded by the first anonymous Queue() (or unpickled queue), not by ``import shmq``.
resource_tracker = LazyModule("multiprocessing.resource_tracker")
secrets = LazyModule("secrets")

__all__ = ["anonymous_path", "anonymous_paths", "queue_creator", "probe", "is_orphan", "reclaim",
           "reclaim_orphans", "track", "destroy_owned", "forget_in_tracker"]

#: Where a Queue made without ``path`` lives.
ANONYMOUS_DIR = "/dev/shm"
ANONYMOUS_PREFIX = "shmq-q-"
#: The semaphores :func:`track` registers with the resource tracker (group 0's included).
_TRACKED_SEMS = ("w", "r", "f", "u", "g0")

#: At most this many orphans are removed per :func:`reclaim_orphans` call ...
RECLAIM_BATCH = 4
#: ... and at most this many candidates probed (one open and one fcntl each).
PROBE_BATCH = 16
#: A candidate found in use is left alone this long (seconds) ...
BACKOFF_FIRST_S = 1.0
#: ... doubling each time it is found in use again, up to this.
BACKOFF_MAX_S = 8.0
#: A dead creator's queue registered with another resource tracker is left to that
#: tracker this long (seconds) after the creator is first seen dead (:func:`shares_tracker`).
TRACKER_GRACE_S = 5.0

# path -> (monotonic time before which it is not probed, current interval, whether
# its creator was dead then: a creator's death ends the back-off at once)
_backoff: dict[str, tuple[float, float, bool]] = {}
# path -> monotonic time its creator was first seen dead (queues registered with
# another process's resource tracker: see shares_tracker)
_dead_since: dict[str, float] = {}

# What a probe found (see probe and _reclaim_one).
REMOVED, IN_USE, FREE, GONE, UNKNOWN, FOREIGN = (
    "removed", "in use", "free", "gone", "unknown", "not ours")


def _names_of(word: int) -> str:
    """The start of the names of the queues created by the process with holder ``word``."""
    return f"{ANONYMOUS_PREFIX}{word & 0xFFFFFFFF}-{word >> 32:x}-"


def tracker_tag() -> str:
    """This process's resource tracker, as 8 hex digits: the inode of the pipe to it,
    which every process using that tracker shares (fork, spawn and forkserver children
    use their parent's); ``"0"`` if this process has none yet."""
    fd = getattr(resource_tracker._resource_tracker, "_fd", None)
    if fd is None:
        return "0"
    try:
        return f"{os.fstat(fd).st_ino & 0xFFFFFFFF:x}"
    except OSError:
        return "0"


def anonymous_path() -> str:
    """A new anonymous queue path for this process: its pid and start time, its resource
    tracker (:func:`tracker_tag`; started here if need be, as :func:`track` needs it),
    and 64 random bits."""
    try:
        resource_tracker.ensure_running()
    except Exception:
        pass  # no tracker: the name says so ("0"), and track() fails as it would have
    return os.path.join(ANONYMOUS_DIR, f"{_names_of(holder_word())}{tracker_tag()}-"
                        f"{secrets.token_hex(8)}")


def anonymous_paths() -> list[str]:
    """Paths of this user's anonymous queues (``Queue()`` without ``path``), sorted.

    Regular files named like one and owned by the calling user; never follows
    a link.  What each one is, is for the caller to validate (``shmq ls`` reads
    its header).
    """
    out: list[str] = []
    try:
        names = sorted(os.listdir(ANONYMOUS_DIR))
    except OSError:
        return out
    uid = os.getuid()
    for name in names:
        if not name.startswith(ANONYMOUS_PREFIX):
            continue
        full = os.path.join(ANONYMOUS_DIR, name)
        try:
            st = os.lstat(full)
        except OSError:
            continue
        if _stat.S_ISREG(st.st_mode) and st.st_uid == uid:
            out.append(full)
    return out


def queue_creator(path: str) -> tuple[int, int] | None:
    """``(pid, start)`` of the creator of the anonymous queue at ``path``, from its name
    (``start``: low 32 bits of its start stamp, as :func:`shmq._lock.process_alive` takes);
    None for another name (a named queue, or one named by an older shmq)."""
    name = os.path.basename(path)
    if os.path.dirname(path) != ANONYMOUS_DIR or not name.startswith(ANONYMOUS_PREFIX):
        return None
    parts = name[len(ANONYMOUS_PREFIX):].split("-")
    if len(parts) not in (3, 4):  # with or without the tracker's tag
        return None
    try:
        pid, start = int(parts[0]), int(parts[1], 16)
    except ValueError:
        return None
    return (pid, start) if 0 < pid and 0 <= start < 1 << 32 else None


def shares_tracker(path: str) -> bool:
    """True if the creator of the anonymous queue at ``path`` registered it with this
    process's resource tracker (the tag in its name is this process's
    :func:`tracker_tag`); False if with another tracker, or if the name does not say.

    Why it matters: the creator's tracker unlinks the queue's names once every process
    sharing it is gone, and warns if it finds them gone already.  A queue registered
    with this process's tracker is removed here and taken out of the tracker
    (:func:`forget_in_tracker`): quiet.  One registered with another tracker is left to
    that tracker, which removes it (quietly) as soon as its processes are gone; only if
    it is still there :data:`TRACKER_GRACE_S` after its creator was seen dead does
    :func:`reclaim_orphans` remove it (its tracker then died too, or serves other live
    processes, and may warn at its exit).
    """
    parts = os.path.basename(path)[len(ANONYMOUS_PREFIX):].split("-")
    mine = tracker_tag()
    return len(parts) == 4 and mine != "0" and parts[2] == mine


# -- the resource tracker ---------------------------------------------------------


def _tracked(path: str, prefix: str) -> list[tuple[str, str]]:
    return ([("/" + os.path.basename(path), "shared_memory")]
            + [(sem_name(prefix, which), "semaphore") for which in _TRACKED_SEMS])


def track(path: str, prefix: str) -> None:
    """Register the creator's new queue with this process's resource tracker, which
    unlinks the file and its semaphores if every process sharing the tracker dies
    without :func:`destroy_owned` (the creator killed, and nothing reclaimed it).

    Only the names that exist are registered (a plain Queue has no ``u`` semaphore):
    the tracker warns about every name it cannot unlink."""
    for name, rtype in _tracked(path, prefix):
        if rtype == "shared_memory" or os.path.exists(semaphore_file(name)):
            resource_tracker.register(name, rtype)


def forget_in_tracker(path: str, prefix: str) -> None:
    """After removing a dead creator's queue: take its names out of this process's
    resource tracker if the creator registered them there, so that the tracker does
    not warn at exit that it found them gone.

    The creator shared this process's tracker if it was this process's child or
    sibling (fork, spawn and forkserver children use their parent's), and then a
    register/unregister pair removes its entry (the tracker keeps a set per type).
    Otherwise the pair cancels out here and the creator's own tracker, elsewhere,
    reports at its exit.  Never starts a tracker: none here means none to tell.
    """
    if getattr(resource_tracker._resource_tracker, "_fd", None) is None:
        return
    try:
        # A pair per name, registered or not: the tracker keeps a set, so a pair takes
        # out a registered name and leaves nothing for one never registered (a lone
        # unregister of an unknown name would make the tracker print a traceback).
        for name, rtype in _tracked(path, prefix):
            resource_tracker.register(name, rtype)
            resource_tracker.unregister(name, rtype)
    except Exception:
        pass  # best effort: the removal itself is done


def destroy_owned(path: str, prefix: str, owner: int) -> None:
    """The creator's removal of its queue (at close, collection or exit): file,
    semaphores, and its resource tracker's entries.  Does nothing in a fork child,
    which inherited the finalizer but did not create the queue."""
    if os.getpid() != owner:
        return
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    unlink_semaphores(prefix, 1)
    forget_in_tracker(path, prefix)  # what track() registered, whichever names it was


# -- orphans ------------------------------------------------------------------------


def _open_candidate(path: str):
    """``(fd, stat)`` of the anonymous queue at ``path`` if it is this user's regular
    file (never following or blocking); else ``GONE`` or ``FOREIGN`` (another user's,
    not a regular file, not readable: never ours to remove)."""
    try:
        fd, st = open_file(path)
    except FileNotFoundError:
        return GONE
    except (OSError, ShmqError):
        return FOREIGN
    if st.st_uid != os.getuid():
        os.close(fd)
        return FOREIGN
    return fd, st


def _geometry(fd: int, st: os.stat_result, path: str) -> dict | None:
    try:
        return F.unpack_geometry(os.pread(fd, F.GEOMETRY.size, 0), st.st_size, path)
    except (OSError, ShmqError):
        return None  # damaged: what it is, and who uses it, is for shmq gc's scan


def _reclaim_one(path: str, creator: tuple[int, int]) -> tuple[str, str | None]:
    """Remove the anonymous queue at ``path`` if no handle to it exists and its
    ``creator`` is dead; return ``(outcome, semaphore prefix or None)``.

    The handle lock is held exclusively from the check through the removal, so a
    handle attaching meanwhile waits and then finds the file gone.  ``UNKNOWN``:
    a file whose handles hold no handle lock (an older shmq's) or whose header
    does not decode; the lock tells nothing about those.
    """
    opened = _open_candidate(path)
    if isinstance(opened, str):
        return opened, None
    fd, st = opened
    try:
        try:
            if not ofd_lock(fd, F.HANDLE_LOCK_BYTE):  # exclusive, non-blocking: one fcntl
                return IN_USE, None
        except OSError:
            return UNKNOWN, None  # no fcntl locks here: the lock tells nothing
        if os.fstat(fd).st_nlink == 0:
            return GONE, None  # another process removed it between our open and our lock
        geo = _geometry(fd, st, path)
        if geo is None or not F.handles_lock(geo):
            return UNKNOWN, None
        if process_alive(*creator):
            return IN_USE, None  # created, not yet opened; or being closed by its creator
        try:
            now = os.lstat(path)
            if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
                return GONE, None
            destroy_file(path)
        except (OSError, ShmqError):
            return GONE, None
        return REMOVED, geo["sem_prefix"]
    finally:
        os.close(fd)  # drops the exclusive lock: waiting openers see the file unlinked


def probe(path: str) -> str:
    """Whether a handle to the anonymous queue at ``path`` exists anywhere, from the
    handle lock, taking nothing (``F_OFD_GETLK``): ``IN_USE``, ``FREE``, ``UNKNOWN``
    (a file an older shmq created, or whose header does not decode: the lock tells
    nothing), ``GONE`` or ``FOREIGN`` (not this user's regular file).  The answer may
    be stale by the time the caller acts: :func:`reclaim` decides again under the lock."""
    opened = _open_candidate(path)
    if isinstance(opened, str):
        return opened
    fd, st = opened
    try:
        try:
            if ofd_locked_by_other(fd, F.HANDLE_LOCK_BYTE):
                return IN_USE
        except OSError:
            return UNKNOWN
        geo = _geometry(fd, st, path)
        return FREE if geo is not None and F.handles_lock(geo) else UNKNOWN
    finally:
        os.close(fd)


def is_orphan(path: str) -> bool:
    """True if the anonymous queue at ``path`` is this user's, its creator (named in
    the file name) is dead, and the handle lock says no handle to it exists
    (:func:`probe`; False for a file the lock cannot tell about)."""
    creator = queue_creator(path)
    return creator is not None and not process_alive(*creator) and probe(path) == FREE


def reclaim(path: str, any_tracker: bool = False) -> bool:
    """Remove the anonymous queue at ``path`` if it is an orphan (its creator dead, no
    handle to it anywhere); return True if removed.

    ``any_tracker``: also one registered with another resource tracker (``shmq gc``
    asked to remove orphans: that tracker may be dead with the creator, and if it
    lives it only warns, at its exit, that the names were gone already).

    Cost: an open, an fcntl and a read of its header; ``kill(pid, 0)`` (and a /proc
    read) only if no handle exists.  A queue whose name does not carry its creator,
    or a file the handle lock cannot tell about (see :func:`probe`), is left alone.
    What the creator registered with this process's resource tracker is taken out of
    it (:func:`forget_in_tracker`); a queue registered with another tracker is left to
    that one (:func:`shares_tracker`), and to :func:`reclaim_orphans` after its grace.
    """
    creator = queue_creator(path)
    if creator is None or not (any_tracker or shares_tracker(path)):
        return False
    outcome, prefix = _reclaim_one(path, creator)
    if outcome == REMOVED:
        forget_in_tracker(path, prefix)  # type: ignore[arg-type]  # set with REMOVED
        return True
    return False


def _pid_exists(pid: int) -> bool:
    """``kill(pid, 0)``: 0.5 us; a zombie or a reused pid counts as existing."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def reclaim_orphans(limit: int | None = None, probes: int | None = None) -> int:
    """Remove up to ``limit`` (:data:`RECLAIM_BATCH`) orphaned anonymous queues of this
    user; return how many.

    Run at each anonymous ``Queue()`` creation, so its work is bounded whatever
    the host: a listing of ``/dev/shm`` and a ``kill(pid, 0)`` per anonymous queue,
    then at most ``probes`` (:data:`PROBE_BATCH`) of them probed (an open and an fcntl each; see
    :func:`reclaim`).  This process's own queues are skipped, and so is a queue
    found in use at an earlier call for the back-off interval
    (:data:`BACKOFF_FIRST_S`), unless its creator has died since.  No /proc
    scan: files of an older shmq are left to ``shmq gc`` and the resource tracker.
    """
    limit = RECLAIM_BATCH if limit is None else limit
    probes = PROBE_BATCH if probes is None else probes
    try:
        names = os.listdir(ANONYMOUS_DIR)
    except OSError:
        return 0
    now = time.monotonic()
    mine = _names_of(holder_word())
    paths = {os.path.join(ANONYMOUS_DIR, n) for n in names
             if n.startswith(ANONYMOUS_PREFIX) and not n.startswith(mine)}
    for gone in _backoff.keys() - paths:
        del _backoff[gone]
    for gone in _dead_since.keys() - paths:
        del _dead_since[gone]
    removed = probed = 0
    for path in paths:
        if removed >= limit or probed >= probes:
            break
        creator = queue_creator(path)
        if creator is None:
            continue  # named by an older shmq, without its creator: the tracker's
        dead = not _pid_exists(creator[0])
        retry_at, interval, was_dead = _backoff.get(path, (0.0, 0.0, dead))
        if retry_at > now and was_dead == dead:
            continue  # in use when last probed, and its creator has not died since
        if dead and not shares_tracker(path):
            if now - _dead_since.setdefault(path, now) < TRACKER_GRACE_S:
                continue  # registered with another tracker, which removes it quietly
        probed += 1
        outcome, prefix = _reclaim_one(path, creator)
        if outcome == IN_USE:
            interval = min(BACKOFF_MAX_S, interval * 2 or BACKOFF_FIRST_S) if was_dead == dead \
                else BACKOFF_FIRST_S
            _backoff[path] = (now + interval, interval, dead)
        elif outcome in (UNKNOWN, FOREIGN):  # not for this call to decide, now or later
            _backoff[path] = (now + BACKOFF_MAX_S, BACKOFF_MAX_S, dead)
        else:
            _backoff.pop(path, None)
            _dead_since.pop(path, None)
            if outcome == REMOVED:
                removed += 1
                forget_in_tracker(path, prefix)  # type: ignore[arg-type]  # set with REMOVED
    return removed
