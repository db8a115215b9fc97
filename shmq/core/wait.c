/*
 * shmq/core/wait.c: waiting -- POSIX semaphore locks with a deadline (the
 * GIL released), the doorbells (futex word + inotify byte), the writer's
 * wait for a catching-up consumer, and a blocking get's spin and park.
 *
 * Barrier pairs: ring_bell's seq_cst fence orders a publication before
 * reading the waiter count, against the waiter's "register (sem_post), read
 * the bell word, re-check" (park_take, shmq/_notify.py's Doorbell.wait):
 * a Dekker pair, so a waiter either sees the frame or gets woken.
 */
#include "core.h"

/* Waits with a deadline on the monotonic clock (sem_clockwait, glibc 2.30);
 * where that is missing (manylinux_2_28's glibc 2.28, RHEL 8), sem_timedwait
 * on the wall clock: a clock step during a lock wait then lengthens or
 * shortens that one wait, which callers bound and retry anyway. */
#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 30))
#define SEM_WAIT_CLOCK CLOCK_MONOTONIC
#define SEM_WAIT_UNTIL(s, dl) sem_clockwait((s), CLOCK_MONOTONIC, (dl))
#else
#define SEM_WAIT_CLOCK CLOCK_REALTIME
#define SEM_WAIT_UNTIL(s, dl) sem_timedwait((s), (dl))
#endif


/* Wait for a POSIX semaphore for at most wait_s seconds, GIL released while
 * waiting.  0: acquired; 1: not within wait_s; -1: exception set (a signal
 * handler raised: nothing is held at that point).  `ring` (a Ring, or NULL)
 * is marked busy while the GIL is released, so that another thread closing
 * it meanwhile defers the release and this call fails cleanly instead of
 * touching an unmapped file.
 *
 * `word` (or NULL): the lock's shared holder word, set to `holder` the
 * moment the semaphore is taken, before the GIL is waited for again.  A
 * lock that is held with no holder recorded for a whole recovery period is
 * broken as a dead holder's (shmq/_lock.py, recover_if_dead), and taking
 * the GIL back can take that long in a process whose other threads hold it
 * (seen under emulation: two consumers in the same critical section, one
 * lease granted twice); recording it here leaves only the instant between
 * the wait's return and this store. */
int sem_lock_as(sem_t *s, double wait_s, Ring *ring, uint64_t *word, uint64_t holder) {
    if (sem_trywait(s) == 0) {
        if (word) st_rlx(word, holder);
        return 0;
    }
    if (errno != EAGAIN && errno != EINTR) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    if (wait_s <= 0) return 1;
    struct timespec dl;
    clock_gettime(SEM_WAIT_CLOCK, &dl);
    double whole = (double)(long long)wait_s;
    dl.tv_sec += (time_t)whole;
    dl.tv_nsec += (long)((wait_s - whole) * 1e9);
    if (dl.tv_nsec >= 1000000000L) {
        dl.tv_sec += 1;
        dl.tv_nsec -= 1000000000L;
    }
    for (;;) {
        int rc, err;
        if (ring) ring->busy++;
        Py_BEGIN_ALLOW_THREADS
        rc = SEM_WAIT_UNTIL(s, &dl);
        err = errno;
        if (rc == 0 && word) st_rlx(word, holder); /* still mapped: `ring` is busy */
        Py_END_ALLOW_THREADS
        if (ring) ring->busy--;
        if (ring && ring->closing && rc == 0 && word) st_rlx(word, 0); /* given back just below */
        if (ring && ring_closed_meanwhile(ring, rc == 0, s)) return -1;
        if (rc == 0) return 0;
        if (err == ETIMEDOUT) return 1;
        if (err == EINTR) {
            if (PyErr_CheckSignals() < 0) return -1; /* e.g. KeyboardInterrupt: we hold nothing */
            continue;
        }
        errno = err;
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
}

/* Wake the other side if it has registered waiters.  The seq_cst fence
 * orders our publication before reading the waiter count (the Dekker pair
 * with the waiter's "register, then re-check").  Two wake-ups: the futex
 * word, which blocking calls sleep on (a futex wake is as quick as a
 * pipe's), then the doorbell byte, whose inotify event wakes asyncio
 * loops.  The word is bumped (release: after the publication) before the
 * wake, so a waiter that read it before re-checking either sees the bump
 * and does not sleep, or is asleep and woken. */
void ring_bell(Ring *r, sem_t *waiters) {
    int v = 0;
    atomic_thread_fence(memory_order_seq_cst);
    if (sem_getvalue(waiters, &v) == 0 && v > 0) {
        _Atomic uint32_t *w = bell_word(r, waiters == r->rsem ? W_DATA_BELL : W_SPACE_BELL);
        atomic_fetch_add_explicit(w, 1, memory_order_release);
        syscall(SYS_futex, w, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
        ssize_t rc = pwrite(r->fd, "", 1, DOORBELL_BYTE);
        (void)rc; /* a failed doorbell costs an asyncio waiter its safety-net timeout, nothing more */
    }
}

/* The writer is about to allocate a fresh segment while every consumer is
 * within `lag` bytes (at most two segments) of `start`: usually one still
 * copying the batch just committed, or catching up the frames that piled up
 * while it woke.  Fresh pages cost far more than that copy (the kernel zeroes
 * them; a VM may trap on first touch), and a writer that always checked at
 * that moment would never wrap early: a fast consumer would let the zone
 * climb to the ceiling.  So wait for it, with the GIL released (the consumer
 * may be a thread of this process), for the larger of 50 us plus its copy at
 * 4 GB/s and `lap_share` (a sixteenth of the lap just written: small frames
 * drain far slower than 4 GB/s, and a zone whose laps are too short for its
 * drains grows until the wait costs at most that share), at most 2 ms, and
 * not past 50 us without progress (a stalled consumer: grow at once).
 * 1 if every consumer caught up; 0 if not in time; ECANCELED if the handle
 * was closed meanwhile. */
#define CATCH_UP_MAX_NS 2000000ull
#define CATCH_UP_STALL_NS 50000ull
int wait_caught_up(Ring *r, uint64_t start, uint64_t lag, uint64_t lap_share) {
    uint64_t floor = 0, last = 0, budget = 50000 + lag / 4;
    if (lap_share > budget) budget = lap_share;
    if (budget > CATCH_UP_MAX_NS) budget = CATCH_UP_MAX_NS;
    int ok = 0, found = 1;
    r->busy++;
    Py_BEGIN_ALLOW_THREADS
    uint64_t t0 = mono_ns(), moved = t0;
    for (unsigned spin = 0;; spin++) {
        found = slot_floor(r, S_POS, &floor);
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
    Py_END_ALLOW_THREADS
    r->busy--;
    return r->closing ? ECANCELED : ok;
}

/* A blocking get that found nothing: spin a moment (GIL held, no syscall) for
 * the writer's next commit.  A consumer as fast as its producer is caught up
 * between most frames of a stream; the wait it would enter instead costs
 * microseconds and registers it as a waiter, which makes every put ring the
 * doorbell (a futex wake and a pwrite) until it is out again.
 * 1 if a frame is there now. */
#define CAUGHT_UP_SPIN_NS 2000ull
static int spin_for_frame(Cursor *c) {
    Ring *r = c->ring;
    if (c->closed_msg || !r->have_buf) return 0;
    uint64_t t0 = 0;
    for (unsigned spin = 0;; spin++) {
        uint64_t seq = c->kind == K_GROUP ? ld_acq(&cur_slot(c)[S_SEQ]) : c->seq;
        if (seq < ld_acq(&r->ctl[W_NEXT_SEQ])) return 1;
        if ((spin & 7) == 7) {
            uint64_t now = mono_ns();
            if (!t0) t0 = now;
            else if (now - t0 > CAUGHT_UP_SPIN_NS) return 0;
        }
        cpu_relax();
    }
}

/* The longest sleep of a parked get, as a timespec: the module state's
 * safety net (shmq._notify hands its SAFETY_NET_S over, 0.1 s unless a
 * test raised it). */
static struct timespec safety_net(CoreState *st) {
    double s = st->safety_net_s;
    struct timespec ts = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
    return ts;
}

/* A blocking get that found nothing, even after the spin: wait for a frame
 * here, in C, until `deadline` (a mono_ns() value; 0: none), so that a
 * wake-up costs no Python between the futex returning and the frame being
 * taken.  The protocol is the one of shmq/_notify.py's Doorbell.wait:
 * register as a data waiter (sem_post, a full fence), read the doorbell
 * word, re-check by taking, sleep on the word (GIL released, at most
 * the safety net, never past the deadline) while it still holds
 * what was read.  `take` returns a new reference; anything but `nothing` (a
 * frame, a status, NULL with an exception) ends the wait, and `nothing` is
 * returned once the deadline has passed.  Signals run their Python handlers
 * here; one that raises (Ctrl-C) ends the wait with nothing held; a close of
 * the reader or the handle by another thread ends it with ValueError.
 * Returns NULL with no exception set when this case is the Python slow
 * path's: a group with statistics to flush (that takes the group lock) or a
 * growable spool due for an idle trim (trim_due: the reader trims after a
 * while). */
static PyObject *park_take(Cursor *c, take_fn take, PyObject *nothing, uint64_t deadline) {
    Ring *r = c->ring;
    if ((c->kind == K_GROUP && (c->n || c->lost_pending)) || trim_due(r)) return NULL;
    if (c->kind == K_NAMED) flush_locked(c); /* what a waiting reader shows the world */
    _Atomic uint32_t *w = bell_word(r, W_DATA_BELL);
    sem_t *reg = r->rsem;
    /* Busy for as long as we are registered: a close() by another thread
     * meanwhile (even one noticed inside a group take) is deferred until we
     * have unregistered, so the semaphore is never used after sem_close. */
    r->busy++;
    sem_post(reg);
    PyObject *got;
    for (;;) {
        uint32_t seen = atomic_load_explicit(w, memory_order_acquire);
        if (r->closing) {
            PyErr_SetString(PyExc_ValueError, "spool handle was closed by another thread");
            got = NULL;
            break;
        }
        if (cursor_check(c) < 0) { /* the reader was closed by another thread meanwhile */
            got = NULL;
            break;
        }
        got = take(c);
        if (got != nothing) break;
        Py_DECREF(got);
        struct timespec ts = safety_net(r->st);
        if (deadline) { /* a timeout: `nothing` once it has passed, and never sleep past it */
            uint64_t now = mono_ns();
            if (now >= deadline) {
                got = Py_NewRef(nothing);
                break;
            }
            uint64_t left = deadline - now;
            if (left < (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec) {
                ts.tv_sec = (time_t)(left / 1000000000ull);
                ts.tv_nsec = (long)(left % 1000000000ull);
            }
        }
        c->busy++;
        Py_BEGIN_ALLOW_THREADS
        syscall(SYS_futex, w, FUTEX_WAIT, seen, &ts, NULL, 0); /* any return means re-check */
        Py_END_ALLOW_THREADS
        c->busy--;
        cursor_finish(c);
        /* On every wake, not only EINTR: a signal delivered to another
         * thread of the process sets Python's flag without interrupting us,
         * and its handler must still run (in the main thread) within the
         * safety net. */
        if (PyErr_CheckSignals() < 0) {
            got = NULL;
            break;
        }
    }
    sem_trywait(reg); /* EAGAIN: the count was reset meanwhile (fsck --repair) */
    r->busy--;
    ring_finish(r); /* a close deferred while we were registered */
    if (!got && !PyErr_Occurred()) PyErr_SetString(PyExc_SystemError, "park_take: no result");
    return got;
}

/* Whether a get(block, timeout) may wait in C: block True (or omitted) and
 * timeout None or a positive finite int or float (not a bool: Python
 * validates everything else, and raises the stdlib's errors).  *deadline:
 * 0 for no timeout, else the mono_ns() at which it passes. */
int park_deadline(PyObject *block, PyObject *timeout, uint64_t *deadline) {
    *deadline = 0;
    if (block && block != Py_True) return 0;
    if (!timeout || timeout == Py_None) return 1;
    if (!PyFloat_CheckExact(timeout) && !PyLong_CheckExact(timeout)) return 0;
    double t = PyFloat_AsDouble(timeout);
    if (t == -1.0 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    if (!(t > 0 && t < 1e9)) return 0; /* NaN, zero, negative, absurd: Python's */
    *deadline = mono_ns() + (uint64_t)(t * 1e9);
    return 1;
}

/* The timeout to hand the Python slow path after part of it was spent here. */
PyObject *time_left(PyObject *timeout, uint64_t deadline) {
    if (!deadline) return Py_NewRef(timeout ? timeout : Py_None);
    uint64_t now = mono_ns();
    return PyFloat_FromDouble(now >= deadline ? 0.0 : (double)(deadline - now) / 1e9);
}

static PyObject *raise_empty(CoreState *st, PyObject *timeout) {
    PyErr_Format(st->EmptyError ? st->EmptyError : PyExc_RuntimeError, "no frame within %S s", timeout);
    return NULL;
}

/* What get_api and get_obj_api do once a take found `nothing` and the call
 * may wait here (park_deadline): spin, then park until `deadline`.  A new
 * reference to what a take returned instead (a frame or an object, or a
 * status for Python); `nothing` when the wait is Python's to do (see
 * park_take); NULL with an exception, shmq.Empty once `timeout` passed. */
PyObject *wait_take(Cursor *c, take_fn take, PyObject *nothing, uint64_t deadline, PyObject *timeout) {
    if (spin_for_frame(c)) {
        PyObject *got = take(c);
        if (got != nothing) return got;
        Py_DECREF(got);
    }
    PyObject *got = park_take(c, take, nothing, deadline);
    if (got == nothing) { /* the deadline passed */
        Py_DECREF(got);
        return raise_empty(c->ring->st, timeout);
    }
    if (!got && !PyErr_Occurred()) return Py_NewRef(nothing);
    return got;
}

