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
static void bell_now(eng_ring *r, int word) {
    _Atomic uint32_t *w = bell_word(r, word);
    atomic_fetch_add_explicit(w, 1, memory_order_release);
    syscall(SYS_futex, w, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
    ssize_t rc = pwrite(r->fd, "", 1, SHMQ_DOORBELL_BYTE);
    (void)rc; /* a failed doorbell costs an asyncio waiter its safety-net timeout, nothing more */
}

/* The data doorbell rings once per sleep.  A reader about to sleep arms it
 * (W_DATA_ARMED = 1, seq_cst) after reading the futex word and before its
 * last look for a frame; a writer with waiters registered rings only if it
 * takes the arm back (exchange to 0).  Without it, a reader that had parked
 * made every put ring (a futex wake and a pwrite, microseconds each) until it
 * ran again and unregistered: under load, or with a consumer as fast as its
 * producer, most puts of a stream.  No lost wake-up: if the writer's exchange
 * comes before the reader's arm, the reader's look after arming sees the
 * frame the writer committed before it (a Dekker pair: commit, fence,
 * exchange | arm, look); if after, the writer rings, and the futex word it
 * bumps makes the reader's sleep return at once.  A reader woken by a ring
 * that is not its own arms again before it sleeps again.  Readers of an
 * older shmq do not arm: they are woken by the safety net (use one shmq
 * version per spool).  The space doorbell has its own rule (ring_space). */
static void bell_arm(eng_ring *r) {
    atomic_store_explicit(AW(&r->ctl[SHMQ_W_DATA_ARMED]), 1, memory_order_seq_cst);
}

static int bell_disarm(eng_ring *r) {
    _Atomic uint64_t *a = AW(&r->ctl[SHMQ_W_DATA_ARMED]);
    return atomic_load_explicit(a, memory_order_relaxed) && atomic_exchange_explicit(a, 0, memory_order_seq_cst);
}

void ring_bell(eng_ring *r, sem_t *waiters) {
    int v = 0;
    atomic_thread_fence(memory_order_seq_cst);
    if (sem_getvalue(waiters, &v) != 0 || v <= 0) return;
    if (waiters != r->rsem) {
        bell_now(r, SHMQ_W_SPACE_BELL);
    } else if (bell_disarm(r)) {
        bell_now(r, SHMQ_W_DATA_BELL);
    }
}

/* ---- room for a writer blocked on a full block spool ----
 *
 * A writer that found no room (SHMQ_EFULL: consumers' cursors in the way;
 * SHMQ_EBACKLOG: a queue's maxsize items) waits for a burst of room, not for
 * the slowest cursor to move at all: woken at every consumer commit, a
 * producer faster than its consumer would trade a wake with it once per
 * frame (a futex wake in the consumer, a wake and a retry in the writer).
 * The writer says how much room it waits for: the
 * "want" take_room_need recorded with the room marker (an eighth of the
 * ring, at most 64 KiB, or of the backlog), published in W_ROOM_WANT_POS /
 * W_ROOM_WANT_SEQ, and a consumer rings the space bell once the slowest
 * cursor has reached it (ring_space), then marks it SHMQ_ROOM_RANG so that
 * its next commits ring no more until a writer publishes again.  The writer
 * then writes a burst.  It waits for its want a bounded time only
 * (shmq/writer.py's ROOM_BURST_WAIT_S, api.c's ROOM_BURST_WAIT_S), then
 * takes whatever room there is: a consumer that stops before the want costs
 * a write that much delay at most, never a hang.
 *
 * Barrier pair (Dekker, as ring_bell's): the writer publishes its want
 * (seq_cst), fences, then loads the cursors (room_state); a consumer stores
 * its cursor, fences (seq_cst), then loads the waiter count and the want.
 * Either the writer sees the cursor that meets its want (and does not
 * sleep), or the consumer sees the want (and rings).  A want left by a
 * writer that is gone is met (at or below the cursors) or rung: a new one
 * replaces it; a smaller live want of another writer is kept (it rings
 * first, and the woken writers publish again).  Writers of an older shmq
 * publish nothing (0): consumers then ring at every commit; consumers of
 * an older shmq ring at every commit whatever is published.
 * The want is the calling thread's (eng_room_of_thread): room_state is
 * called by the thread whose write found no room. */

/* Publish `want` in control word `word` unless a smaller live want is there
 * (another writer's, not yet met by `floor` and not yet rung). */
static void publish_want(eng_ring *r, int word, uint64_t want, uint64_t floor) {
    if (!want) return;
    _Atomic uint64_t *w = AW(&r->ctl[word]);
    uint64_t cur = atomic_load_explicit(w, memory_order_relaxed);
    while (cur != want && !(cur && cur != SHMQ_ROOM_RANG && cur < want && cur > floor))
        if (atomic_compare_exchange_weak_explicit(w, &cur, want, memory_order_seq_cst, memory_order_relaxed)) break;
}

/* Where a blocked writer stands (after its write found no room): 0 no room
 * yet for that write, 1 room for it, 2 room for a burst (its want).  With
 * `publish`, the wants not met are published first, then the cursors read
 * (the Dekker pair above): a writer about to sleep calls it with publish. */
int room_state(eng_ring *r, int publish) {
    const eng_room *m = &eng_room_of_thread;
    uint64_t fp = 0, fs = 0;
    if (publish && (m->want_pos || m->want_seq)) {
        slot_floor(r, SHMQ_S_POS, &fp);
        slot_floor(r, SHMQ_S_SEQ, &fs);
        if (m->want_pos && fp < m->want_pos) publish_want(r, SHMQ_W_ROOM_WANT_POS, m->want_pos, fp);
        if (m->want_seq && fs < m->want_seq) publish_want(r, SHMQ_W_ROOM_WANT_SEQ, m->want_seq, fs);
        atomic_thread_fence(memory_order_seq_cst); /* the wants before the cursors (ring_space's pair) */
    }
    /* With no named reader or group the floor is FIRST_POS (room_floor):
     * "room" there would send the writer back to a write that finds none,
     * in a loop at full CPU. */
    fp = room_floor(r);
    slot_floor(r, SHMQ_S_SEQ, &fs);
    if ((m->need_pos && fp < m->need_pos) || (m->need_seq && fs < m->need_seq)) return 0;
    return (m->want_pos && fp < m->want_pos) || (m->want_seq && fs < m->want_seq) ? 1 : 2;
}

/* A writer done waiting takes back its wants (or the mark that they were rung). */
void room_unwant(eng_ring *r) {
    const eng_room *m = &eng_room_of_thread;
    int words[2] = {SHMQ_W_ROOM_WANT_POS, SHMQ_W_ROOM_WANT_SEQ};
    uint64_t mine[2] = {m->want_pos, m->want_seq};
    for (int i = 0; i < 2; i++) {
        _Atomic uint64_t *w = AW(&r->ctl[words[i]]);
        uint64_t cur = atomic_load_explicit(w, memory_order_relaxed);
        if (cur && (cur == mine[i] || cur == SHMQ_ROOM_RANG))
            atomic_compare_exchange_strong_explicit(w, &cur, 0, memory_order_relaxed, memory_order_relaxed);
    }
}

/* A consumer after storing its cursor (a named reader's commit, a group's
 * take): wake writers waiting for room, if any wait and, when one published
 * a want, once the slowest cursor has reached it. */
void ring_space(eng_ring *r) {
    int v = 0;
    atomic_thread_fence(memory_order_seq_cst); /* our cursor before the waiters and wants (room_state's pair) */
    if (sem_getvalue(r->fsem, &v) != 0 || v <= 0) return;
    uint64_t wp = ld_rlx(&r->ctl[SHMQ_W_ROOM_WANT_POS]), ws = ld_rlx(&r->ctl[SHMQ_W_ROOM_WANT_SEQ]), f;
    if (wp || ws) { /* a writer said how much room it waits for */
        int met_pos = wp && wp != SHMQ_ROOM_RANG && slot_floor(r, SHMQ_S_POS, &f) && f >= wp;
        int met_seq = ws && ws != SHMQ_ROOM_RANG && slot_floor(r, SHMQ_S_SEQ, &f) && f >= ws;
        if (!met_pos && !met_seq) return;
        if (met_pos)
            atomic_compare_exchange_strong_explicit(AW(&r->ctl[SHMQ_W_ROOM_WANT_POS]), &wp, SHMQ_ROOM_RANG,
                                                    memory_order_relaxed, memory_order_relaxed);
        if (met_seq)
            atomic_compare_exchange_strong_explicit(AW(&r->ctl[SHMQ_W_ROOM_WANT_SEQ]), &ws, SHMQ_ROOM_RANG,
                                                    memory_order_relaxed, memory_order_relaxed);
    }
    bell_now(r, SHMQ_W_SPACE_BELL);
}

/* The doorbell word's value: read it after registering as a waiter and
 * before re-checking, then pass it to eng_bell_wait.  The data doorbell is
 * armed here too (ring_bell): call it before every re-check that may be
 * followed by a sleep. */
uint32_t eng_bell_seen(eng_ring *r, int space) {
    uint32_t seen =
        atomic_load_explicit(bell_word(r, space ? SHMQ_W_SPACE_BELL : SHMQ_W_DATA_BELL), memory_order_acquire);
    if (!space) bell_arm(r);
    return seen;
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
 * most 2 ms, and not past 50 us (or the lag's copy at 2 GB/s, if longer)
 * without progress (a stalled consumer: grow at once).  1 if every consumer
 * caught up; 0 if not in time; SHMQ_ECLOSED if the handle was closed
 * meanwhile. */
#define CATCH_UP_MAX_NS 2000000ull
#define CATCH_UP_STALL_NS 50000ull
int wait_caught_up(eng_ring *r, uint64_t start, uint64_t lag, uint64_t lap_share) {
    uint64_t budget = 50000 + lag / 4;
    if (lap_share > budget) budget = lap_share;
    if (budget > CATCH_UP_MAX_NS) budget = CATCH_UP_MAX_NS;
    /* A consumer's cursor moves only when a frame's copy is done: a 1 MiB
     * frame takes it longer than CATCH_UP_STALL_NS, which is no stall (it
     * made 1 MiB frames grow the zone at every lap: a grown spool ran at
     * 56% of a fixed one).  So the stall limit covers the lag at 2 GB/s. */
    return wait_floor(r, start, budget, lag / 2 > CATCH_UP_STALL_NS ? lag / 2 : CATCH_UP_STALL_NS);
}

/* The loop of wait_caught_up (and of a fixed ring's early wrap, write.c's
 * hot_place): every named cursor at `start` or past it, within `budget` ns,
 * giving up after `stall` ns without progress, the caller's lock dropped.
 * 1, 0, or SHMQ_ECLOSED. */
int wait_floor(eng_ring *r, uint64_t start, uint64_t budget, uint64_t stall) {
    uint64_t floor = 0, last = 0;
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
            if (now - t0 > budget || now - moved > stall) break;
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
 * again.  The moment is CAUGHT_UP_SPIN_NS, plus the time the last frame taken
 * would take to copy at SPIN_COPY_BYTES_PER_NS (at most SPIN_MAX_NS): a
 * writer of 1 MiB frames needs tens of microseconds per frame, and a reader
 * that parks between them pays a wake-up per frame (and, at a fixed ring's
 * early wrap, per lap).  So a reader spins at most about as long as its own
 * copy of the frame took; a spin longer than CAUGHT_UP_SPIN_NS drops the
 * caller's lock (the GIL: the process's other threads run meanwhile), and
 * none outlasts `deadline` (a mono_ns() value; 0: none).  The cap covers
 * frames up to 16 MiB: a fixed ring's early wrap waits for the consumers to
 * have taken the frame just written (hot_place), and a 5 MiB frame's rule is
 * 329 us; a reader that parked before the writer's next frame would keep the
 * writer waiting for its wake-up at every wrap.  1 if a frame is there now. */
#define CAUGHT_UP_SPIN_NS 2000ull
#define SPIN_COPY_BYTES_PER_NS 16ull
#define SPIN_MAX_NS 1000000ull
uint64_t eng_spin_ns(uint64_t last_len) {
    uint64_t limit = CAUGHT_UP_SPIN_NS + last_len / SPIN_COPY_BYTES_PER_NS;
    return limit > SPIN_MAX_NS ? SPIN_MAX_NS : limit;
}

int eng_spin_for_frame(eng_cursor *c, uint64_t deadline) {
    return eng_spin(c, eng_spin_ns(ld_rlx(&c->last_len)), deadline);
}

int eng_spin(eng_cursor *c, uint64_t limit, uint64_t deadline) {
    eng_ring *r = c->ring;
    uint64_t t0 = 0;
    if (deadline) { /* a timeout bounds the spin too */
        uint64_t now = mono_ns();
        uint64_t left = deadline > now ? deadline - now : 0;
        if (left < limit) limit = left;
    }
    if (eng_cursor_check(c) < 0) return 0;
    int unlocked = limit > CAUGHT_UP_SPIN_NS, got = 0, group = c->kind == K_GROUP;
    uint64_t seq = 0;
    void *saved = NULL;
    if (unlocked) {
        /* Without the caller's lock another thread may take the cursor's lock
         * (whose slow path drops the caller's lock itself): a private cursor's
         * seq is read once, here; a group's shared one needs no lock. */
        if (!group) {
            if (eng_cursor_lock(c) < 0) return 1; /* let the take say what is wrong */
            seq = c->seq;
            eng_cursor_unlock(c);
        }
        saved = ring_block(r);
    }
    for (unsigned spin = 0;; spin++) {
        if (unlocked && !group ? seq < ld_acq(&r->ctl[SHMQ_W_NEXT_SEQ]) : eng_cursor_available(c)) {
            got = 1;
            break;
        }
        if ((spin & 7) == 7) {
            uint64_t now = mono_ns();
            if (!t0) t0 = now;
            else if (now - t0 > limit) break;
        }
        cpu_relax();
    }
    if (unlocked) {
        ring_unblock(r, saved);
        if (ring_closing(r)) return 0; /* the caller's park reports the close */
    }
    return got;
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
        bell_arm(r); /* before the look below (ring_bell's pair) */
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
