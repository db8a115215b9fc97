/*
 * shmq/engine/wait.c: waiting -- the doorbells (futex word + inotify byte),
 * the writer's wait for a catching-up consumer, and a blocking read's spin
 * and park.
 *
 * Barrier pairs: ring_bell's seq_cst fence orders a publication before
 * reading the waiter count, against the waiter's "register (sem_post), read
 * the bell word, re-check" (eng_park, shmq/_notify.py's Doorbell.wait): a
 * Dekker pair, so a waiter either sees the frame or gets woken.
 */
#include "engine.h"

/* A close that came while another thread was inside a blocking section
 * (busy) was deferred: the last one out finishes it. */
void ring_finish(eng_ring *r) {
    if (ring_closing(r) && !atomic_load_explicit(&r->busy, memory_order_acquire)) {
        int expected = 1;
        if (atomic_compare_exchange_strong(&r->closing, &expected, 0)) eng_ring_release(r);
    }
}

/* After a blocking wait on `s`: if the handle was closed meanwhile, give
 * back what we took (`held`: the semaphore was acquired) and finish the
 * deferred close.  1: closed (the caller fails with SHMQ_ECLOSED); 0: go on. */
int ring_closed_meanwhile(eng_ring *r, int held, sem_t *s) {
    if (!ring_closing(r)) return 0;
    if (held && s) sem_post(s);
    ring_finish(r);
    eng_fail(SHMQ_ECLOSED, "spool handle was closed by another thread");
    return 1;
}

/* Wake the other side if it has registered waiters.  The seq_cst fence
 * orders our publication before reading the waiter count (the Dekker pair
 * with the waiter's "register, then re-check").  Two wake-ups: the futex
 * word, which blocking calls sleep on (a futex wake is as quick as a
 * pipe's), then the doorbell byte, whose inotify event wakes asyncio
 * loops.  The word is bumped (release: after the publication) before the
 * wake, so a waiter that read it before re-checking either sees the bump
 * and does not sleep, or is asleep and woken. */
void ring_bell(eng_ring *r, sem_t *waiters) {
    int v = 0;
    atomic_thread_fence(memory_order_seq_cst);
    if (sem_getvalue(waiters, &v) == 0 && v > 0) {
        _Atomic uint32_t *w = bell_word(r, waiters == r->rsem ? SHMQ_W_DATA_BELL : SHMQ_W_SPACE_BELL);
        atomic_fetch_add_explicit(w, 1, memory_order_release);
        syscall(SYS_futex, w, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
        ssize_t rc = pwrite(r->fd, "", 1, SHMQ_DOORBELL_BYTE);
        (void)rc; /* a failed doorbell costs an asyncio waiter its safety-net timeout, nothing more */
    }
}

/* The doorbell word's value: read it after registering as a waiter and
 * before re-checking, then pass it to eng_bell_wait. */
uint32_t eng_bell_seen(eng_ring *r, int space) {
    return atomic_load_explicit(bell_word(r, space ? SHMQ_W_SPACE_BELL : SHMQ_W_DATA_BELL), memory_order_acquire);
}

/* Sleep, the caller's lock dropped, until the doorbell word is no longer
 * `seen` (someone rang), a signal arrives or `timeout` seconds pass.  Any
 * return means "re-check": 0, SHMQ_ECALLBACK (interrupted) or SHMQ_ECLOSED.
 * The futex is a shared one (keyed by the file's page), so rings from any
 * process wake it. */
int eng_bell_wait(eng_ring *r, int space, uint32_t seen, double timeout) {
    if (timeout <= 0) return 0;
    if (timeout > 3600) timeout = 3600;
    struct timespec ts = {(time_t)timeout, (long)((timeout - (double)(time_t)timeout) * 1e9)};
    _Atomic uint32_t *w = bell_word(r, space ? SHMQ_W_SPACE_BELL : SHMQ_W_DATA_BELL);
    void *saved = ring_block(r);
    syscall(SYS_futex, w, FUTEX_WAIT, seen, &ts, NULL, 0); /* any return means re-check */
    ring_unblock(r, saved);
    if (ring_closed_meanwhile(r, 0, NULL)) return SHMQ_ECLOSED;
    return hooks_interrupted(r->hooks) ? SHMQ_ECALLBACK : 0;
}

/* The writer is about to allocate a fresh segment while every consumer is
 * within `lag` bytes (at most two segments) of `start`: usually one still
 * copying the batch just committed, or catching up the frames that piled up
 * while it woke.  Fresh pages cost far more than that copy (the kernel zeroes
 * them; a VM may trap on first touch), and a writer that always checked at
 * that moment would never wrap early: a fast consumer would let the zone
 * climb to the ceiling.  So wait for it, the caller's lock dropped (the
 * consumer may be a thread of this process), for the larger of 50 us plus
 * its copy at 4 GB/s and `lap_share` (a sixteenth of the lap just written:
 * small frames drain far slower than 4 GB/s, and a zone whose laps are too
 * short for its drains grows until the wait costs at most that share), at
 * most 2 ms, and not past 50 us without progress (a stalled consumer: grow
 * at once).  1 if every consumer caught up; 0 if not in time; SHMQ_ECLOSED
 * if the handle was closed meanwhile. */
#define CATCH_UP_MAX_NS 2000000ull
#define CATCH_UP_STALL_NS 50000ull
int wait_caught_up(eng_ring *r, uint64_t start, uint64_t lag, uint64_t lap_share) {
    uint64_t floor = 0, last = 0, budget = 50000 + lag / 4;
    if (lap_share > budget) budget = lap_share;
    if (budget > CATCH_UP_MAX_NS) budget = CATCH_UP_MAX_NS;
    int ok = 0, found = 1;
    void *saved = ring_block(r);
    uint64_t t0 = mono_ns(), moved = t0;
    for (unsigned spin = 0;; spin++) {
        found = slot_floor(r, SHMQ_S_POS, &floor);
        if (!found || floor >= start) {
            ok = found;
            break;
        }
        if ((spin & 63) == 63) {
            uint64_t now = mono_ns();
            if (floor != last) {
                last = floor;
                moved = now;
            }
            if (now - t0 > budget || now - moved > CATCH_UP_STALL_NS) break;
        }
        cpu_relax();
    }
    ring_unblock(r, saved);
    return ring_closing(r) ? SHMQ_ECLOSED : ok;
}

/* A blocking read that found nothing: spin a moment (the caller's lock held,
 * no syscall) for the writer's next commit.  A consumer as fast as its
 * producer is caught up between most frames of a stream; the wait it would
 * enter instead costs microseconds and registers it as a waiter, which makes
 * every put ring the doorbell (a futex wake and a pwrite) until it is out
 * again.  1 if a frame is there now. */
#define CAUGHT_UP_SPIN_NS 2000ull
int eng_spin_for_frame(eng_cursor *c) {
    eng_ring *r = c->ring;
    if (eng_cursor_check(c) < 0) return 0;
    uint64_t t0 = 0;
    for (unsigned spin = 0;; spin++) {
        if (eng_cursor_available(c)) return 1;
        if ((spin & 7) == 7) {
            uint64_t now = mono_ns();
            if (!t0) t0 = now;
            else if (now - t0 > CAUGHT_UP_SPIN_NS) return 0;
        }
        cpu_relax();
        (void)r;
    }
}

/* The longest sleep of a parked read. */
static struct timespec safety_net(eng_ring *r) {
    double s = r->hooks && r->hooks->safety_net_s > 0 ? r->hooks->safety_net_s : 0.1;
    struct timespec ts = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
    return ts;
}

/* A blocking read that found nothing, even after the spin: wait for a frame
 * until `deadline` (a mono_ns() value; 0: none).  The protocol is the one of
 * shmq/_notify.py's Doorbell.wait: register as a data waiter (sem_post, a
 * full fence), read the doorbell word, re-check by calling take(ctx), sleep
 * on the word (the caller's lock dropped, at most the safety net, never past
 * the deadline) while it still holds what was read.  Returns what take
 * returned once it is not 0 (1: got something; < 0: an error), SHMQ_EEMPTY
 * once the deadline passed, SHMQ_ECALLBACK if a wake-up found the caller
 * interrupted (a signal handler raised), SHMQ_ECLOSED if the reader or the
 * handle was closed by another thread meanwhile. */
int eng_park(eng_cursor *c, eng_take_fn take, void *ctx, uint64_t deadline) {
    eng_ring *r = c->ring;
    _Atomic uint32_t *w = bell_word(r, SHMQ_W_DATA_BELL);
    sem_t *reg = r->rsem;
    /* Busy for as long as we are registered: a close() by another thread
     * meanwhile (even one noticed inside a group take) is deferred until we
     * have unregistered, so the semaphore is never used after sem_close. */
    atomic_fetch_add_explicit(&r->busy, 1, memory_order_acq_rel);
    sem_post(reg);
    int got;
    for (;;) {
        uint32_t seen = atomic_load_explicit(w, memory_order_acquire);
        if (ring_closing(r)) {
            got = eng_fail(SHMQ_ECLOSED, "spool handle was closed by another thread");
            break;
        }
        if ((got = eng_cursor_check(c)) < 0) break; /* the reader was closed by another thread meanwhile */
        if ((got = take(ctx)) != 0) break;
        struct timespec ts = safety_net(r);
        if (deadline) { /* a timeout: SHMQ_EEMPTY once it has passed, and never sleep past it */
            uint64_t now = mono_ns();
            if (now >= deadline) {
                got = SHMQ_EEMPTY;
                break;
            }
            uint64_t left = deadline - now;
            if (left < (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec) {
                ts.tv_sec = (time_t)(left / 1000000000ull);
                ts.tv_nsec = (long)(left % 1000000000ull);
            }
        }
        atomic_fetch_add_explicit(&c->busy, 1, memory_order_acq_rel);
        void *saved = hooks_unlock(r->hooks);
        syscall(SYS_futex, w, FUTEX_WAIT, seen, &ts, NULL, 0); /* any return means re-check */
        hooks_relock(r->hooks, saved);
        atomic_fetch_sub_explicit(&c->busy, 1, memory_order_acq_rel);
        eng_cursor_finish(c);
        /* On every wake, not only EINTR: a signal delivered to another
         * thread of the process sets Python's flag without interrupting us,
         * and its handler must still run (in the main thread) within the
         * safety net. */
        if (hooks_interrupted(r->hooks)) {
            got = SHMQ_ECALLBACK;
            break;
        }
    }
    sem_trywait(reg); /* EAGAIN: the count was reset meanwhile (fsck --repair) */
    atomic_fetch_sub_explicit(&r->busy, 1, memory_order_acq_rel);
    ring_finish(r); /* a close deferred while we were registered */
    return got;
}
