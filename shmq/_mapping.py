"""Creating, opening, validating and mapping spool files, and naming their semaphores.

A spool is created under a temporary name, fully initialized, then
``link()``-ed into place: the path either does not exist or names a complete
spool, even if the creator is killed midway.  Files are created with an
explicit ``fchmod`` (the mode is not subject to the umask, so ``mode=0o660``
means 0660).

Other users of the host are not trusted (docs/security.md): every existing
spool or side file is opened through :func:`open_file`, which never follows a
symbolic link, never blocks (a FIFO planted at the path cannot wedge us) and
refuses anything that is not a regular file; bare names live in a private
per-user directory (:func:`default_dir`); and a named semaphore another user
created under one of our names is refused (:func:`open_semaphore`).
"""

from __future__ import annotations

import errno
import mmap
import os
import stat
import struct
import time
import weakref

from . import _core
from . import _format as F
from ._lock import hold_handle_lock
from ._space import no_space_for_file
from .errors import NotASpool, ShmqError, SpoolFormatError

#: The shared directory of shmq before 0.2 (mode 1777, like /tmp).  Bare names no
#: longer resolve there; explicit paths into it keep working (docs/security.md).
SHARED_DIR = "/dev/shm/shmq"
#: Where glibc keeps named semaphores: ``sem_open("/NAME")`` is the file ``sem.NAME``.
SEM_DIR = "/dev/shm"

SEM_WRITER = "w"  # writer lock
SEM_READ_WAITERS = "r"  # readers waiting for frames
SEM_SPACE_WAITERS = "f"  # writers waiting for room (block policy)
SEM_UNFINISHED = "u"  # JoinableQueue: items put and not yet task_done()

# O_NONBLOCK: open() of a FIFO with no writer (or of some devices) would block
# forever; with it, a FIFO opens at once and fstat() rejects it, a socket fails
# with ENXIO.  On a regular file O_NONBLOCK changes nothing (open(2)).
_OPEN_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY


def default_dir() -> str:
    """The private directory bare names live in: ``/dev/shm/shmq-<euid>``.

    Computed at each call from the effective uid (a process that changes
    user gets that user's directory).
    """
    return f"/dev/shm/shmq-{os.geteuid()}"


def _kind(mode: int) -> str:
    for test, what in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a directory")):
        if test(mode):
            return what
    return "not a regular file"


def _not_a_spool(path: str, mode: int) -> NotASpool:
    what = _kind(mode)
    if what == "a symbolic link":
        return NotASpool(f"{path}: is a symbolic link, not a shmq spool; refusing to follow it")
    return NotASpool(f"{path}: is {what}, not a shmq spool (not a regular file); refusing to open it")


def open_file(path: str, write: bool = True):
    """Open an existing spool or side file; return ``(fd, os.stat_result of that fd)``.

    The one way shmq opens a file that already exists: ``O_NOFOLLOW |
    O_NONBLOCK | O_CLOEXEC``, and anything but a regular file (a symbolic
    link, FIFO, socket, device or directory) is refused at once, before
    and after the open, so whatever is planted at ``path`` neither blocks
    us nor is followed.  The caller owns the returned descriptor.

    :raises FileNotFoundError: nothing at ``path``.
    :raises shmq.NotASpool: not a regular file.
    :raises PermissionError: not readable (or writable, with ``write``).
    """
    try:
        st = os.lstat(path)  # refuse devices before open() can have side effects
    except FileNotFoundError:
        raise FileNotFoundError(errno.ENOENT, "no spool at this path "
                                "(create it with shmq.Spool.create)", path) from None
    if not stat.S_ISREG(st.st_mode):
        raise _not_a_spool(path, st.st_mode)
    try:
        fd = os.open(path, (os.O_RDWR if write else os.O_RDONLY) | _OPEN_FLAGS)
    except OSError as exc:
        # replaced between lstat and open: report what is there now
        if exc.errno == errno.ELOOP:
            raise _not_a_spool(path, stat.S_IFLNK) from None
        if exc.errno in (errno.ENXIO, errno.EWOULDBLOCK, errno.EISDIR):
            raise NotASpool(f"{path}: is not a regular file, not a shmq spool; refusing to open "
                            "it") from None
        if exc.errno == errno.ENOENT:
            raise FileNotFoundError(errno.ENOENT, "no spool at this path "
                                    "(create it with shmq.Spool.create)", path) from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise _not_a_spool(path, st.st_mode)
    return fd, st


def check_private_dir(path: str, create: bool = False) -> None:
    """Check (and with ``create`` make, mode 0700) a per-user directory.

    It must be a real directory (not a symbolic link), owned by the
    effective user, and not writable by group or others: otherwise another
    user could plant, replace or squat the spools in it.

    :raises shmq.ShmqError: it is unsafe (the message says why and what to do).
    :raises FileNotFoundError: it does not exist and ``create`` is false.
    """
    if create:
        try:
            os.mkdir(path, 0o700)  # the umask can only narrow 0700
        except FileExistsError:
            pass
    st = os.lstat(path)
    problem = None
    if stat.S_ISLNK(st.st_mode):
        problem = "is a symbolic link"
    elif not stat.S_ISDIR(st.st_mode):
        problem = "is not a directory"
    elif st.st_uid != os.geteuid():
        problem = f"is owned by uid {st.st_uid}, not by you (uid {os.geteuid()})"
    elif st.st_mode & 0o022:
        problem = f"is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})"
    if problem:
        raise ShmqError(f"{path} {problem}: not a safe directory for your spools (another user "
                        "may have planted it); remove it, or use a full path")


def resolve_path(path) -> str:
    """A bare name (no slash) lives in the private :func:`default_dir`; paths are kept as given.

    For a bare name, the directory is checked when it exists (see
    :func:`check_private_dir`); :func:`create_file` creates it.

    :raises TypeError: not a str or os.PathLike.
    :raises ValueError: empty, NUL byte, or a bare name that is '.' or '..'.
    :raises shmq.ShmqError: the private directory is unsafe.
    """
    if isinstance(path, os.PathLike):
        path = os.fspath(path)
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    if not isinstance(path, str):
        raise TypeError(f"spool path must be a str or os.PathLike, not {type(path).__name__}")
    if not path or "\x00" in path:
        raise ValueError(f"invalid spool path {path!r}")
    if "/" not in path:
        if path in (".", ".."):
            raise ValueError(f"invalid spool name {path!r}")
        d = default_dir()
        try:
            check_private_dir(d)
        except FileNotFoundError:
            pass  # created by create_file; opening a name in it fails as "no spool"
        return os.path.join(d, path)
    return os.path.abspath(path)


def sem_name(prefix: str, which: str) -> str:
    return f"/shmq.{prefix}.{which}"


def group_sem_name(prefix: str, slot: int) -> str:
    return sem_name(prefix, f"g{slot}")


def open_semaphore(name: str, initial: int, mode: int = 0o600, *, owner: int | None = None,
                   group: int | None = None) -> _core.Semaphore:
    """Open (or create: a group's on first use, or after a reboot kept a disk
    spool) a named semaphore, readable and writable by whoever may use the spool.

    ``owner`` and ``group`` are the uid and gid of the spool file (default:
    us, no group); ``mode`` its permission bits.  An existing semaphore is
    used only if its creator could write the spool anyway: us, the spool's
    owner, root, a member of the spool's group if the spool is
    group-writable, anyone if it is world-writable.  A semaphore another
    user created under the name (a squatted name) is refused.  The engine
    does all of it (shmq/engine/sem.c), for Python and C handles alike.

    :raises shmq.ShmqError: the semaphore was squatted by another user.
    """
    return _core.Semaphore(name, initial, mode, -1 if owner is None else owner,
                           -1 if group is None else group)


def create_semaphore(name: str, initial: int, mode: int) -> None:
    """Create the named semaphore ``name`` exclusively, with ``mode`` exactly (a new
    spool's: a name taken, even squatted, fails the creation).

    :raises FileExistsError: the name exists.
    """
    _core.Semaphore(name, initial, mode, create=True).close()


def semaphore_file(name: str) -> str:
    """The file glibc keeps the named semaphore ``name`` in."""
    return os.path.join(SEM_DIR, "sem." + name.lstrip("/"))


def sem_prefix_of(st: os.stat_result) -> str:
    """The semaphore prefix of the spool file with this ``fstat``: derived from its
    device and inode, so it can be recomputed from the file itself whatever its
    contents (a truncated file, a damaged header).

    The inode is the file's identity for as long as any process has it open
    or it has a name: it survives rename and link (create and import publish
    a temporary file under its final name), and a new file cannot get the
    number while an old one with it is still open.  The header records the
    same prefix (``sem_prefix``), which is what handles open.
    """
    import hashlib  # (here: with OpenSSL it costs a tenth of ``import shmq``)

    return hashlib.sha256(f"shmq:{st.st_dev}:{st.st_ino}".encode()).hexdigest()[:12]


def semaphore_names(prefix: str, slot_count: int = 0) -> list[str]:
    """Every semaphore name of the spool with ``prefix``: the fixed ones, ``slot_count``
    group semaphores, and any other ``sem.shmq.PREFIX.*`` present in /dev/shm
    (group semaphores of a spool whose header, and so slot count, is unreadable)."""
    names = [sem_name(prefix, w) for w in
             (SEM_WRITER, SEM_READ_WAITERS, SEM_SPACE_WAITERS, SEM_UNFINISHED)]
    names += [group_sem_name(prefix, i) for i in range(slot_count)]
    start = "sem." + sem_name(prefix, "").lstrip("/")  # "/shmq.P.x" is the file sem.shmq.P.x
    try:
        present = ["/" + n[4:] for n in os.listdir(SEM_DIR) if n.startswith(start)]
    except OSError:
        present = []
    return list(dict.fromkeys(names + present))


def unlink_semaphore(name: str) -> None:
    """Unlink the named semaphore ``name``; a missing one is fine.  Processes that have
    it open keep it until they close it.

    :raises OSError: it cannot be unlinked (another user's, in a sticky /dev/shm).
    """
    _core.sem_unlink(name)


def unlink_semaphores(prefix: str, slot_count: int, owners=None) -> None:
    """Unlink a spool's semaphores (those owned by a uid in ``owners``, if given);
    missing ones are fine.  Processes that have them open keep them until they close."""
    for name in semaphore_names(prefix, slot_count):
        if owners is not None:
            try:
                if os.lstat(semaphore_file(name)).st_uid not in owners:
                    continue
            except OSError:
                continue  # absent
        unlink_semaphore(name)
    unregister_spool(prefix)  # its record protected these semaphores: gone with them


def has_semaphores(prefix: str) -> bool:
    """True if any semaphore of the spool with ``prefix`` exists."""
    return any(os.path.exists(semaphore_file(n)) for n in semaphore_names(prefix))


def _ensure_dir(path: str) -> None:
    parent = os.path.dirname(path)
    if parent == default_dir():
        check_private_dir(parent, create=True)
        return
    if parent != SHARED_DIR:
        return
    # The pre-0.2 shared directory, for explicit paths into it: shared by users
    # like /tmp (sticky, umask-proof); docs/security.md says what that exposes.
    try:
        os.mkdir(parent, 0o1777)
        os.chmod(parent, 0o1777)
    except FileExistsError:
        pass
    st = os.lstat(parent)
    # Another user could have planted it: it must be a real directory, ours or
    # root's, and not writable by others unless sticky (as /tmp is).
    if (not stat.S_ISDIR(st.st_mode) or st.st_uid not in (0, os.geteuid())
            or (st.st_mode & 0o002 and not st.st_mode & stat.S_ISVTX)):
        raise ShmqError(f"{parent} is not a safe directory (a symlink, someone else's, or "
                        "world-writable without the sticky bit); remove it or use a full path")


#: Under :func:`default_dir`: one small file per spool created outside /dev/shm
#: itself, named after its semaphore prefix, holding its path (and the temporary
#: name it is created under), so ``shmq gc`` (:mod:`shmq.gc`) can tell the
#: semaphores of a spool nobody has open from those of a removed one.
REGISTRY_DIR = ".spools"


def registry_dir() -> str:
    return os.path.join(default_dir(), REGISTRY_DIR)


def register_spool(prefix: str, path: str, tmp: str) -> None:
    """Record that the spool with semaphore ``prefix`` lives at ``path`` (best effort).

    Spools directly in /dev/shm (anonymous queues) are found by ``shmq gc``'s
    scan of /dev/shm and are not recorded.  Written before the semaphores
    exist, so gc never sees them unrecorded.
    """
    if os.path.dirname(path) == SEM_DIR:
        return
    for _ in range(3):  # unregister_spool may rmdir the empty directory meanwhile
        try:
            check_private_dir(default_dir(), create=True)
            try:
                os.mkdir(registry_dir(), 0o700)
            except FileExistsError:
                pass
            fd = os.open(os.path.join(registry_dir(), prefix),
                         os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                os.write(fd, f"{path}\n{tmp}\n".encode())
            finally:
                os.close(fd)
            return
        except FileNotFoundError:
            continue
        except (OSError, ShmqError):
            return  # an unsafe private directory or a full /dev/shm: gc then keeps less


def unregister_spool(prefix: str) -> None:
    """Forget the spool with semaphore ``prefix`` (its file and semaphores are gone)."""
    try:
        os.unlink(os.path.join(registry_dir(), prefix))
    except OSError:
        return
    try:
        os.rmdir(registry_dir())  # only when empty: a private directory left clean
    except OSError:
        pass


def creating_name(name: str, tag: str) -> str:
    """The temporary name a spool ``name`` is created under before it is linked to
    its name; ``tag`` is 12 random hex digits."""
    return f".{name}.{tag}.creating"


#: How many bytes longer than its own name the temporary name is.
CREATING_EXTRA_BYTES = len(creating_name("", "0" * 12))


def check_name_length(path: str, beside: str = "") -> None:
    """Refuse a spool name too long to be created under its temporary name (or,
    with ``beside``, too long for the spool ``path + beside`` that goes with it).

    :raises OSError: ``ENAMETOOLONG``, naming ``path`` and the longest name allowed.
    """
    parent = os.path.dirname(path) or "."
    try:
        name_max = os.pathconf(parent, "PC_NAME_MAX")
    except (OSError, ValueError):
        name_max = 255
    extra = len(os.fsencode(beside))
    longest = name_max - CREATING_EXTRA_BYTES - extra
    n = len(os.fsencode(os.path.basename(path)))
    if n > longest:
        why = f"; its {beside!r} spool beside it adds {extra}" if beside else ""
        raise OSError(errno.ENAMETOOLONG, f"spool file name too long: {n} bytes, at most {longest} "
                      f"(the directory allows {name_max}; a spool is created under a temporary name "
                      f"{CREATING_EXTRA_BYTES} bytes longer{why})", path)


def create_file(path: str, *, ring_bytes: int, policy: str, mode: int, slots: int,
                leases: int, checksum: bool, start_bytes: int | None = None) -> None:
    """Create a fully initialized, pre-allocated spool file at ``path``.

    ``start_bytes`` (less than ``ring_bytes``) makes it growable: the file is
    sparse, only the header, tables and the ring's first ``start_bytes``
    (whole segments) are allocated, and the writer allocates the rest a
    segment at a time (see ``_core.zone_place``).

    :raises FileExistsError: something already exists at ``path``.
    """
    _ensure_dir(path)
    slot_offset, lease_offset, ring_offset, ring_bytes, file_bytes = F.ring_geometry(
        ring_bytes, slots, leases)
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        raise FileNotFoundError(errno.ENOENT, "no such directory for the spool", parent)
    check_name_length(path)
    tmp = os.path.join(parent, creating_name(os.path.basename(path), os.urandom(6).hex()))
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    prefix = sem_prefix_of(os.fstat(fd))
    # Our semaphores with this prefix can only be debris of a spool removed
    # without Spool.destroy (plain rm) whose inode number this file now reuses:
    # no live file has this inode.  Another user's are left alone (and make
    # the exclusive creation below fail: a squatted name is never used).
    unlink_semaphores(prefix, 0, {os.geteuid()})
    register_spool(prefix, path, tmp)  # before its semaphores exist: shmq gc keeps them
    linked = False
    try:
        os.fchmod(fd, mode)
        # Not sparse: reserve every page now, so a full tmpfs fails here and
        # not as SIGBUS in the middle of a put.  A growable ring is sparse
        # past its first segments; the writer allocates each one before use.
        window = None
        if start_bytes is not None and start_bytes < ring_bytes:
            window = F.growth_plan(start_bytes, ring_bytes)
        try:
            if window:
                os.ftruncate(fd, file_bytes)
            os.posix_fallocate(fd, 0, ring_offset + window[1] if window else file_bytes)
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise no_space_for_file(parent, ring_offset + window[1] if window else file_bytes) from None
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            os.ftruncate(fd, file_bytes)
        geometry = F.pack_geometry(
            file_bytes=file_bytes, ring_offset=ring_offset, ring_bytes=ring_bytes,
            slot_offset=slot_offset, slot_count=slots, lease_offset=lease_offset,
            lease_count=leases, policy=policy, checksum=checksum, sem_prefix=prefix,
            created_ns=time.time_ns(), flags=F.GEO_FLAG_HANDLE_LOCKS)  # handles hold HANDLE_LOCK_BYTE
        sem_mode = mode & 0o666  # whoever may open the spool must be able to lock it
        for which, initial in ((SEM_WRITER, 1), (SEM_READ_WAITERS, 0), (SEM_SPACE_WAITERS, 0)):
            create_semaphore(sem_name(prefix, which), initial, sem_mode)
        os.pwrite(fd, geometry, 0)  # control words are all zero: seq 0, empty ring
        if window:  # ... but a growable ring's segment size and allocated window
            os.pwrite(fd, struct.pack("<QQ", window[1], window[1]), F.W_ALLOC_MIN * 8)
            os.pwrite(fd, struct.pack("<Q", window[0]), F.W_SEGMENT * 8)
        try:
            os.link(tmp, path)  # atomic publish; never replaces an existing file
            linked = True
        except FileExistsError:
            raise FileExistsError(errno.EEXIST, "a file already exists there "
                                  "(use Spool.open, or Spool.destroy it first)", path) from None
    finally:
        os.close(fd)
        os.unlink(tmp)
        if not linked:
            unlink_semaphores(prefix, 0)
            unregister_spool(prefix)


class Mapping:
    """An open, validated, memory-mapped spool file.

    Attributes: ``path``, ``fd``, ``st`` (fstat of the descriptor mapped),
    ``mm``, ``geo`` (decoded geometry), ``view`` (a memoryview of the whole
    mapping), ``ctl`` (header page as u64 words), ``slots`` (reader table as
    u64 words).

    ``write=False`` maps the file read-only (fsck).  ``geometry=False``
    opens without decoding the geometry or mapping: ``head`` holds the raw
    geometry bytes and :meth:`map` maps once the caller has judged them
    (fsck reports a damaged header instead of raising).

    :raises shmq.SpoolFormatError: (``geometry=True``) not a spool, corrupt, truncated,
        or a newer format.
    """

    def __init__(self, path: str, *, write: bool = True, geometry: bool = True):
        self.path = path
        fd, st = open_file(path, write=write)  # never follows, never blocks, regular files only
        self.fd = fd
        self.write = write
        self.mm: mmap.mmap | None = None
        try:
            # Held while this handle lives: removing an orphaned queue takes it exclusively
            # first, so an opener that gets it after finds the file unlinked (shmq.anonymous).
            hold_handle_lock(fd, path)
            if os.fstat(fd).st_nlink == 0:
                raise FileNotFoundError(errno.ENOENT, "the spool was removed while being opened",
                                        path)
            self.st = st  # of the descriptor mapped: the trust check reads it (shmq.codec)
            self.st_uid = st.st_uid
            self.st_mode = st.st_mode
            self.size = st.st_size
            self.head = os.pread(fd, F.GEOMETRY.size, 0)
            if geometry:
                self.map(F.unpack_geometry(self.head, st.st_size, path))
        except BaseException:
            os.close(fd)
            self.fd = None
            raise

    def map(self, geo: dict) -> None:
        """Map the file as described by the decoded geometry ``geo``."""
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if self.write else 0)
        self.geo = geo
        self.mm = mmap.mmap(self.fd, geo["file_bytes"], mmap.MAP_SHARED, prot)
        self.view = self._view = memoryview(self.mm)  # the whole mapping
        self.ctl = self._view[:F.HEADER_BYTES].cast("Q")
        so, n = geo["slot_offset"], geo["slot_count"]
        self.slots = self._view[so:so + n * F.SLOT_BYTES].cast("Q")

    def slot_byte(self, i: int, which: int) -> int:
        """File offset of byte ``which`` of reader-table slot ``i`` (what its fcntl locks
        cover; ``NAME_OFFSET`` is where its name starts)."""
        return self.geo["slot_offset"] + i * F.SLOT_BYTES + which

    def slot_name(self, i: int):
        """The name stored in slot ``i``, or None if it does not decode."""
        off = self.slot_byte(i, F.NAME_OFFSET)
        return F.unpack_name(self.mm[off:off + F.NAME_MAX_BYTES + 1])  # type: ignore[index]  # mapped

    def reopen_fd(self) -> None:
        """After fork: get a private open file description for the same inode.

        The inherited descriptor shares the parent's OFD locks; keeping it
        would keep the parent's named readers marked alive after it dies.
        """
        new = os.open(f"/proc/self/fd/{self.fd}", (os.O_RDWR if self.write else os.O_RDONLY)
                      | os.O_CLOEXEC)
        try:
            hold_handle_lock(new, self.path)  # before the inherited one (the parent's) goes
        except BaseException:
            os.close(new)
            raise
        os.close(self.fd)
        self.fd = new

    def unlinked(self) -> bool:
        """Whether the file has been removed (destroy, ``rm``) since it was opened."""
        return os.fstat(self.fd).st_nlink == 0

    def forget_semaphores_if_unlinked(self, prefix: str) -> None:
        """If the file is gone, unlink every semaphore name of ``prefix``.

        A name opened since the file went (with O_CREAT) may have been created
        after :func:`destroy_file` unlinked the names (it unlinks the file
        first), and nothing else would remove it; handles keep the semaphores
        they have open.  Best effort, and only for the prefix derived from this
        file's own inode: no other file can have it while our descriptor holds
        the inode, whereas a header naming another spool's prefix (a copy, a
        planted file) must not make us unlink that spool's locks.
        """
        if not self.unlinked() or prefix != sem_prefix_of(self.st):  # one fstat when linked
            return
        try:
            unlink_semaphores(prefix, 0)
        except OSError:  # a name another user created, say: theirs to remove
            pass

    def close(self) -> None:
        """Unmap and close the descriptor.  Idempotent."""
        if self.mm is not None:
            try:
                self.slots.release()
                self.ctl.release()
                self._view.release()
                self.mm.close()
            except BufferError:
                # A caller still holds a view: the pages stay mapped until the mmap
                # object goes.  So does the descriptor, and with it the handle lock:
                # a mapped file is never taken for an orphan.
                weakref.finalize(self.mm, os.close, self.fd)
                self.fd = None
            self.mm = None
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def read_geometry(path: str) -> dict:
    """Decode a spool's geometry without mapping it (for destroy and listings).

    :raises shmq.NotASpool: not a regular file (nothing is opened that would block).
    :raises shmq.SpoolFormatError: a regular file, but not a spool.
    """
    fd, st = open_file(path, write=False)
    try:
        return F.unpack_geometry(os.pread(fd, F.GEOMETRY.size, 0), st.st_size, path)
    finally:
        os.close(fd)


def destroy_file(path: str) -> None:
    """Unlink the spool at ``path`` and its semaphores, whatever state the file is in;
    never anything else.

    The file is opened with :func:`open_file` (no following, no blocking).
    Its semaphores are found from its inode (:func:`sem_prefix_of`) and, when
    the header still decodes, from its ``sem_prefix`` too, so a truncated or
    header-corrupt spool is removed with its semaphores; a file that is not a
    spool (foreign magic, not a regular file) is refused and left alone, as
    is a headerless file no semaphore of ours derives from.  ``path`` must
    still name the same inode when it is unlinked.  The semaphores unlinked
    are those of the file's owner (and, if the file is ours and others may
    write it, those its other users created): a file another user planted,
    naming one of our spools' prefixes, cannot make us unlink our own locks.

    :raises FileNotFoundError: nothing at ``path``.
    :raises shmq.NotASpool: not a spool (left alone).
    """
    fd, st = open_file(path, write=False)
    try:
        derived = sem_prefix_of(st)
        prefixes, slots = [derived], 0
        try:
            geo = F.unpack_geometry(os.pread(fd, F.GEOMETRY.size, 0), st.st_size, path)
        except NotASpool:
            if not has_semaphores(derived):
                raise
        except SpoolFormatError:
            pass  # damaged: the derived prefix and a /dev/shm scan find its semaphores
        else:
            prefixes.append(geo["sem_prefix"])
            slots = geo["slot_count"]
        now = os.lstat(path)
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            raise NotASpool(f"{path}: was replaced while being destroyed; left alone")
        if st.st_uid == os.geteuid():
            owners = None if st.st_mode & 0o022 else {st.st_uid}
        else:
            owners = {st.st_uid}
        # The file goes first, the semaphores after it.  A handle being opened
        # meanwhile (O_CREAT) may re-create a semaphore already unlinked; once
        # the core has opened it too, the handle looks at the file's link
        # count (Mapping.forget_semaphores_if_unlinked) and removes it if the
        # file is gone.  In the other order, a name re-created between our two
        # steps would outlive the spool.  Our descriptor stays open until the
        # semaphores are gone: while it is open, no new file can get the inode,
        # so no new spool the prefix of ours.
        os.unlink(path)
        for prefix in dict.fromkeys(prefixes):
            unlink_semaphores(prefix, slots, owners)
    finally:
        os.close(fd)
    for prefix in dict.fromkeys(prefixes):
        unregister_spool(prefix)


def mark_from_network(path: str) -> None:
    """Record in the spool's geometry that its frames come from the network
    (:data:`shmq._format.GEO_FLAG_NETWORK`); idempotent.  Handles already open keep
    the geometry they read; new ones see the flag."""
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        raw = os.pread(fd, F.GEOMETRY.size, 0)
        F.unpack_geometry(raw, os.fstat(fd).st_size, path)  # only a valid spool is touched
        new = F.with_geometry_flags(raw, F.GEO_FLAG_NETWORK)
        if new != raw:
            os.pwrite(fd, new, 0)
    finally:
        os.close(fd)


