"""Errors that say which filesystem is full, how full, and what to do about it.

A full tmpfs is the commonest way a spool cannot be created or grown; the
bare ``ENOSPC`` names neither the mount nor its size.
"""

from __future__ import annotations

import errno
import os


def mount_point(path: str) -> str:
    path = os.path.realpath(path)
    dev = os.stat(path).st_dev
    while path != "/":
        up = os.path.dirname(path)
        if os.stat(up).st_dev != dev:
            break
        path = up
    return path


def size_text(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


def where(parent: str) -> str:
    """``/dev/shm (12.0 MiB free of 64.0 MiB)``: the filesystem holding ``parent``."""
    try:
        vfs = os.statvfs(parent)
        mount = mount_point(parent)
        free, total = vfs.f_bavail * vfs.f_frsize, vfs.f_blocks * vfs.f_frsize
        return f"{mount} ({size_text(free)} free of {size_text(total)})"
    except OSError:
        return parent


def no_space_for_file(parent: str, need: int) -> OSError:
    """An ENOSPC error that names the filesystem, its size and what to do."""
    return OSError(errno.ENOSPC, f"no space left for a {size_text(need)} spool file on "
                   f"{where(parent)}: choose a smaller --capacity, remove spools you no longer "
                   "need, or grow the filesystem (tmpfs: mount -o remount,size=...)", parent)


def no_space_to_grow(path: str, segment: int, allocated: int, ceiling: int) -> OSError:
    """The ENOSPC error of a growable spool that could not allocate its next segment."""
    return OSError(errno.ENOSPC, f"no space left on {where(os.path.dirname(path))} for the "
                   f"next {size_text(segment)} segment of this spool (it uses "
                   f"{size_text(allocated)}, ceiling {size_text(ceiling)}); nothing was written: "
                   "consume the backlog, remove spools you no longer need, or grow the "
                   "filesystem (tmpfs: mount -o remount,size=...)", path)
