/*
 * ADAPTER: the ThreadSanitizer harness's ONE dependency on the core's internals.
 *
 * Everything the harness (harness.c) knows about shmq's compiled core goes
 * through the small hx_* API at the end of this file, built on the core's
 * Python-free internals (docs/format.md, "The compiled core"; declared in
 * shmq/core/core.h).  When the core's files, structs or functions change,
 * only this file (and the source list stress/tsan.py reads from pyproject's
 * [[tool.setuptools.ext-modules]]) is retargeted.
 *
 * This file has two uses:
 *   - stress/tsan.py compiles EACH of the core's C files, unchanged, with
 *     `-include core_adapter.h -DHX_CORE_FILE`: only the shims below apply;
 *   - harness.c includes it for the hx_* API (HX_CORE_FILE undefined).
 * The objects are linked with libpython (for the symbols of the code the
 * harness never calls), which is never initialized: no interpreter, no GIL.
 *
 * What the harness drives (all with NO GIL, from pthreads):
 *   put      ring_write (lock, write_locked, unlock, doorbell, headroom wait)
 *   reserve  sem_lock_on(wsem), reserve_locked, payload in place,
 *            commit_reserved or nothing (abandon), wlock_release, ring_bell
 *   take     private_take_frames (named: auto-commit, flush, space bell), or
 *            sem_lock(gsem), group_take_locked, sem_post (groups), each
 *            through a Sink that copies into a per-cursor scratch buffer
 *   trim     sem_lock_on(wsem, 0), trim_locked, wlock_release (Spool.trim)
 * The Ring and Cursor handles are filled by hand as Ring_init / Cursor_init
 * fill them, with st NULL (no module state: no crash hook, no Python sink).
 *
 * Why the shims: a few of these paths release the GIL around a wait
 * (sem_lock_on, zone_place's fallocate, wait_caught_up) or raise on error.
 * With no interpreter those calls are redirected, in the core's files only,
 * to stand-ins that touch no shared state and never synchronize:
 *   - Py_BEGIN/END_ALLOW_THREADS are empty (there is no GIL to release; with
 *     one held its mutex would order every thread and TSan would prove nothing);
 *   - exceptions are recorded in a thread-local message (the harness fails);
 *   - sem_clockwait (not intercepted by gcc 12's libtsan, so its acquire
 *     would be invisible and two writers' ring stores reported as racing)
 *     becomes sem_timedwait with the same deadline on the wall clock.
 * The shared-memory logic (atomics, fences, plain stores to the ring, the
 * POSIX semaphores that are the writer and group locks) is the core's own,
 * compiled unchanged with -fsanitize=thread.
 */
#ifndef SHMQ_TSAN_CORE_ADAPTER_H
#define SHMQ_TSAN_CORE_ADAPTER_H

#define PY_SSIZE_T_CLEAN
#include <Python.h> /* first: core.h's own #include <Python.h> is then a no-op, and the shims below stick */
#include <errno.h>
#include <semaphore.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ---- shims, in every file (defined once, in harness.c's translation unit) ---- */

void hx_set_err(const char *what, const char *msg); /* the first error this thread hit */
PyObject *hx_err_format(PyObject *exc, const char *fmt, ...);
void hx_err_string(PyObject *exc, const char *msg);
void hx_err_object(PyObject *exc, PyObject *v);
PyObject *hx_err_errno(PyObject *exc);
PyObject *hx_err_errno_fn(PyObject *exc, PyObject *fn);
PyObject *hx_err_errno_fns(PyObject *exc, const char *fn);
PyObject *hx_err_nomem(void);
int hx_check_signals(void);
int hx_sem_clockwait(sem_t *s, clockid_t clk, const struct timespec *dl);

#undef Py_BEGIN_ALLOW_THREADS
#undef Py_END_ALLOW_THREADS
#define Py_BEGIN_ALLOW_THREADS {
#define Py_END_ALLOW_THREADS }
#define PyErr_Format hx_err_format
#define PyErr_SetString hx_err_string
#define PyErr_SetObject hx_err_object
#define PyErr_SetFromErrno hx_err_errno
#define PyErr_SetFromErrnoWithFilenameObject hx_err_errno_fn
#define PyErr_SetFromErrnoWithFilename hx_err_errno_fns
#define PyErr_NoMemory hx_err_nomem
#define PyErr_CheckSignals hx_check_signals
#define sem_clockwait hx_sem_clockwait

#ifndef HX_CORE_FILE
/* ---- the harness's side: the core's internal header, the shims' bodies, the hx_* API ---- */
#include "core.h"
#include "reports.h"

static __thread char hx_err[512]; /* the error the core raised in this thread ("" none) */

void hx_set_err(const char *what, const char *msg) {
    if (!hx_err[0]) snprintf(hx_err, sizeof hx_err, "%s: %s", what, msg ? msg : "");
}
PyObject *hx_err_format(PyObject *exc, const char *fmt, ...) {
    (void)exc;
    char msg[400];
    va_list ap;
    va_start(ap, fmt);
    if (strcmp(fmt, "%U: %s") == 0) { /* the core's corrupt(): path object, then its message */
        (void)va_arg(ap, PyObject *);
        snprintf(msg, sizeof msg, "%s", va_arg(ap, const char *));
    } else {
        vsnprintf(msg, sizeof msg, fmt, ap);
    }
    va_end(ap);
    hx_set_err("core error", msg);
    return NULL;
}
void hx_err_string(PyObject *exc, const char *msg) { (void)exc; hx_set_err("core error", msg); }
void hx_err_object(PyObject *exc, PyObject *v) { (void)exc; (void)v; hx_set_err("core error", "(object)"); }
PyObject *hx_err_errno(PyObject *exc) { (void)exc; hx_set_err("OSError", strerror(errno)); return NULL; }
PyObject *hx_err_errno_fn(PyObject *exc, PyObject *fn) { (void)fn; return hx_err_errno(exc); }
PyObject *hx_err_errno_fns(PyObject *exc, const char *fn) { (void)fn; return hx_err_errno(exc); }
PyObject *hx_err_nomem(void) { hx_set_err("MemoryError", ""); return NULL; }
int hx_check_signals(void) { return 0; }
int hx_sem_clockwait(sem_t *s, clockid_t clk, const struct timespec *dl) {
    struct timespec now_c, now_r, abs;
    clock_gettime(clk, &now_c);
    clock_gettime(CLOCK_REALTIME, &now_r);
    long long left = (long long)(dl->tv_sec - now_c.tv_sec) * 1000000000ll + (dl->tv_nsec - now_c.tv_nsec);
    if (left < 0) left = 0;
    long long t = (long long)now_r.tv_sec * 1000000000ll + now_r.tv_nsec + left;
    abs.tv_sec = (time_t)(t / 1000000000ll);
    abs.tv_nsec = (long)(t % 1000000000ll);
    return sem_timedwait(s, &abs);
}

typedef struct {
    uint64_t ring_offset, ring_bytes, slot_offset, slot_count;
    int policy, checksum;
    const char *wsem, *rsem, *fsem; /* the spool's named semaphores */
} hx_geo;

typedef Ring hx_ring; /* one handle per thread, like one per process */
/* A reader's cursor (anonymous, named or group member) and its sink's scratch:
 * a ring's worth, so that a copy the seqlock check then drops (an overwrite
 * run's torn header) never writes out of bounds. */
typedef struct {
    Cursor c;
    char *scratch;
    size_t len;
    FrameHeader h;
} hx_cursor;
typedef Reservation hx_resv;
enum { HX_ANON = K_ANON, HX_NAMED = K_NAMED, HX_GROUP = K_GROUP };
#define HX_NO_ROOM ST_NO_ROOM
#define HX_LOCK_WAIT 60.0 /* seconds: a stuck lock is a failure here, never a status */

static const char *hx_error(void) { return hx_err[0] ? hx_err : NULL; }

/* Once, before any thread starts. */
static void hx_init(void) { crc_init(); }

static sem_t *hx_sem(const char *name) {
    sem_t *s = sem_open(name, 0);
    if (s == SEM_FAILED) {
        fprintf(stderr, "sem_open %s: %s\n", name, strerror(errno));
        exit(3);
    }
    return s;
}

/* A handle over the mapping `base` of the spool open at `fd`: Ring_init's fields, st NULL. */
static hx_ring *hx_ring_open(const hx_geo *g, char *base, int fd) {
    Ring *r = calloc(1, sizeof(Ring));
    r->st = NULL;
    r->have_buf = 1;
    r->base = base;
    r->ctl = (uint64_t *)base;
    r->slots = (uint64_t *)(base + g->slot_offset);
    r->ring = base + g->ring_offset;
    r->ring_bytes = g->ring_bytes;
    r->ring_offset = g->ring_offset;
    r->segment = ld_rlx(&r->ctl[W_SEGMENT]);
    r->slot_count = g->slot_count;
    r->max_payload = g->ring_bytes - FRAME_BYTES;
    r->policy = g->policy;
    r->checksum = g->checksum;
    r->fd = fd;
    r->holder = (uint64_t)getpid();
    r->lock_wait = HX_LOCK_WAIT;
    r->rate_until = 0;
    r->rate_word = W_RATE + 1;
    r->path = Py_None;
    r->fast_put = 1;
    r->wsem = hx_sem(g->wsem);
    r->rsem = hx_sem(g->rsem);
    r->fsem = hx_sem(g->fsem);
    return r;
}

/* A cursor: Cursor_init's fields.  gsem: the group's semaphore name (groups only). */
static hx_cursor *hx_cursor_open(hx_ring *r, int kind, int64_t slot, uint64_t seq, uint64_t pos, int autocommit,
                                 int verify, const char *gsem) {
    hx_cursor *hc = calloc(1, sizeof(hx_cursor));
    Cursor *c = &hc->c;
    hc->scratch = malloc(r->ring_bytes);
    c->ring = r;
    c->kind = kind;
    c->slot = kind == K_ANON ? -1 : slot;
    c->seq = seq;
    c->pos = pos;
    c->released = pos;
    c->rng = (now_ns() ^ (uint64_t)(uintptr_t)c) | 1;
    c->autocommit = autocommit;
    c->verify = verify;
    if (kind == K_GROUP) c->gsem = hx_sem(gsem);
    return hc;
}

/* Put a batch of `count` (<= 64) frames in one call (Ring.put_many's path
 * below Python): first seq, or a negative status. */
static int64_t hx_put(hx_ring *r, void *const *bufs, const size_t *lens, int count, int patient) {
    Item items[64];
    for (int k = 0; k < count; k++) {
        memset(&items[k].views[0], 0, sizeof(Py_buffer));
        items[k].views[0].buf = bufs[k];
        items[k].views[0].len = (Py_ssize_t)lens[k];
        items[k].nviews = 1;
        items[k].n = lens[k];
        items[k].crc = r->checksum ? crc_update(0, bufs[k], lens[k]) : 0; /* as load_item does */
    }
    return ring_write(r, items, count, 0, -1, HX_LOCK_WAIT, patient);
}

/* Reserve room for n bytes (Ring.reserve below Python): 0 and *out (the
 * writer lock is then held), a negative status, or -100 (error). */
static int hx_reserve(hx_ring *r, size_t n, hx_resv **out) {
    if (n > r->max_payload) return ST_TOO_LARGE;
    int lk = sem_lock_on(r->wsem, HX_LOCK_WAIT, r);
    if (lk != 0) {
        if (lk > 0) hx_set_err("harness", "writer lock stuck");
        return -100;
    }
    st_rlx(&r->ctl[W_LOCK_HOLDER], r->holder);
    Reservation *rv = calloc(1, sizeof(Reservation));
    int st = reserve_locked(r, n, rv);
    if (st != 0) {
        wlock_release(r);
        free(rv);
        return st == ST_PYERR ? -100 : st;
    }
    rv->ring = r;
    rv->open = 1;
    *out = rv;
    return 0;
}
static char *hx_resv_buf(hx_resv *rv) { return rv->ring->ring + rv->off + FRAME_BYTES; }
/* Commit (Reservation.commit below Python): the frame's seq; abandon: 0.
 * Both release the writer lock and free the reservation. */
static int64_t hx_resv_commit(hx_resv *rv) {
    Ring *r = rv->ring;
    int64_t seq = (int64_t)rv->seq;
    commit_reserved(r, rv);
    wlock_release(r);
    ring_bell(r, r->rsem);
    free(rv);
    return seq;
}
static int hx_resv_abandon(hx_resv *rv) {
    unplace(rv->ring, rv->seq, rv->start); /* as Reservation.abandon */
    wlock_release(rv->ring); /* nothing was published: the space is reused by the next write */
    free(rv);
    return hx_error() ? -100 : 0;
}

/* The harness's Sink: the payload into the cursor's scratch buffer. */
/* Each copy is logged (reports.h) with the frame's bytes, header included, and
 * what the core then did with it: dropped (overwritten while copied) or returned. */
static const char *hx_copy(void *ctx, const char *src, const FrameHeader *h) {
    hx_cursor *hc = ctx;
    rep_copy_begin(src - FRAME_BYTES, src + h->length);
    memcpy(hc->scratch, src, h->length); /* the core's copy out of the ring; length < ring (header_sane) */
    rep_copy_done();
    hc->len = h->length;
    return hc->scratch;
}
static void hx_drop(void *ctx) {
    ((hx_cursor *)ctx)->len = 0;
    rep_copy_dropped();
}
static int hx_taken(void *ctx, const FrameHeader *h) {
    ((hx_cursor *)ctx)->h = *h;
    return 0;
}

/* Take one frame: 1 and its seq/payload copied to buf (up to cap bytes,
 * *len the full length), 0 nothing to read, -100 error. */
static int hx_take(hx_cursor *hc, uint64_t *seq, char *buf, size_t cap, size_t *len) {
    Cursor *c = &hc->c;
    Ring *r = c->ring;
    Sink sink = {hx_copy, hx_drop, hx_taken, hc};
    Py_ssize_t got;
    if (c->kind == K_GROUP) { /* cursor.c's group take, minus its Python sink */
        int lk = sem_lock(c->gsem, HX_LOCK_WAIT);
        if (lk != 0) {
            if (lk > 0) hx_set_err("harness", "group lock stuck");
            return -100;
        }
        uint64_t *s = cur_slot(c), pos, lost;
        st_rlx(&s[S_LOCK_HOLDER], r->holder);
        got = group_take_locked(c, 1, &sink, &pos, &lost);
        st_rlx(&s[S_LOCK_HOLDER], 0);
        sem_post(c->gsem);
        if (got >= 0) c->lost += lost;
        if (got > 0 || (got == 0 && lost)) release_behind(r, &c->released, pos);
        if (got > 0 && r->policy != 0) ring_bell(r, r->fsem);
    } else {
        got = private_take_frames(c, 1, &sink);
    }
    if (got < 0 || hx_error()) return -100;
    if (got == 0) return 0;
    rep_copy_accepted();
    *seq = hc->h.seq;
    *len = hc->len;
    memcpy(buf, hc->scratch, *len < cap ? *len : cap);
    return 1;
}
static void hx_flush(hx_cursor *hc) {
    if (hc->c.kind == K_NAMED) {
        named_commit(&hc->c);
        flush_locked(&hc->c);
    }
}
static uint64_t hx_cursor_lost(hx_cursor *hc) { return hc->c.lost; }
static uint64_t hx_cursor_seq(hx_cursor *hc) { return hc->c.seq; }
/* An idle reader trims a growable ring (Spool.trim_idle, Ring.trim below
 * Python): takes the writer lock if free at once, evicts what every consumer
 * has consumed, punches the pages nothing lives in.  0 done or lock busy,
 * -100 error. */
static int hx_trim(hx_ring *r) {
    if (!r->segment) return 0;
    int lk = sem_lock_on(r->wsem, 0.0, r);
    if (lk < 0) return -100;
    if (lk > 0) return 0;
    st_rlx(&r->ctl[W_LOCK_HOLDER], r->holder);
    int rc = trim_locked(r);
    wlock_release(r);
    if (rc == ST_PYERR) return -100;
    ring_bell(r, r->fsem);
    return 0;
}

/* After the run (threads joined): how far the ring went. */
typedef struct { uint64_t next_seq, next_pos, evicted, growths; } hx_totals;
static hx_totals hx_ring_totals(char *base) {
    uint64_t *c = (uint64_t *)base;
    return (hx_totals){ld_rlx(&c[W_NEXT_SEQ]), ld_rlx(&c[W_NEXT_POS]), ld_rlx(&c[W_EVICTED]), ld_rlx(&c[W_GROWTHS])};
}
/* Pretend a reader and a writer are registered as doorbell waiters for the
 * whole run (once, before the threads): every put and every consuming take
 * then rings (ring_bell's seq_cst fence, the futex word, the doorbell byte). */
static void hx_register_waiters(const hx_geo *g) {
    sem_post(hx_sem(g->rsem));
    sem_post(hx_sem(g->fsem));
}
/* The group's shared cursor (relaxed: no happens-before for the harness). */
static uint64_t hx_group_seq(hx_cursor *hc) { return ld_rlx(&cur_slot(&hc->c)[S_SEQ]); }

#endif /* !HX_CORE_FILE */
#endif
