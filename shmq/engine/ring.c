/*
 * shmq/engine/ring.c: one mapping of a spool -- its geometry and
 * semaphores, init and release (deferred while another thread is inside a
 * blocking section of the handle), and the few locked operations that are
 * neither a write nor a read: the latest cursor, trim, lock recovery refs.
 */
#include "engine.h"

static sem_t *open_existing(const char *name, int *err) {
    sem_t *s = sem_open(name, 0);
    if (s == SEM_FAILED) {
        *err = eng_fail(-errno, "%s", name); /* the message names what failed */
        return NULL;
    }
    return s;
}

/* Make `r` over the mapping and geometry of `s` (checked here once more:
 * a corrupt or hostile file must not make a later call read outside the
 * mapping).  0, or -EINVAL (inconsistent geometry), -errno (the descriptor
 * or a semaphore: they are opened as they are, the caller created or
 * checked them).  The caller's mapping stays the caller's: r->unmap, if
 * set, releases it when the ring is released. */
int eng_ring_init(eng_ring *r, const eng_ring_spec *s) {
    memset(r, 0, sizeof *r);
    r->fd = -1;
    uint64_t *ctl = (uint64_t *)s->base;
    uint64_t segment = s->base && s->map_bytes >= SHMQ_HEADER_BYTES ? ld_rlx(&ctl[SHMQ_W_SEGMENT]) : 1;
    if (!s->base || s->ring_bytes < 4096 || s->ring_bytes % 4096 || s->ring_offset % 4096 ||
        s->ring_offset < SHMQ_HEADER_BYTES || s->slot_offset < SHMQ_HEADER_BYTES ||
        s->slot_offset + s->slot_count * SHMQ_SLOT_BYTES > s->ring_offset ||
        s->map_bytes < s->ring_offset + s->ring_bytes || s->policy < 0 || s->policy > 2 || segment % 4096 ||
        segment > s->ring_bytes)
        return eng_fail(-EINVAL, "inconsistent ring geometry");
    r->base = s->base;
    r->map_bytes = s->map_bytes;
    r->ctl = ctl;
    r->slots = (uint64_t *)(s->base + s->slot_offset);
    r->ring = s->base + s->ring_offset;
    r->ring_bytes = s->ring_bytes;
    r->ring_offset = s->ring_offset;
    r->segment = segment;
    r->slot_count = s->slot_count;
    r->max_payload = s->ring_bytes - SHMQ_FRAME_BYTES;
    if (r->max_payload > SHMQ_MAX_FRAME_PAYLOAD) r->max_payload = SHMQ_MAX_FRAME_PAYLOAD;
    r->policy = s->policy;
    r->checksum = s->checksum;
    r->holder = s->holder;
    r->lock_wait = s->lock_wait;
    r->recovery_timeout = s->recovery_timeout > 0 ? s->recovery_timeout : 1.0;
    r->hooks = s->hooks;
    r->path = s->path ? s->path : "";
    r->rate_word = SHMQ_W_RATE + 1;
    r->unknown_last = -1e9;
    pthread_mutex_init(&r->recover_mu, NULL);
    int err = 0;
    r->fd = fcntl(s->fd, F_DUPFD_CLOEXEC, 0);
    if (r->fd < 0) {
        err = eng_fail(-errno, "%s", r->path);
        goto fail;
    }
    if (!(r->wsem = open_existing(s->wsem, &err)) || !(r->rsem = open_existing(s->rsem, &err)) ||
        !(r->fsem = open_existing(s->fsem, &err)))
        goto fail;
    return 0;
fail:
    r->unmap = NULL; /* the caller still owns its mapping */
    eng_ring_release(r);
    return err;
}

/* Release the handle: its descriptor, semaphores and (r->unmap) mapping; an
 * open reservation is abandoned (the writer lock released).  Deferred while
 * another thread is inside a blocking section of this handle: the last one
 * out finishes it (ring_finish).  Idempotent. */
void eng_ring_release(eng_ring *r) {
    if (atomic_load_explicit(&r->busy, memory_order_acquire)) {
        atomic_store_explicit(&r->closing, 1, memory_order_release);
        return;
    }
    if (r->fd >= 0) {
        close(r->fd); /* our own duplicate: never reused under a concurrent fallocate */
        r->fd = -1;
    }
    if (r->resv) { /* closing with a reservation open: abandon it (release the lock) */
        r->resv->open = 0;
        if (r->base && r->wsem) wlock_release(r);
        r->resv = NULL;
        atomic_store_explicit(&r->resv_thread, 0, memory_order_relaxed);
    }
    if (r->wsem) sem_close(r->wsem);
    if (r->rsem) sem_close(r->rsem);
    if (r->fsem) sem_close(r->fsem);
    r->wsem = r->rsem = r->fsem = NULL;
    void (*unmap)(eng_ring *) = r->unmap;
    r->unmap = NULL;
    if (unmap && r->base) unmap(r);
    r->base = r->ring = NULL;
    r->ctl = r->slots = NULL;
}

/* (NEXT_SEQ, NEXT_POS) as a consistent pair, under the writer lock (up to
 * `wait`): 0, 1 (the lock was not free in time), or an error. */
int eng_latest(eng_ring *r, double wait, uint64_t *seq, uint64_t *pos) {
    /* the holder recorded, as every taker of the lock does: a live one is never broken */
    int lk = eng_sem_lock(r->wsem, wait, r->hooks, r, &r->ctl[SHMQ_W_LOCK_HOLDER], r->holder);
    if (lk != 0) return lk;
    *seq = ld_rlx(&r->ctl[SHMQ_W_NEXT_SEQ]);
    *pos = ld_rlx(&r->ctl[SHMQ_W_NEXT_POS]);
    wlock_release(r);
    return 0;
}

/* Give back a drained growable ring's pages (trim_locked) under the writer
 * lock (up to `wait`): 0, 1 (the lock was not free in time), or an error.
 * A fixed ring: 0 at once. */
int eng_trim(eng_ring *r, double wait) {
    if (!r->segment) return 0;
    int lk = eng_sem_lock(r->wsem, wait, r->hooks, r, &r->ctl[SHMQ_W_LOCK_HOLDER], r->holder);
    if (lk != 0) return lk;
    int rc = trim_locked(r);
    wlock_release(r);
    ring_finish(r);
    if (rc < 0) return rc;
    ring_bell(r, r->fsem);
    return 0;
}

/* The writer-death repair of the engine's own lock recovery. */
static int writer_recovered(void *ctx, uint32_t dead_pid) {
    eng_ring *r = ctx;
    char log[512];
    (void)dead_pid;
    eng_repair_control(r->ctl, r->ring, r->ring_bytes, 1, log, sizeof log);
    return 0;
}

/* The writer lock of `r` as a recoverable lock (the C API's writers). */
void eng_writer_lock_ref(eng_ring *r, eng_lock_ref *l) {
    l->sem = r->wsem;
    l->holder = &r->ctl[SHMQ_W_LOCK_HOLDER];
    l->token = &r->ctl[SHMQ_W_LOCK_TOKEN];
    l->breaks = &r->ctl[SHMQ_W_LOCK_BREAKS];
    l->fd = r->fd;
    l->recovery_byte = SHMQ_RECOVERY_LOCK_BYTE;
    l->recovery_timeout = r->recovery_timeout;
    l->unknown_since = &r->unknown_since;
    l->unknown_last = &r->unknown_last;
    l->me = r->holder;
    l->on_recover = writer_recovered;
    l->ctx = r;
    l->mu = &r->recover_mu;
    l->hooks = r->hooks;
}

/* The group lock of cursor `c` as a recoverable lock. */
void eng_group_lock_ref(eng_cursor *c, eng_lock_ref *l) {
    eng_ring *r = c->ring;
    uint64_t *s = cur_slot(c);
    l->sem = c->gsem;
    l->holder = &s[SHMQ_S_LOCK_HOLDER];
    l->token = &s[SHMQ_S_LOCK_TOKEN];
    l->breaks = NULL;
    l->fd = r->fd;
    l->recovery_byte = (uint64_t)((char *)s - r->base) + SHMQ_SLOT_RECOVERY_BYTE;
    l->recovery_timeout = r->recovery_timeout;
    l->unknown_since = &c->unknown_since;
    l->unknown_last = &c->unknown_last;
    l->me = r->holder;
    l->on_recover = NULL;
    l->ctx = NULL;
    l->mu = &c->recover_mu;
    l->hooks = r->hooks;
}
