"""fsck --repair: :func:`repair` fixes what it safely can in a spool (see :mod:`shmq.verify`).

It breaks a lock held by a dead process (as the engine's own lock recovery
would: under the recovery region lock, bumping the fencing token, then
posting the semaphore), finishes a commit a dead writer left half-done, and
resets damaged reader slots to the earliest frame (or frees slots that are
not readers at all).  It never rewrites a frame: damaged frames are
reported and left for ``shmq export`` + recreate.
"""

from __future__ import annotations

import time

from . import _core
from . import _format as F
from ._format import W_LOCK_HOLDER, W_LOCK_TOKEN
from ._lock import RecoverableLock, holder_alive, holder_pid, holder_word, ofd_lock, ofd_unlock
from ._mapping import SEM_WRITER, Mapping, group_sem_name, open_semaphore, resolve_path, sem_name
from .verify import ORPHAN_LOCK_CHECK_S, Report, existing_semaphore, first_cursor, verify

__all__ = ["repair"]


def repair(path, *, lock_timeout=2.0) -> Report:
    """Fix what can be fixed without rewriting frames; return the report of a fresh verify.

    * a writer or group lock held by a dead process is broken: under the
      recovery region lock, the holder word is replaced, the fencing token
      bumped (and ``LOCK_BREAKS``), a commit the dead writer left half-done
      is finished, then the holder word is cleared and the semaphore posted;
    * a writer semaphore taken with no holder recorded is posted; a value
      above 1 is brought back to 1;
    * reader slots whose cursor is damaged are reset to the earliest frame;
      slots that are not valid readers (bad state, undecodable or duplicate
      name) are freed; a valid slot beyond the scan bound is made visible.

    ``Report.repaired`` lists the actions; remaining ``problems`` (damaged
    frames, corrupt control words) need ``shmq export`` and a new spool.

    :raises: as :func:`verify`; also PermissionError if the file is read-only to us.
    """
    path = resolve_path(path)
    before = verify(path)
    if before.capacity is None:  # geometry unreadable: nothing is safe to touch
        return before
    actions = []
    with Mapping(path) as v:
        if before.stale_writer_lock or before.orphan_writer_lock:
            _break_writer_lock(v, actions)
        _fix_semaphore_value(v, actions)
        if before.control_fix:
            _with_writer_lock(v, actions, lock_timeout, lambda: _finish_commit(v, actions))
        for i in before.stale_group_locks:
            _break_group_lock(v, i, actions)
        if before.damaged_slots:
            _with_writer_lock(v, actions, lock_timeout,
                              lambda: _fix_slots(v, before.damaged_slots, actions))
    after = verify(path)
    after.repaired = actions
    return after


def _break_writer_lock(v, actions):
    sem = _sem(v, sem_name(v.geo["sem_prefix"], SEM_WRITER))
    try:
        _break_lock(v, sem, v.ctl, W_LOCK_HOLDER, W_LOCK_TOKEN, F.RECOVERY_LOCK_BYTE,
                    "the writer lock", actions, breaks_word=F.W_LOCK_BREAKS,
                    on_recover=lambda _pid: _recover_control(v, actions))
    finally:
        sem.close()


def _break_lock(v, sem, words, holder, token_word, recovery_byte, what, actions, **lock_kw):
    """Break ``what`` (semaphore ``sem``, holder record at ``words[holder]``) if its holder
    died, then release it.

    The breaking is the engine's own (:meth:`shmq._lock.RecoverableLock.recover_if_dead`:
    under the recovery byte's fcntl lock, re-checked there, fencing token bumped, the
    structure repaired through ``on_recover``); a live holder is never broken.  A free
    lock with a dead holder's record only has the record cleared.
    """
    word = words[holder]
    if word and holder_alive(word):
        return  # held by a live process (or taken over by one meanwhile)
    if sem.value > 0:
        if word:
            ofd_lock(v.fd, recovery_byte, wait=True)  # one recoverer at a time (as the engine)
            try:
                if words[holder] == word:
                    words[holder] = 0
                    actions.append(f"cleared the stale holder record of dead pid "
                                   f"{holder_pid(word)} in {what} (the lock itself was free)")
            finally:
                ofd_unlock(v.fd, recovery_byte)
        return
    if not word:
        # Held, nobody recorded: re-confirm it persists (a live holder records
        # itself nanoseconds after taking the lock).
        deadline = time.monotonic() + ORPHAN_LOCK_CHECK_S
        while time.monotonic() < deadline:
            if words[holder] or sem.value:
                return
            time.sleep(0.02)
    token = words[token_word]
    # recovery_timeout=0: the engine breaks a lock held with no holder recorded once
    # that has persisted for its recovery period, which the loop above just saw
    lock = RecoverableLock(sem, words, holder, token_word, v, recovery_byte,
                           recovery_timeout=0.0, **lock_kw)
    try:
        broke = lock.recover_if_dead()
    finally:
        lock.close()
    if broke:
        who = f"dead pid {holder_pid(word)}" if word else "a holder that died unrecorded"
        actions.append(f"broke {what} of {who}; fencing token {token} -> {token + 1}")


def _fix_semaphore_value(v, actions):
    sem = existing_semaphore(sem_name(v.geo["sem_prefix"], SEM_WRITER))
    if sem is None:
        return
    ofd_lock(v.fd, F.RECOVERY_LOCK_BYTE, wait=True)
    try:
        before = sem.value
        while sem.value > 1:
            if not sem.acquire(0):
                break
        if before > 1:
            actions.append(f"writer semaphore value {before} -> {sem.value}")
    finally:
        ofd_unlock(v.fd, F.RECOVERY_LOCK_BYTE)
        sem.close()


def _recover_control(v, actions):
    """The engine's post-crash re-derivation of the control words (writer lock held):
    ``eng_repair_control``, what the engine's own lock recovery runs (FIRST_SEQ re-read
    from the header at FIRST_POS, NEXT_POS from walking the headers up to NEXT_SEQ).
    Unlike the engine's recovery, a ring that cannot be walked is left alone (fsck never
    drops frames): that stays a reported problem."""
    _changed, done = _core.repair_control(v.mm, v.geo["ring_offset"], v.geo["ring_bytes"], False)
    actions.extend(done)


def _finish_commit(v, actions):
    _recover_control(v, actions)


def _with_writer_lock(v, actions, timeout, fn):
    sem = _sem(v, sem_name(v.geo["sem_prefix"], SEM_WRITER))
    try:
        if not sem.acquire(timeout):
            actions.append(f"skipped a repair: the writer lock stayed busy for {timeout} s")
            return
        v.ctl[W_LOCK_HOLDER] = holder_word()
        try:
            fn()
        finally:
            v.ctl[W_LOCK_HOLDER] = 0
            sem.release()
    finally:
        sem.close()


def _sem(v, name):
    """A lock semaphore of the spool being repaired; one another user squatted is refused."""
    return open_semaphore(name, 1, v.st.st_mode & 0o666, owner=v.st.st_uid, group=v.st.st_gid)


def _break_group_lock(v, i, actions):
    sem = _sem(v, group_sem_name(v.geo["sem_prefix"], i))
    w = i * F.SLOT_WORDS
    try:
        _break_lock(v, sem, v.slots, w + F.S_LOCK_HOLDER, w + F.S_LOCK_TOKEN,
                    v.slot_byte(i, F.SLOT_RECOVERY_BYTE), f"the lock of group {v.slot_name(i)!r}",
                    actions)
    finally:
        sem.close()


def _fix_slots(v, damaged, actions):
    """Reset or free damaged slots (writer lock held: FIRST_* cannot move under us)."""
    slots = v.slots
    ofd_lock(v.fd, F.TABLE_LOCK_BYTE, wait=True)
    try:
        for i, how in sorted(damaged.items()):
            w = i * F.SLOT_WORDS
            name = v.slot_name(i)
            if how == "free":
                slots[w + F.S_STATE] = F.SLOT_FREE
                v.mm[v.slot_byte(i, F.NAME_OFFSET)] = 0
                actions.append(f"freed damaged slot {i}" + (f" ({name!r})" if name else ""))
            elif how == "hwm":
                if i + 1 > v.ctl[F.W_SLOT_HWM]:
                    v.ctl[F.W_SLOT_HWM] = i + 1
                actions.append(f"made slot {i} ({name!r}) visible to writers (SLOT_HWM -> "
                               f"{v.ctl[F.W_SLOT_HWM]})")
            else:
                if i + 1 > v.ctl[F.W_SLOT_HWM]:
                    v.ctl[F.W_SLOT_HWM] = i + 1
                seq, pos = first_cursor(v)
                old = slots[w + F.S_SEQ], slots[w + F.S_POS]
                slots[w + F.S_POS] = pos  # position first, as readers commit
                slots[w + F.S_SEQ] = seq
                actions.append(f"reset reader {name!r} (slot {i}) from seq {old[0]} / position "
                               f"{old[1]} to the earliest frame (seq {seq})")
    finally:
        ofd_unlock(v.fd, F.TABLE_LOCK_BYTE)
