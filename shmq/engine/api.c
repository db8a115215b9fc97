/*
 * shmq/engine/api.c: shmq.h -- the C API over the engine.  A spool handle is
 * one mapping of the file (eng_ring) with the waits, the lock recovery and
 * the room waits Python's Writer and Reader do in Python: the same rules,
 * written here for C callers (docs/c-api.md).
 */
#include "take.h"

#define FIRST_LOOK_S 0.05 /* the first look at a stuck lock's holder (shmq._lock.FIRST_LOOK_S) */

struct shmq_reader {
    eng_cursor cur;
    struct shmq_spool *sp;
    struct shmq_reader *next;
};

struct shmq_spool {
    eng_ring ring;
    char path[PATH_MAX];
    char *map;
    size_t map_len;
    int fd;
    char prefix[16];
    atomic_int sync;         /* shmq_set_sync: writes msync their frames before the commit, the header after */
    pthread_mutex_t mu;      /* the readers list and the slots' attachment counts */
    uint32_t *slot_refs;     /* this handle's attachments of each slot (OFD locks are per handle) */
    struct shmq_reader *readers;
};

_Static_assert(sizeof(eng_resv) <= sizeof(((shmq_reservation *)0)->priv_), "a reservation holds an eng_resv");
static eng_resv *resv_of(shmq_reservation *rv) { return (eng_resv *)(void *)rv->priv_; }

static int sync_of(shmq_spool *sp) { return atomic_load_explicit(&sp->sync, memory_order_relaxed); }

static double mono_s(void) { return (double)mono_ns() / 1e9; }

static void unmap(eng_ring *r) {
    shmq_spool *sp = r->owner;
    if (sp->map) munmap(sp->map, sp->map_len);
    sp->map = NULL;
}

/* ---- open, create, destroy, close ---- */

int shmq_open(const char *path, double recovery_timeout, shmq_spool **out) {
    eng_clear_error();
    *out = NULL;
    shmq_spool *sp = calloc(1, sizeof *sp);
    if (!sp) return eng_fail(-ENOMEM, "out of memory");
    sp->fd = -1;
    int rc = eng_resolve_path(path, sp->path, sizeof sp->path, 0);
    if (rc < 0) goto fail;
    struct stat st;
    if ((rc = sp->fd = eng_open_file(sp->path, &st)) < 0) goto fail;
    /* Held while this handle lives: removing an orphaned queue takes it exclusively
     * first, so an opener that gets it after finds the file unlinked. */
    if ((rc = eng_hold_handle_lock(sp->fd, ENG_HANDLE_LOCK_WAIT_S, NULL)) != 0) {
        if (rc == 1)
            rc = eng_fail(SHMQ_ELOCKED, "%s: another process has held this spool's handle lock (fcntl byte %d) "
                          "exclusively for over %g s; only shmq removing an orphaned queue takes it so, for "
                          "milliseconds: find the holder with 'fuser' or /proc/locks", sp->path,
                          SHMQ_HANDLE_LOCK_BYTE, ENG_HANDLE_LOCK_WAIT_S);
        else
            rc = eng_fail(rc, "%s: the handle lock: %s", sp->path, strerror(-rc));
        goto fail;
    }
    if (fstat(sp->fd, &st) != 0 || st.st_nlink == 0) {
        rc = eng_fail(-ENOENT, "%s: the spool was removed while being opened", sp->path);
        goto fail;
    }
    shmq_geometry g;
    if (pread(sp->fd, &g, sizeof g, 0) != (ssize_t)sizeof g) {
        rc = eng_fail(SHMQ_EFORMAT, "%s: not a shmq spool (file too small)", sp->path);
        goto fail;
    }
    if ((rc = eng_geometry_check(&g, (uint64_t)st.st_size, sp->path)) < 0) goto fail;
    sp->map_len = g.file_bytes;
    sp->map = mmap(NULL, sp->map_len, PROT_READ | PROT_WRITE, MAP_SHARED, sp->fd, 0);
    if (sp->map == MAP_FAILED) {
        sp->map = NULL;
        rc = eng_fail(-errno, "%s: mmap: %s", sp->path, strerror(errno));
        goto fail;
    }
    memcpy(sp->prefix, g.sem_prefix, SHMQ_SEM_PREFIX_BYTES);
    /* The three semaphores: created if missing (a reboot kept a disk spool), a
     * squatted name refused, then opened by the ring. */
    char names[3][64];
    const char *which[3] = {"w", "r", "f"};
    for (int i = 0; i < 3; i++) {
        int err = 0;
        eng_sem_name(sp->prefix, which[i], names[i], sizeof names[i]);
        sem_t *s = eng_sem_open(names[i], i == 0, st.st_mode & 0666, (long)st.st_uid, (long)st.st_gid,
                                ENG_SEM_OPEN, &err);
        if (s == SEM_FAILED) {
            rc = err;
            goto fail;
        }
        sem_close(s);
    }
    if (recovery_timeout <= 0) recovery_timeout = 1.0;
    eng_ring_spec spec = {sp->map, sp->map_len, g.ring_offset, g.ring_bytes, g.slot_offset, g.slot_count,
                          g.policy, g.checksum, sp->fd, names[0], names[1], names[2], eng_holder_word(),
                          recovery_timeout < FIRST_LOOK_S ? recovery_timeout : FIRST_LOOK_S, recovery_timeout,
                          sp->path, NULL};
    if ((rc = eng_ring_init(&sp->ring, &spec)) < 0) goto fail;
    sp->ring.owner = sp;
    sp->ring.unmap = unmap;
    /* Control words no writer could have left, read a few times (a writer between two stores). */
    char msg[512];
    for (int attempt = 0; eng_control_problems(sp->ring.ctl, g.ring_bytes, msg, sizeof msg); attempt++) {
        if (attempt == 4) {
            rc = eng_fail(SHMQ_ECORRUPT, "%s: control block is corrupt (%s); it cannot be repaired: remove it "
                          "('shmq rm') and create it again", sp->path, msg);
            eng_ring_release(&sp->ring);
            goto fail;
        }
        struct timespec ts = {0, 1000000L * attempt};
        nanosleep(&ts, NULL);
    }
    sp->slot_refs = calloc(g.slot_count, sizeof *sp->slot_refs);
    if (!sp->slot_refs) {
        rc = eng_fail(-ENOMEM, "out of memory");
        eng_ring_release(&sp->ring);
        goto fail;
    }
    pthread_mutex_init(&sp->mu, NULL);
    *out = sp;
    return 0;
fail:
    if (sp->map) munmap(sp->map, sp->map_len);
    if (sp->fd >= 0) close(sp->fd);
    free(sp);
    return rc;
}

int shmq_create(const char *path, const shmq_create_options *o, shmq_spool **out) {
    eng_clear_error();
    shmq_create_options d = {0};
    if (!o) o = &d;
    char full[PATH_MAX];
    int rc = eng_resolve_path(path, full, sizeof full, 1);
    if (rc < 0) return rc;
    uint64_t cap = o->capacity ? o->capacity : 64ull << 20, ring = cap, start = 0;
    if (o->max_capacity) {
        if (o->max_capacity < cap)
            return eng_fail(-EINVAL, "max_capacity (%llu bytes) is smaller than capacity (%llu bytes)",
                            (unsigned long long)o->max_capacity, (unsigned long long)cap);
        ring = o->max_capacity;
        start = cap;
    }
    if (o->exist_ok) {
        struct stat st;
        if (lstat(full, &st) == 0 && (rc = shmq_open(full, 0, out)) != -ENOENT) return rc;
    }
    rc = eng_create_file(full, ring, start, o->on_full, o->mode ? o->mode : 0600, o->readers ? o->readers : 64,
                         o->leases < 0 ? SHMQ_DEFAULT_LEASES : (unsigned)o->leases, o->checksum);
    if (rc == -EEXIST && o->exist_ok) rc = 0;
    return rc < 0 ? rc : shmq_open(full, 0, out);
}

int shmq_destroy(const char *path) {
    eng_clear_error();
    char full[PATH_MAX];
    int rc = eng_resolve_path(path, full, sizeof full, 0);
    return rc < 0 ? rc : eng_destroy_file(full);
}

static void reader_free(shmq_reader *r);

int shmq_close(shmq_spool *sp) {
    if (!sp) return 0;
    pthread_mutex_lock(&sp->mu);
    shmq_reader *r = sp->readers;
    sp->readers = NULL;
    pthread_mutex_unlock(&sp->mu);
    while (r) {
        shmq_reader *next = r->next;
        reader_free(r);
        r = next;
    }
    eng_ring_release(&sp->ring); /* abandons an open reservation; unmaps */
    if (sp->fd >= 0) close(sp->fd);
    pthread_mutex_destroy(&sp->mu);
    free(sp->slot_refs);
    free(sp);
    return 0;
}

/* ---- writing: the Writer's rules (shmq/writer.py) ---- */

/* Wait for room, on the space doorbell: first, up to ROOM_BURST_WAIT_S,
 * for room for a burst (consumers ring once it is free: wait.c's
 * room_state), then for any room for this write; then, if a consumer
 * stopped short of even that, until the room marker moves from the one
 * taken under the lock when the write found no room (or `poll`, a pin in
 * the way, by the marker alone: at most 0.1 s, a pin's holder may die
 * without a word).  As shmq/writer.py's _wait_for_room.  0: look again;
 * SHMQ_EFULL: the deadline passed. */
#define ROOM_BURST_WAIT_S 0.001
static int wait_for_room(eng_ring *r, double deadline, int poll) {
    uint64_t floor0, pin0, f, p;
    eng_full_marker(&floor0, &pin0);
    atomic_fetch_add_explicit(&r->busy, 1, memory_order_acq_rel);
    sem_post(r->fsem); /* register: a full fence before the re-check */
    int rc = 0;
    double until = poll ? mono_s() + 0.1 : 0;
    if (!poll) {
        double burst_until = mono_s() + ROOM_BURST_WAIT_S;
        if (deadline && deadline < burst_until) burst_until = deadline;
        int state;
        for (;;) {
            uint32_t seen = eng_bell_seen(r, 1);
            if ((state = room_state(r, 1)) == 2) break;
            double left = burst_until - mono_s();
            if (left <= 0) break;
            struct timespec ts = {0, (long)(left * 1e9)};
            syscall(SYS_futex, bell_word(r, SHMQ_W_SPACE_BELL), FUTEX_WAIT, seen, &ts, NULL, 0);
        }
        if (state == 0) state = room_state(r, 0);
        room_unwant(r); /* consumers ring at every commit again while this waits on */
        if (state > 0) goto out;
    }
    for (;;) {
        uint32_t seen = eng_bell_seen(r, 1);
        room_marker(r, &f, &p);
        if (f != floor0 || p != pin0) break;
        double now = mono_s(), left = 0.1;
        if (deadline && now >= deadline) {
            rc = SHMQ_EFULL;
            break;
        }
        if (until && now >= until) break;
        if (deadline && deadline - now < left) left = deadline - now;
        struct timespec ts = {(time_t)left, (long)((left - (double)(time_t)left) * 1e9)};
        syscall(SYS_futex, bell_word(r, SHMQ_W_SPACE_BELL), FUTEX_WAIT, seen, &ts, NULL, 0);
    }
out:
    sem_trywait(r->fsem);
    atomic_fetch_sub_explicit(&r->busy, 1, memory_order_acq_rel);
    return rc;
}

/* What to do after a write or reservation attempt returned status `st`: 0 to
 * try again, or the code to return.  Recovers a dead holder's lock; waits
 * for room (policy block, or a pin in the way) until `deadline`. */
static int after_status(shmq_spool *sp, int st, double deadline, double lock_deadline, double *period) {
    eng_ring *r = &sp->ring;
    if (st == SHMQ_ELOCKED) {
        eng_lock_ref l;
        eng_writer_lock_ref(r, &l);
        int rc = eng_lock_recover(&l);
        if (rc < 0) return rc;
        *period = r->recovery_timeout;
        if (rc == 0 && lock_deadline && mono_s() >= lock_deadline)
            return eng_fail(SHMQ_ELOCKED, "%s: the writer lock's live holder (pid %llu) did not release it in time",
                            sp->path, (unsigned long long)(ld_rlx(&r->ctl[SHMQ_W_LOCK_HOLDER]) & 0xFFFFFFFFu));
        return 0;
    }
    if (st == SHMQ_EPINNED) { /* a zero-copy view pins a frame in the way: reclaim dead holders', or wait */
        if (eng_reclaim_pins(r, SHMQ_NO_PIN, -1) > 0) return 0;
        return wait_for_room(r, deadline, 1);
    }
    if (st == SHMQ_EFULL || st == SHMQ_EBACKLOG) {
        if (r->policy == SHMQ_POLICY_ERROR) return eng_fail(SHMQ_EFULL, "%s is full (on_full='error')", sp->path);
        if (!deadline) return wait_for_room(r, 0, 0);
        if (mono_s() >= deadline) return eng_fail(SHMQ_EFULL, "%s is still full after the timeout", sp->path);
        return wait_for_room(r, deadline, 0);
    }
    return st; /* SHMQ_ETOOLARGE, SHMQ_ENOSPACE, an error */
}

/* The deadlines of a write: for room (the timeout) and for a stuck lock
 * (the longer of the timeout and the recovery timeout: even a put that
 * must not wait for room waits for a live holder that copies). */
static void deadlines(eng_ring *r, double timeout, double *deadline, double *lock_deadline) {
    *deadline = timeout < 0 ? 0 : mono_s() + (timeout > 0 ? timeout : 1e-9);
    *lock_deadline = timeout < 0 ? 0 : mono_s() + (timeout > r->recovery_timeout ? timeout : r->recovery_timeout);
}

static double first_wait(eng_ring *r) { return r->recovery_timeout < FIRST_LOOK_S ? r->recovery_timeout : FIRST_LOOK_S; }

static int64_t write_items(shmq_spool *sp, eng_item *items, size_t count, int codec, double timeout) {
    eng_ring *r = &sp->ring;
    if (!r->base) return eng_fail(SHMQ_ECLOSED, "spool handle is closed");
    if (r->checksum)
        for (size_t k = 0; k < count; k++) eng_item_crc(&items[k]);
    double deadline, lock_deadline, period = first_wait(r);
    deadlines(r, timeout, &deadline, &lock_deadline);
    for (;;) {
        double wait = period;
        if (lock_deadline) {
            double left = lock_deadline - mono_s();
            if (left < wait) wait = left > 0 ? left : 0;
        }
        eng_wopts o = {.sync = 1};
        int64_t st = eng_write(r, items, count, codec, -1, wait, timeout != 0, sync_of(sp) ? &o : NULL);
        if (st >= 0) return st;
        int rc = after_status(sp, (int)st, deadline, lock_deadline, &period);
        if (rc < 0) return rc;
    }
}

int64_t shmq_put(shmq_spool *sp, const void *data, size_t len, int codec, double timeout) {
    eng_clear_error();
    eng_seg seg = {data, len};
    eng_item item = {&seg, 1, len, 0, NULL, NULL};
    return write_items(sp, &item, 1, codec, timeout);
}

int64_t shmq_put_many(shmq_spool *sp, const shmq_iovec *frames, size_t count, int codec, double timeout) {
    eng_clear_error();
    if (count == 0) return eng_fail(-EINVAL, "put_many needs at least one frame");
    if (count > MAX_BATCH) return SHMQ_ETOOLARGE;
    eng_item *items = malloc(count * (sizeof(eng_item) + sizeof(eng_seg)));
    if (!items) return eng_fail(-ENOMEM, "out of memory");
    eng_seg *segs = (eng_seg *)(items + count);
    for (size_t k = 0; k < count; k++) {
        segs[k].buf = frames[k].data;
        segs[k].len = frames[k].len;
        items[k] = (eng_item){&segs[k], 1, frames[k].len, 0, NULL, NULL};
    }
    int64_t rc = write_items(sp, items, count, codec, timeout);
    free(items);
    return rc;
}

int shmq_reserve(shmq_spool *sp, size_t nbytes, int codec, double timeout, shmq_reservation *rv) {
    eng_clear_error();
    eng_ring *r = &sp->ring;
    memset(rv, 0, sizeof *rv);
    if (!r->base) return eng_fail(SHMQ_ECLOSED, "spool handle is closed");
    eng_resv *e = resv_of(rv);
    e->sync = (uint8_t)sync_of(sp);
    double deadline, lock_deadline, period = first_wait(r);
    deadlines(r, timeout, &deadline, &lock_deadline);
    for (;;) {
        int st = eng_reserve(r, nbytes, codec, period, e);
        if (st == 0) {
            rv->data = r->ring + e->off + SHMQ_FRAME_BYTES;
            rv->len = nbytes;
            rv->seq = e->seq;
            return 0;
        }
        int rc = after_status(sp, st, deadline, lock_deadline, &period);
        if (rc < 0) return rc;
    }
}

int64_t shmq_commit(shmq_reservation *rv) {
    eng_clear_error();
    return eng_resv_commit(resv_of(rv));
}

int shmq_abandon(shmq_reservation *rv) {
    eng_clear_error();
    eng_resv_abandon(resv_of(rv));
    return 0;
}

int shmq_set_sync(shmq_spool *sp, int on) {
    eng_clear_error();
    if (!sp->ring.base) return eng_fail(SHMQ_ECLOSED, "spool handle is closed");
    atomic_store_explicit(&sp->sync, on != 0, memory_order_relaxed); /* a setting, read at each write */
    return 0;
}

int shmq_trim(shmq_spool *sp, double timeout) {
    eng_clear_error();
    if (!sp->ring.base) return eng_fail(SHMQ_ECLOSED, "spool handle is closed");
    int rc = eng_trim(&sp->ring, timeout < 0 ? 1e9 : timeout);
    return rc == 1 ? SHMQ_ELOCKED : rc;
}

/* ---- readers ---- */

int shmq_reader_open(shmq_spool *sp, const char *name, int flags, shmq_reader **out) {
    eng_clear_error();
    *out = NULL;
    eng_ring *r = &sp->ring;
    if (!r->base) return eng_fail(SHMQ_ECLOSED, "spool handle is closed");
    shmq_reader *rd = calloc(1, sizeof *rd);
    if (!rd) return eng_fail(-ENOMEM, "out of memory");
    rd->sp = sp;
    int rc, latest = (flags & SHMQ_START_LATEST) != 0, verify = (flags & SHMQ_VERIFY) != 0;
    if (!name) {
        if (flags & SHMQ_READER_GROUP) {
            free(rd);
            return eng_fail(-EINVAL, "a group needs a name");
        }
        uint64_t seq, pos;
        if (!latest) {
            rc = first_cursor(r, &seq, &pos);
        } else {
            double period = first_wait(r);
            while ((rc = eng_latest(r, period, &seq, &pos)) == 1) {
                eng_lock_ref l;
                eng_writer_lock_ref(r, &l);
                if ((rc = eng_lock_recover(&l)) < 0) break;
                period = r->recovery_timeout;
            }
        }
        if (rc == 0) rc = eng_cursor_init(&rd->cur, r, K_ANON, -1, seq, pos, 0, verify, NULL);
        if (rc < 0) {
            free(rd);
            return rc;
        }
    } else {
        int group = (flags & SHMQ_READER_GROUP) != 0;
        int slot = eng_slot_attach(r, name, group ? SHMQ_SLOT_GROUP : SHMQ_SLOT_READER, latest);
        if (slot < 0) {
            free(rd);
            return slot;
        }
        pthread_mutex_lock(&sp->mu);
        if (!group && sp->slot_refs[slot]) {
            rc = eng_fail(SHMQ_EBUSY, "reader %s is already attached through this handle", name);
        } else {
            rc = sp->slot_refs[slot] ? 0 : eng_slot_hold(r, slot, !group);
            if (rc == 0) sp->slot_refs[slot]++;
        }
        pthread_mutex_unlock(&sp->mu);
        if (rc < 0) {
            free(rd);
            return rc;
        }
        uint64_t *w = r->slots + (uint64_t)slot * SHMQ_SLOT_WORDS;
        uint64_t seq = ld_acq(&w[SHMQ_S_SEQ]), pos = ld_acq(&w[SHMQ_S_POS]);
        char gname[64] = {0};
        if (seq > ld_acq(&r->ctl[SHMQ_W_NEXT_SEQ]) || pos > ld_acq(&r->ctl[SHMQ_W_NEXT_POS]) + r->ring_bytes) {
            rc = eng_fail(SHMQ_ECORRUPT, "%s: the stored cursor of '%s' (seq %llu, position %llu) is beyond the "
                          "ring's end; reset it with 'shmq readers seek' or fsck --repair", sp->path, name,
                          (unsigned long long)seq, (unsigned long long)pos);
        } else if (group) { /* the group's semaphore: made on its first use, a squatted name refused */
            char which[16];
            int err = 0;
            snprintf(which, sizeof which, "g%d", slot);
            eng_sem_name(sp->prefix, which, gname, sizeof gname);
            struct stat st;
            fstat(r->fd, &st);
            sem_t *s = eng_sem_open(gname, 1, st.st_mode & 0666, (long)st.st_uid, (long)st.st_gid, ENG_SEM_OPEN, &err);
            if (s == SEM_FAILED) rc = err;
            else sem_close(s);
        }
        if (rc == 0)
            rc = eng_cursor_init(&rd->cur, r, group ? K_GROUP : K_NAMED, slot, seq, pos,
                                 !(flags & SHMQ_NO_AUTOCOMMIT), verify, group ? gname : NULL);
        if (rc < 0) {
            pthread_mutex_lock(&sp->mu);
            if (--sp->slot_refs[slot] == 0) eng_slot_let_go(r, slot);
            pthread_mutex_unlock(&sp->mu);
            free(rd);
            return rc;
        }
    }
    pthread_mutex_lock(&sp->mu);
    rd->next = sp->readers;
    sp->readers = rd;
    pthread_mutex_unlock(&sp->mu);
    *out = rd;
    return 0;
}

/* Flush, detach (a named reader's or a member's liveness lock, the last of
 * this handle's), close. */
static void reader_free(shmq_reader *rd) {
    shmq_spool *sp = rd->sp;
    eng_cursor *c = &rd->cur;
    if (sp->ring.base && c->slot >= 0) {
        eng_cursor_flush(c, sp->ring.recovery_timeout);
        pthread_mutex_lock(&sp->mu);
        if (sp->slot_refs[c->slot] && --sp->slot_refs[c->slot] == 0) eng_slot_let_go(&sp->ring, c->slot);
        pthread_mutex_unlock(&sp->mu);
    }
    eng_cursor_close(c);
    if (c->gsem) sem_close(c->gsem);
    free(rd);
}

int shmq_reader_close(shmq_reader *rd) {
    if (!rd) return 0;
    shmq_spool *sp = rd->sp;
    pthread_mutex_lock(&sp->mu);
    for (shmq_reader **p = &sp->readers; *p; p = &(*p)->next)
        if (*p == rd) {
            *p = rd->next;
            break;
        }
    pthread_mutex_unlock(&sp->mu);
    reader_free(rd);
    return 0;
}

/* Where a C take puts each frame: one after the other in the caller's buffer. */
typedef struct {
    char *buf;
    size_t cap, used, need;
    shmq_frame *frames;
    size_t max, n;
} CSink;

static const char *copy_c(void *ctx, const char *src, const shmq_frame_header *h) {
    CSink *k = ctx;
    size_t at = (k->used + 7) & ~(size_t)7; /* each payload 8-byte aligned, as in the ring */
    if (at > k->cap || k->cap - at < h->length) {
        if (k->n) return ENG_COPY_STOP; /* no room for this one: the take stops before it */
        k->need = h->length;
        return NULL;
    }
    TRACE_COPY_BEGIN(src - SHMQ_FRAME_BYTES, src + h->length, h->seq);
    eng_copy(k->buf + at, src, h->length);
    TRACE_COPY_DONE();
    return k->buf + at;
}

static void drop_c(void *ctx) {
    (void)ctx; /* a torn copy is overwritten by the next */
    TRACE_COPY_DROPPED();
}

static int taken_c(void *ctx, const shmq_frame_header *h) {
    CSink *k = ctx;
    TRACE_COPY_ACCEPTED();
    size_t at = (k->used + 7) & ~(size_t)7;
    k->frames[k->n] = (shmq_frame){h->seq, h->ts, k->buf + at, h->length, h->codec};
    k->used = at + h->length;
    k->n++;
    return 0;
}

/* One take of up to k->max frames: how many (0: nothing now), SHMQ_ELOCKED
 * (the group lock was not free within `wait`), SHMQ_ESIZE, or an error. */
static long take_into(shmq_reader *rd, CSink *k, double wait) {
    eng_cursor *c = &rd->cur;
    eng_ring *r = c->ring;
    Sink sink = {copy_c, drop_c, taken_c, k};
    long got;
    if (c->kind == K_GROUP) {
        uint64_t *s = cur_slot(c), pos, lost;
        int lk = group_lock(c, wait, &s[SHMQ_S_LOCK_HOLDER], r->holder);
        if (lk != 0) return lk > 0 ? SHMQ_ELOCKED : lk;
        got = group_take_in(c, (long)k->max, &sink, &pos, &lost);
        group_unlock(c, &s[SHMQ_S_LOCK_HOLDER]);
        if (got > 0 || (got == 0 && lost)) release_behind(r, &c->released, pos);
        if (got > 0 && r->policy != SHMQ_POLICY_OVERWRITE) ring_space(r);
    } else {
        if ((got = eng_cursor_lock(c)) < 0) return got;
        got = private_take_in(c, (long)k->max, &sink);
        eng_cursor_unlock(c);
    }
    if (got == SHMQ_ECALLBACK && k->need)
        return eng_fail(SHMQ_ESIZE, "the frame has %zu bytes, the buffer %zu: nothing was taken", k->need, k->cap);
    return got;
}

/* A take that recovers a dead member's group lock (the Reader's rules). */
static long take_recovering(shmq_reader *rd, CSink *k, double lock_deadline) {
    eng_cursor *c = &rd->cur;
    double period = first_wait(c->ring);
    for (;;) {
        long got = take_into(rd, k, period);
        if (got != SHMQ_ELOCKED) return got;
        eng_lock_ref l;
        eng_group_lock_ref(c, &l);
        int rc = eng_lock_recover(&l);
        if (rc < 0) return rc;
        period = c->ring->recovery_timeout;
        if (rc == 0 && lock_deadline && mono_s() >= lock_deadline)
            return eng_fail(SHMQ_ELOCKED, "the group's lock is held by a live member that does not release it");
    }
}

typedef struct {
    shmq_reader *rd;
    CSink *k;
    double lock_deadline;
} ParkCtx;

static int park_take(void *ctx) {
    ParkCtx *p = ctx;
    long got = take_recovering(p->rd, p->k, p->lock_deadline);
    return got > 0 ? 1 : (int)got;
}

static int take_result(CSink *k, long got) {
    if (got == SHMQ_ESIZE) k->frames[0].len = k->need;
    return (int)got;
}

int shmq_take(shmq_reader *rd, void *buf, size_t cap, shmq_frame *frames, size_t max, double timeout) {
    eng_clear_error();
    eng_cursor *c = &rd->cur;
    int rc = eng_cursor_check(c);
    if (rc < 0) return rc;
    if (max == 0) return eng_fail(-EINVAL, "max must be >= 1");
    CSink k = {buf, cap, 0, 0, frames, max, 0};
    double lock_deadline = timeout < 0 ? 0 : mono_s() + (timeout > c->ring->recovery_timeout ? timeout : c->ring->recovery_timeout);
    long got = take_recovering(rd, &k, lock_deadline);
    if (got != 0) return take_result(&k, got);
    if (timeout == 0) return eng_fail(SHMQ_EEMPTY, "no frame available");
    /* Nothing now: spin a moment, publish what a waiting reader shows the world, park. */
    uint64_t deadline = timeout < 0 ? 0 : mono_ns() + (uint64_t)(timeout * 1e9) + 1;
    if (eng_spin_for_frame(c, deadline) && (got = take_recovering(rd, &k, lock_deadline)) != 0)
        return take_result(&k, got);
    if (c->slot >= 0 && (c->n || c->lost_pending)) eng_cursor_flush(c, first_wait(c->ring));
    ParkCtx p = {rd, &k, lock_deadline};
    rc = eng_park(c, park_take, &p, deadline);
    if (rc == 1) return (int)k.n;
    if (rc == SHMQ_EEMPTY) return eng_fail(SHMQ_EEMPTY, "no frame within %g s", timeout);
    return take_result(&k, rc);
}

int shmq_get(shmq_reader *rd, void *buf, size_t cap, shmq_frame *frame, double timeout) {
    int n = shmq_take(rd, buf, cap, frame, 1, timeout);
    return n < 0 ? n : 0;
}

int shmq_reader_commit(shmq_reader *rd) {
    eng_clear_error();
    return eng_cursor_commit(&rd->cur);
}

uint64_t shmq_reader_position(shmq_reader *rd) {
    eng_cursor *c = &rd->cur;
    if (c->kind == K_GROUP) return ld_acq(&cur_slot(c)[SHMQ_S_SEQ]);
    if (eng_cursor_lock(c) < 0) return c->seq;
    uint64_t seq = c->seq;
    eng_cursor_unlock(c);
    return seq;
}

uint64_t shmq_reader_lost(shmq_reader *rd) {
    eng_cursor *c = &rd->cur;
    if (c->kind == K_ANON) {
        if (eng_cursor_lock(c) < 0) return c->lost;
        uint64_t lost = c->lost;
        eng_cursor_unlock(c);
        return lost;
    }
    if (c->kind == K_NAMED) eng_cursor_flush(c, 0);
    return ld_acq(&cur_slot(c)[SHMQ_S_LOST]);
}

/* ---- statistics ---- */

int shmq_stats_get(shmq_spool *sp, shmq_stats *o) {
    eng_ring *r = &sp->ring;
    if (!r->base) return eng_fail(SHMQ_ECLOSED, "spool handle is closed");
    uint64_t *c = r->ctl;
    memset(o, 0, sizeof *o);
    o->capacity = r->ring_bytes;
    o->first_seq = ld_acq(&c[SHMQ_W_FIRST_SEQ]);
    o->next_seq = ld_acq(&c[SHMQ_W_NEXT_SEQ]);
    o->frames = o->next_seq > o->first_seq ? o->next_seq - o->first_seq : 0;
    uint64_t npos = ld_acq(&c[SHMQ_W_NEXT_POS]), fpos = ld_acq(&c[SHMQ_W_FIRST_POS]);
    o->used_bytes = npos > fpos ? npos - fpos : 0;
    if (r->segment && o->used_bytes > ld_rlx(&c[SHMQ_W_ALLOC])) o->used_bytes = ld_rlx(&c[SHMQ_W_ALLOC]);
    o->put_bytes = ld_rlx(&c[SHMQ_W_PUT_BYTES]);
    o->last_put_ns = ld_rlx(&c[SHMQ_W_LAST_PUT_NS]);
    o->evicted = ld_rlx(&c[SHMQ_W_EVICTED]);
    o->high_water_frames = ld_rlx(&c[SHMQ_W_HIGH_FRAMES]);
    o->high_water_bytes = ld_rlx(&c[SHMQ_W_HIGH_BYTES]);
    if (o->frames > o->high_water_frames) o->high_water_frames = o->frames;
    if (o->used_bytes > o->high_water_bytes) o->high_water_bytes = o->used_bytes;
    o->lock_breaks = ld_rlx(&c[SHMQ_W_LOCK_BREAKS]);
    o->growths = ld_rlx(&c[SHMQ_W_GROWTHS]);
    o->lock_pid = (uint32_t)(ld_rlx(&c[SHMQ_W_LOCK_HOLDER]) & 0xFFFFFFFFu);
    o->on_full = r->policy;
    o->checksum = r->checksum;
    o->growable = r->segment != 0;
    return 0;
}
