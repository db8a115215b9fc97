"""The orphan sweep behind ``shmq gc``: semaphores whose spool is gone, queues whose creator died.

A spool's semaphores (``/dev/shm/sem.shmq.PREFIX.*``) are named after its
file's inode; a file removed without :meth:`shmq.Spool.destroy` (``rm``,
``rm -rf`` of its directory, a crash) leaves them behind.  :func:`sweep`
finds, for the calling user only:

* **orphaned semaphores**: ours, older than ``min_age`` seconds, and of no
  spool that exists: not one recorded in the registry (``_mapping.
  registry_dir()``: every spool created outside /dev/shm itself, written
  before its semaphores) whose file is still there with that inode, not a
  regular file anywhere under /dev/shm (scanned), not a file some live
  process has mapped, and not mapped by a live process themselves;
* **orphaned anonymous queues** (``/dev/shm/shmq-q-PID-START-RANDOM``):
  ours, whose creator (pid and start time, in the name) is dead, and to
  which no handle exists: its handle lock is free (one fcntl,
  :mod:`shmq.anonymous`), or, for a file an older shmq created (whose
  handles take no such lock), no live process maps it or has it open (a
  scan of /proc: this module is where shmq scans /proc, never ``Queue()``).

The registry is read as untrusted input: it can only *protect* semaphores
(an entry whose file does not match is ignored), never cause a removal.
Removing is opt-in (``remove=True``; ``shmq gc --yes``); the default lists.
"""

from __future__ import annotations

import dataclasses
import os
import re
import stat
import time

from ._lock import process_alive
from ._mapping import (
    SEM_DIR, destroy_file, read_geometry, registry_dir, sem_prefix_of, unlink_semaphore,
    unregister_spool,
)
from .anonymous import (
    ANONYMOUS_DIR, ANONYMOUS_PREFIX, FREE, UNKNOWN, anonymous_paths, forget_in_tracker, probe,
    queue_creator, reclaim,
)
from .errors import ShmqError

__all__ = ["Orphans", "sweep", "orphaned_queues", "open_by"]

_PREFIX_RE = re.compile(r"^[0-9a-f]{12}$")
_SEM_RE = re.compile(r"^sem\.shmq\.([0-9a-f]{12})\.([A-Za-z0-9]{1,8})$")
#: Semaphores younger than this are never orphans: a spool may be being created.
MIN_AGE_S = 2.0


@dataclasses.dataclass
class Orphans:
    """What :func:`sweep` found (and, with ``remove``, removed)."""

    semaphores: dict[str, list[str]]  # prefix -> [semaphore file names]
    queues: list[str]  # anonymous queue paths
    stale_entries: list[str]  # registry entries whose spool is gone
    kept: int  # semaphore prefixes of spools that exist or are in use
    removed: bool


def _our_semaphores(min_age: float) -> dict[str, list[str]]:
    """{prefix: [file names]} of this user's shmq semaphores older than ``min_age`` s."""
    out: dict[str, list[str]] = {}
    me, now = os.geteuid(), time.time()
    try:
        names = os.listdir(SEM_DIR)
    except OSError:
        return out
    for name in names:
        m = _SEM_RE.match(name)
        if not m:
            continue
        try:
            st = os.lstat(os.path.join(SEM_DIR, name))
        except OSError:
            continue
        if not stat.S_ISREG(st.st_mode) or st.st_uid != me or now - st.st_ctime < min_age:
            continue
        out.setdefault(m.group(1), []).append(name)
    return out


def _prefix_if_file(path: str) -> str | None:
    try:
        st = os.lstat(path)
    except (OSError, ValueError):
        return None
    return sem_prefix_of(st) if stat.S_ISREG(st.st_mode) else None


def _registered() -> tuple[set[str], list[str]]:
    """(prefixes of recorded spools that exist, names of entries whose spool is gone)."""
    live: set[str] = set()
    stale: list[str] = []
    d = registry_dir()
    try:
        st = os.lstat(d)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            return live, stale
        names = os.listdir(d)
    except OSError:
        return live, stale
    for name in names:
        if not _PREFIX_RE.match(name):
            continue
        try:
            fd = os.open(os.path.join(d, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK
                         | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            est = os.fstat(fd)
            text = os.read(fd, 8192) if stat.S_ISREG(est.st_mode) else b""
        finally:
            os.close(fd)
        paths = [p for p in text.decode("utf-8", "replace").split("\n")
                 if p.startswith("/") and "\x00" not in p]
        if any(_prefix_if_file(p) == name for p in paths):
            live.add(name)
        else:
            stale.append(name)
    return live, stale


def _under_shm() -> set[str]:
    """Semaphore prefixes of every regular file under /dev/shm we can see (no links followed)."""
    out = set()
    for root, dirs, files in os.walk(SEM_DIR, followlinks=False):
        for f in files:
            if f.startswith("sem."):
                continue
            p = _prefix_if_file(os.path.join(root, f))
            if p is not None:
                out.add(p)
    return out


def _in_use() -> set[str]:
    """Prefixes of semaphores live processes map, and of files they map (from /proc)."""
    out, files = set(), set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/maps") as f:
                for line in f:
                    parts = line.split(None, 5)
                    if len(parts) < 6 or parts[4] == "0":
                        continue
                    m = _SEM_RE.match(os.path.basename(parts[5].rstrip("\n")))
                    if m:
                        out.add(m.group(1))
                    else:
                        files.add((parts[3], int(parts[4])))
        except (OSError, ValueError):
            continue
    for dev, ino in files:
        major, minor = (int(x, 16) for x in dev.split(":"))
        out.add(sem_prefix_of(os.stat_result((0, ino, os.makedev(major, minor), 0, 0, 0, 0, 0, 0, 0))))
    return out


def open_by(path: str, include_self: bool = False) -> list[int]:
    """Pids of other live processes (this one too with ``include_self``) that have the
    file at ``path`` mapped (every open shmq handle maps its spool), from
    /proc/PID/maps; [] if none or not readable."""
    try:
        st = os.stat(path)
    except OSError:
        return []
    me, pids = (-1 if include_self else os.getpid()), []
    dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}"
    ino = str(st.st_ino)
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/maps") as f:
                for line in f:
                    parts = line.split(None, 5)
                    if len(parts) >= 5 and parts[4] == ino and parts[3] == dev:
                        pids.append(int(entry))
                        break
        except OSError:
            continue
    return pids


def _open_anywhere(path: str) -> bool:
    """True if a live process (one we can see, this one included) maps the file at
    ``path`` or has it open: a scan of every process's maps and descriptors."""
    if open_by(path, include_self=True):
        return True
    try:
        st = os.stat(path)
    except OSError:
        return False
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        d = f"/proc/{entry}/fd"
        try:
            fds = os.listdir(d)
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"{d}/{fd}").startswith(os.path.join(ANONYMOUS_DIR, ANONYMOUS_PREFIX)):
                    fst = os.stat(f"{d}/{fd}")
                    if (fst.st_dev, fst.st_ino) == (st.st_dev, st.st_ino):
                        return True
            except OSError:
                continue
    return False


def _is_orphan(path: str) -> bool:
    """The anonymous queue at ``path`` has a dead creator and no handle: by its handle
    lock, or, for a file the lock cannot tell about (an older shmq's), by a scan."""
    creator = queue_creator(path)
    if creator is None or process_alive(*creator):
        return False
    verdict = probe(path)
    return verdict == FREE or (verdict == UNKNOWN and not _open_anywhere(path))


def _reclaim(path: str) -> None:
    """Remove an orphaned anonymous queue, deciding again (a process may have attached
    since the listing): under the handle lock (:func:`shmq.anonymous.reclaim`), or for
    an older shmq's file by a second scan just before removing it."""
    if reclaim(path) or probe(path) != UNKNOWN or not _is_orphan(path):
        return
    try:
        prefix = read_geometry(path)["sem_prefix"]
    except (OSError, ShmqError):
        prefix = None  # damaged: destroy_file finds its semaphores from its inode
    try:
        destroy_file(path)
    except (OSError, ShmqError):
        return
    if prefix is not None:
        forget_in_tracker(path, prefix)


def orphaned_queues() -> list[str]:
    """This user's anonymous queues whose creator is dead and to which no handle exists
    (the handle lock; for files of an older shmq, a scan of /proc)."""
    return [p for p in anonymous_paths() if _is_orphan(p)]


def sweep(remove: bool = False, min_age: float = MIN_AGE_S) -> Orphans:
    """Find this user's orphaned semaphores and anonymous queues; remove them if ``remove``.

    Never removes a semaphore of a spool that exists (recorded in the
    registry, or anywhere under /dev/shm) or that a live process maps, nor a
    semaphore younger than ``min_age`` seconds (a spool being created), nor
    a queue a live process has open or whose creator lives.
    """
    queues = orphaned_queues()
    if remove:
        for p in queues:
            _reclaim(p)
    sems = _our_semaphores(min_age)
    live, stale = _registered()
    keep = live | _under_shm() | _in_use()
    orphans = {p: sorted(n) for p, n in sems.items() if p not in keep}
    if remove:
        for names in orphans.values():
            for n in names:
                unlink_semaphore("/" + n[len("sem."):])
        for name in stale:
            if _prefix_if_file(os.path.join(registry_dir(), name)) is not None:
                unregister_spool(name)
    return Orphans(orphans, queues, stale, len(set(sems) - set(orphans)), remove)
