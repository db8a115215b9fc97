/*
 * shmq/engine/read.c: the reader's out-of-line parts -- the oldest frame and
 * resync after an overwrite, page release behind a reader, its statistics
 * and commits, a cursor's lifecycle, the group lock, and locating a frame
 * by seq.  The hot read loop and the takes are take.h's.
 */
#include "engine.h"

/* A consistent (seq, pos) of the oldest frame, read lock-free (inspect.c's). */
int first_cursor(eng_ring *r, uint64_t *oseq, uint64_t *opos) {
    if (eng_first_cursor(r->ctl, r->ring, r->ring_bytes, oseq, opos) == 0) return 0;
    return eng_fail(SHMQ_ECORRUPT, "%s: cannot find the oldest frame (ring corrupt?); " SHMQ_RING_ADVICE, r->path);
}

/* The header at the cursor is not frame `seq` (or was evicted): find out why.
 * Adds skipped frames to *lost.  0, or SHMQ_ECORRUPT. */
int resync(eng_ring *r, uint64_t *seq, uint64_t *pos, const shmq_frame_header *h, uint64_t off, uint64_t *lost) {
    uint64_t *c = r->ctl;
    if (*seq < ld_acq(&c[SHMQ_W_FIRST_SEQ]) || *pos < ld_acq(&c[SHMQ_W_FIRST_POS])) {
        uint64_t s, p;
        int rc = first_cursor(r, &s, &p);
        if (rc < 0) return rc;
        if (s < *seq)
            return eng_fail(SHMQ_ECORRUPT, "%s: reader cursor seq %llu is ahead of the oldest frame %llu yet "
                            "unreadable; " SHMQ_RING_ADVICE, r->path, (unsigned long long)*seq, (unsigned long long)s);
        *lost += s - *seq; /* overwritten: jump to the oldest frame, count exactly */
        *seq = s;
        *pos = p;
        return 0;
    }
    if (*seq < h->seq && h->seq < ld_acq(&c[SHMQ_W_NEXT_SEQ]) && header_sane(h, off, r->ring_bytes)) {
        /* A cursor committed with its position but not its seq (process
         * killed between the two stores): the frames in between were read. */
        *seq = h->seq;
        return 0;
    }
    return eng_fail(SHMQ_ECORRUPT, "%s: corrupt frame header at seq %llu (ring offset %llu: header says seq %llu, "
                    "%u bytes stored, %u bytes long); " SHMQ_RING_ADVICE, r->path, (unsigned long long)*seq,
                    (unsigned long long)off, (unsigned long long)h->seq, h->stored, h->length);
}


/* ---- releasing pages behind a reader ----
 * Every tmpfs page a reader touched would stay mapped: reading 1 GiB through a
 * 1 GiB spool would grow its RSS by 1 GiB.  On a MAP_SHARED mapping
 * MADV_DONTNEED only drops this process's page-table entries: the data stays
 * in the shared file for the writer and every other reader, and a later access
 * here (a reader behind this one in the same process, a pinned zero-copy view)
 * faults the same page back in.  So releasing never changes what anyone reads,
 * it only costs a minor fault if the page is touched again: it is done once per
 * RELEASE_CHUNK of progress, and only on rings large enough for it to matter. */
#define RELEASE_CHUNK ((uint64_t)4 << 20)
/* Rings (and growable zones) of at most KEEP_WHOLE bytes stay mapped: their
 * reader's RSS is bounded by their size anyway, and releasing a lap behind
 * the reader makes it refault every page each lap (1 MiB frames through a
 * 64 MiB ring: 6.1 GB/s released, 10.7 GB/s kept; through a 16 MiB ring a
 * third of the speed).  On larger rings the last KEEP_BEHIND bytes behind
 * the cursor stay mapped, so a reader's RSS stays under about KEEP_WHOLE
 * whatever it reads. */
#define KEEP_WHOLE ((uint64_t)64 << 20)
#define KEEP_BEHIND ((uint64_t)32 << 20)

void release_behind(eng_ring *r, uint64_t *released, uint64_t pos) {
    uint64_t ring = r->ring_bytes;
    if (!r->ring || ring <= KEEP_WHOLE) return; /* closed: the mapping is gone, never advise */
    if (pos < *released) { /* moved back (a seek): nothing behind it is ours to count yet */
        *released = pos;
        return;
    }
    if (pos - *released < KEEP_BEHIND + RELEASE_CHUNK) return;
    /* Only now the shared ALLOC word: it sits on the control line the writer
     * stores to on every put, and a load per get would bounce that line
     * between the two cores (a fifth of a growable ring's 100 B throughput). */
    if (r->segment && ld_rlx(&r->ctl[SHMQ_W_ALLOC]) <= KEEP_WHOLE) { /* a small hot zone: all of it stays */
        *released = pos; /* ... and the next look is RELEASE_CHUNK on, not at every get */
        return;
    }
    uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE); /* (once per RELEASE_CHUNK of progress) */
    uint64_t start = *released, end = (pos - KEEP_BEHIND) & ~(page - 1);
    if (end - start > ring) start = end - ring;            /* jumped (loss, seek): the whole ring */
    start &= ~(page - 1);
    *released = end;
    uint64_t len = end - start, off = start % ring, first = len < ring - off ? len : ring - off;
    /* errors (EINVAL where pages are larger than the ring's alignment) only cost memory */
    (void)madvise(r->ring + off, (size_t)first, MADV_DONTNEED);
    if (len > first) (void)madvise(r->ring, (size_t)(len - first), MADV_DONTNEED);
}

static void count_read_rate(eng_ring *r, uint64_t n, uint64_t now) {
    /* Unlocked read-modify-write: concurrent readers may lose an update
     * (documented as approximate); the per-reader counters are exact. */
    uint64_t sec = now / 1000000000ull;
    int b = SHMQ_W_RATE + (int)(sec % SHMQ_RATE_SECONDS) * SHMQ_RATE_WORDS;
    if (ld_rlx(&r->ctl[b]) != sec) {
        st_rlx(&r->ctl[b], sec);
        st_rlx(&r->ctl[b + 1], 0);
        st_rlx(&r->ctl[b + 2], 0);
    }
    st_rlx(&r->ctl[b + 2], ld_rlx(&r->ctl[b + 2]) + n);
}

/* Publish accumulated counters to the slot (named: exclusive; group: lock held). */
void flush_locked(eng_cursor *c) {
    if (c->slot < 0 || !(c->n || c->lost_pending)) return;
    uint64_t *s = cur_slot(c), now = now_ns();
    st_rlx(&s[SHMQ_S_GETS], ld_rlx(&s[SHMQ_S_GETS]) + c->n);
    st_rlx(&s[SHMQ_S_GET_BYTES], ld_rlx(&s[SHMQ_S_GET_BYTES]) + c->bytes);
    st_rlx(&s[SHMQ_S_DELAY_SUM_NS], ld_rlx(&s[SHMQ_S_DELAY_SUM_NS]) + c->dsum);
    st_rlx(&s[SHMQ_S_DELAY_COUNT], ld_rlx(&s[SHMQ_S_DELAY_COUNT]) + c->dcount);
    if (c->dmax > ld_rlx(&s[SHMQ_S_DELAY_MAX_NS])) st_rlx(&s[SHMQ_S_DELAY_MAX_NS], c->dmax);
    if (c->kind == K_NAMED) st_rlx(&s[SHMQ_S_LOST], ld_rlx(&s[SHMQ_S_LOST]) + c->lost_pending);
    if (c->n) {
        st_rlx(&s[SHMQ_S_LAST_GET_NS], now);
        if (c->lag_peak > ld_rlx(&s[SHMQ_S_LAG_HIGH])) st_rlx(&s[SHMQ_S_LAG_HIGH], c->lag_peak);
    }
    uint64_t nxt = ld_rlx(&c->ring->ctl[SHMQ_W_NEXT_SEQ]);
    uint64_t cur = c->kind == K_GROUP ? ld_rlx(&s[SHMQ_S_SEQ]) : c->seq;
    uint64_t lag = nxt > cur ? nxt - cur : 0;
    if (lag < ld_rlx(&s[SHMQ_S_LAG_LOW])) st_rlx(&s[SHMQ_S_LAG_LOW], lag);
    count_read_rate(c->ring, c->n, now);
    c->n = c->bytes = c->dsum = c->dmax = c->dcount = c->lost_pending = 0;
}


/* ---- a cursor's lifecycle ---- */

int eng_cursor_lock_slow(eng_cursor *c, unsigned long me) {
    for (unsigned spin = 0;; spin++) {
        unsigned long held = atomic_load_explicit(&c->mu, memory_order_relaxed);
        if (held == me) return eng_fail(SHMQ_ESTATE, "a reader used again from inside its own take (a finalizer?)");
        if (!held && atomic_compare_exchange_weak_explicit(&c->mu, &held, me, memory_order_acquire,
                                                           memory_order_relaxed))
            return 0;
        if (spin < 64) {
            cpu_relax();
            continue;
        }
        void *saved = hooks_unlock(c->ring->hooks);
        while (atomic_load_explicit(&c->mu, memory_order_relaxed)) sched_yield();
        hooks_relock(c->ring->hooks, saved);
    }
}

/* A cursor over `r`: anonymous (slot -1), named or a group member's (the
 * group semaphore `gsem`, opened as it is: the caller created or checked
 * it).  0, or -errno (the semaphore). */
int eng_cursor_init(eng_cursor *c, eng_ring *r, int kind, int64_t slot, uint64_t seq, uint64_t pos, int autocommit,
                    int verify, const char *gsem) {
    memset(c, 0, sizeof *c);
    if (kind < K_ANON || kind > K_GROUP || (kind != K_ANON && (slot < 0 || (uint64_t)slot >= r->slot_count)))
        return eng_fail(-EINVAL, "bad cursor kind or slot");
    c->ring = r;
    c->kind = kind;
    c->slot = kind == K_ANON ? -1 : slot;
    c->seq = seq;
    c->pos = pos;
    c->released = pos;
    c->rng = (now_ns() ^ (uint64_t)(uintptr_t)c) | 1; /* xorshift state: never 0 */
    c->autocommit = autocommit;
    c->verify = verify;
    c->unknown_last = -1e9;
    pthread_mutex_init(&c->recover_mu, NULL);
    if (kind == K_GROUP) {
        c->gsem = sem_open(gsem, 0);
        if (c->gsem == SEM_FAILED) {
            int err = errno;
            c->gsem = NULL;
            return eng_fail(-err, "semaphore %s: %s", gsem, strerror(err));
        }
    }
    return 0;
}

/* Close the group semaphore once no thread waits on it any more. */
void eng_cursor_finish(eng_cursor *c) {
    if (atomic_load_explicit(&c->closed, memory_order_acquire) && !atomic_load_explicit(&c->busy, memory_order_acquire)) {
        sem_t *g = c->gsem;
        if (g && __atomic_compare_exchange_n(&c->gsem, &g, NULL, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) sem_close(g);
    }
}

/* Later calls fail with SHMQ_ECLOSED; the group semaphore is closed now, or
 * by the last thread waiting on it. */
void eng_cursor_close(eng_cursor *c) {
    atomic_store_explicit(&c->closed, 1, memory_order_release);
    eng_cursor_finish(c);
}

/* 0 while the cursor and its handle are open; SHMQ_ECLOSED otherwise. */
int eng_cursor_check(eng_cursor *c) {
    if (atomic_load_explicit(&c->closed, memory_order_acquire)) return eng_fail(SHMQ_ECLOSED, "reader is closed");
    if (!c->ring->base) return eng_fail(SHMQ_ECLOSED, "spool handle is closed");
    return 0;
}

/* Take the group lock like eng_sem_lock (0, 1: not within `wait`, or an
 * error); a close of the reader or of its spool by another thread meanwhile
 * is deferred until we are out, then we give the lock back and fail with
 * SHMQ_ECLOSED: nothing is touched after the handle is gone. */
int group_lock(eng_cursor *c, double wait, uint64_t *word, uint64_t holder) {
    eng_ring *r = c->ring;
    atomic_fetch_add_explicit(&c->busy, 1, memory_order_acq_rel);
    atomic_fetch_add_explicit(&r->busy, 1, memory_order_acq_rel);
    int lk = eng_sem_lock(c->gsem, wait, r->hooks, NULL, word, holder); /* `word` (or NULL) recorded at once */
    atomic_fetch_sub_explicit(&c->busy, 1, memory_order_acq_rel);
    atomic_fetch_sub_explicit(&r->busy, 1, memory_order_acq_rel);
    int closed_reader = atomic_load_explicit(&c->closed, memory_order_acquire);
    if (closed_reader || ring_closing(r)) {
        if (lk == 0 && word) st_rlx(word, 0);
        if (lk == 0) sem_post(c->gsem);
        eng_cursor_finish(c);
        ring_finish(r);
        if (lk >= 0)
            lk = closed_reader ? eng_fail(SHMQ_ECLOSED, "reader is closed")
                               : eng_fail(SHMQ_ECLOSED, "spool handle was closed by another thread");
        return lk;
    }
    return lk;
}

void group_unlock(eng_cursor *c, uint64_t *word) {
    if (word) st_rlx(word, 0);
    sem_post(c->gsem);
}

/* 1 if a frame is committed past the cursor (lock-free), else 0. */
int eng_cursor_available(eng_cursor *c) {
    uint64_t seq;
    if (c->kind == K_GROUP) {
        seq = ld_acq(&cur_slot(c)[SHMQ_S_SEQ]);
    } else {
        if (eng_cursor_lock(c) < 0) return 1; /* let the take say what is wrong */
        seq = c->seq;
        eng_cursor_unlock(c);
    }
    return seq < ld_acq(&c->ring->ctl[SHMQ_W_NEXT_SEQ]);
}

/* A named reader's commit: its position stored in the slot, its counters
 * published, writers waiting for room woken.  0, or SHMQ_ECLOSED. */
int eng_cursor_commit(eng_cursor *c) {
    int rc = eng_cursor_check(c);
    if (rc < 0) return rc;
    if (c->kind == K_NAMED) {
        if ((rc = eng_cursor_lock(c)) < 0) return rc;
        named_commit(c);
        flush_locked(c);
        eng_cursor_unlock(c);
        if (c->ring->policy != SHMQ_POLICY_OVERWRITE) ring_bell(c->ring, c->ring->fsem);
    }
    return 0;
}

/* Publish the counters to the slot; a group takes its lock (up to `wait`).
 * 0; 1: the group lock was not free in time; or an error. */
int eng_cursor_flush(eng_cursor *c, double wait) {
    if (atomic_load_explicit(&c->closed, memory_order_acquire) || !c->ring->base || c->slot < 0) return 0;
    if (c->kind == K_GROUP) {
        if (!c->n) return 0;
        uint64_t *word = &cur_slot(c)[SHMQ_S_LOCK_HOLDER]; /* recorded: a live holder is never broken */
        int lk = group_lock(c, wait, word, c->ring->holder);
        if (lk != 0) return lk;
        flush_locked(c);
        group_unlock(c, word);
    } else {
        int rc = eng_cursor_lock(c);
        if (rc < 0) return rc;
        flush_locked(c);
        eng_cursor_unlock(c);
    }
    return 0;
}

/* ---- finding a frame by seq ---- */

/* The header position of frame `want`, walking headers lock-free from the
 * oldest frame (or from the hint (hseq, hpos) when it is on the way): 0 and
 * *out; 1: already overwritten; 2: the ring was rewritten under every
 * attempt; SHMQ_ECORRUPT. */
int eng_locate(eng_ring *r, uint64_t want, uint64_t hseq, uint64_t hpos, uint64_t *out) {
    uint64_t *c = r->ctl, ring = r->ring_bytes;
    for (int attempt = 0; attempt < 100; attempt++) {
        uint64_t s, p;
        int rc = first_cursor(r, &s, &p);
        if (rc < 0) return rc;
        if (want < s) return 1;
        if (s <= hseq && hseq <= want && hpos >= p) {
            s = hseq;
            p = hpos;
        }
        uint64_t limit = ld_acq(&c[SHMQ_W_NEXT_POS]) + ring; /* a sane walk never gets this far */
        int pads = 0;
        for (;;) {
            shmq_frame_header h;
            uint64_t off = read_header_at(r, &p, &h);
            atomic_thread_fence(memory_order_acquire);
            if (ld_rlx(&c[SHMQ_W_FIRST_POS]) > p) break; /* overtaken by the writer: start again */
            if (h.seq != s || !header_sane(&h, off, ring) || p > limit)
                return eng_fail(SHMQ_ECORRUPT, "%s: ring is corrupt near seq %llu; " SHMQ_RING_ADVICE, r->path,
                                (unsigned long long)s);
            if (h.flags & SHMQ_FLAG_PAD) {
                if (off == 0 || ++pads > 2)
                    return eng_fail(SHMQ_ECORRUPT, "%s: corrupt padding near seq %llu", r->path,
                                    (unsigned long long)s);
                p += h.stored;
                continue;
            }
            pads = 0;
            if (s == want) {
                *out = p;
                return 0;
            }
            s++;
            p += h.stored;
        }
    }
    return 2;
}
