/*
 * ADAPTER: the ThreadSanitizer harness's ONE dependency on the core's internals.
 *
 * Everything the harness (harness.c) knows about shmq's compiled core goes
 * through the small hx_* API at the end of this file.  When the core's
 * sources, struct names or function names change (the split of _core.c into
 * shmq/core/ files), only this file is retargeted:
 *
 *   - CORE_SOURCE: the core's C file(s), included here (stress/tsan.py passes
 *     the ext-module's sources from pyproject's [[tool.setuptools.ext-modules]]
 *     as -DCORE_SOURCE=...; with several files, an amalgamation including each).
 *   - Ring / Cursor / Reservation: the core's handle structs, filled by hand
 *     below exactly as Ring_init / Cursor_init fill them (minus Python).
 *   - ring_write, Ring_reserve, Reservation_commit, Reservation_abandon,
 *     cursor_take, named_commit: the core functions under test.
 *
 * Why the Python shims: every core function runs with the GIL held, and the
 * GIL's mutex would order all threads (TSan would see happens-before through
 * it and prove nothing).  So the worker threads call the core with NO GIL and
 * NO interpreter: the few CPython calls on these paths are redirected, for
 * the core's code only, to thread-private stand-ins that touch no shared
 * state and never synchronize:
 *   - objects the core returns (frame payloads, ints, the Reservation) are
 *     malloc'ed stand-ins freed through their type's tp_dealloc;
 *   - Py_RETURN_NONE/TRUE/FALSE return the singleton without a refcount
 *     write (immortal since 3.12 anyway);
 *   - exceptions are recorded in a thread-local message (harness fails);
 *   - Py_BEGIN/END_ALLOW_THREADS are empty (no GIL to release);
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
#include <Python.h> /* first: the core's own #include <Python.h> is then a no-op, and the shims below stick */
#include <errno.h>
#include <semaphore.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ---- thread-private stand-ins for the CPython calls on the hot paths ---- */

static __thread char hx_err[512]; /* the exception the core raised in this thread ("" none) */

static void hx_set_err(const char *what, const char *msg) {
    if (!hx_err[0]) snprintf(hx_err, sizeof hx_err, "%s: %s", what, msg ? msg : "");
}
static PyObject *hx_err_format(PyObject *exc, const char *fmt, ...) {
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
static void hx_err_string(PyObject *exc, const char *msg) { (void)exc; hx_set_err("core error", msg); }
static void hx_err_object(PyObject *exc, PyObject *v) { (void)exc; (void)v; hx_set_err("core error", "(object)"); }
static PyObject *hx_err_errno(PyObject *exc) { (void)exc; hx_set_err("OSError", strerror(errno)); return NULL; }
static PyObject *hx_err_errno_fn(PyObject *exc, PyObject *fn) { (void)fn; return hx_err_errno(exc); }
static PyObject *hx_err_errno_fns(PyObject *exc, const char *fn) { (void)fn; return hx_err_errno(exc); }
static PyObject *hx_err_nomem(void) { hx_set_err("MemoryError", ""); return NULL; }
static int hx_check_signals(void) { return 0; }

/* Stand-in objects: a header, then the payload (bytes) or a value (int). */
static void hx_obj_free(PyObject *o) { free(o); }
static void hx_obj_free_v(void *o) { free(o); }
static PyTypeObject hx_bytes_type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "hx_bytes",
    .tp_basicsize = sizeof(PyBytesObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BYTES_SUBCLASS, /* PyBytes_Check / PyBytes_AS_STRING work */
    .tp_dealloc = hx_obj_free,
};
typedef struct {
    PyObject_HEAD
    long long value;
} hx_int;
static PyTypeObject hx_int_type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "hx_int",
    .tp_basicsize = sizeof(hx_int),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_dealloc = hx_obj_free,
};
static PyObject *hx_new(PyTypeObject *t, size_t size) {
    PyObject *o = calloc(1, size);
    if (!o) return hx_err_nomem();
    Py_SET_REFCNT(o, 1);
    Py_SET_TYPE(o, t);
    return o;
}
static PyObject *hx_bytes(const char *src, Py_ssize_t n) {
    PyBytesObject *b = (PyBytesObject *)hx_new(&hx_bytes_type, offsetof(PyBytesObject, ob_sval) + (size_t)n + 1);
    if (!b) return NULL;
    Py_SET_SIZE(b, n);
    if (src) memcpy(b->ob_sval, src, (size_t)n); /* the core's copy out of the ring */
    return (PyObject *)b;
}
static PyObject *hx_long(long long v) {
    hx_int *o = (hx_int *)hx_new(&hx_int_type, sizeof(hx_int));
    if (o) o->value = v;
    return (PyObject *)o;
}
static PyObject *hx_ulong(unsigned long long v) { return hx_long((long long)v); }
static PyObject *hx_object_new(PyTypeObject *t) { return hx_new(t, (size_t)t->tp_basicsize); }
static void *hx_malloc(size_t n) { return malloc(n ? n : 1); }
static void *hx_realloc(void *p, size_t n) { return realloc(p, n ? n : 1); }

/* PyArg_ParseTuple for the few entry points called with arguments (Ring_reserve):
 * `args` is an hx_args, its values in the format's order. */
typedef struct {
    PyObject_HEAD
    int n;
    union { unsigned long long K; long long L; int i; double d; } v[8];
} hx_args;
static int hx_parse(PyObject *args, const char *fmt, ...) {
    hx_args *a = (hx_args *)args;
    va_list ap;
    va_start(ap, fmt);
    int k = 0;
    for (const char *f = fmt; *f && *f != ':' && *f != ';'; f++) {
        if (*f == '|') continue;
        if (k >= a->n) break; /* optional arguments not given */
        switch (*f) {
        case 'K': *va_arg(ap, unsigned long long *) = a->v[k++].K; break;
        case 'L': *va_arg(ap, long long *) = a->v[k++].L; break;
        case 'i': case 'p': *va_arg(ap, int *) = a->v[k++].i; break;
        case 'd': *va_arg(ap, double *) = a->v[k++].d; break;
        default: va_end(ap); hx_set_err("harness", "unsupported PyArg format"); return 0;
        }
    }
    va_end(ap);
    return 1;
}

static int hx_sem_clockwait(sem_t *s, clockid_t clk, const struct timespec *dl) {
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

#undef Py_BEGIN_ALLOW_THREADS
#undef Py_END_ALLOW_THREADS
#define Py_BEGIN_ALLOW_THREADS {
#define Py_END_ALLOW_THREADS }
#undef Py_RETURN_NONE
#undef Py_RETURN_TRUE
#undef Py_RETURN_FALSE
#define Py_RETURN_NONE return Py_None
#define Py_RETURN_TRUE return Py_True
#define Py_RETURN_FALSE return Py_False
#define PyErr_Format hx_err_format
#define PyErr_SetString hx_err_string
#define PyErr_SetObject hx_err_object
#define PyErr_SetFromErrno hx_err_errno
#define PyErr_SetFromErrnoWithFilenameObject hx_err_errno_fn
#define PyErr_SetFromErrnoWithFilename hx_err_errno_fns
#define PyErr_NoMemory hx_err_nomem
#define PyErr_CheckSignals hx_check_signals
#define PyBytes_FromStringAndSize hx_bytes
#define PyByteArray_FromStringAndSize hx_bytes
#define PyLong_FromLong hx_long
#define PyLong_FromLongLong hx_long
#define PyLong_FromUnsignedLongLong hx_ulong
#undef PyObject_New
#define PyObject_New(type, typeobj) ((type *)hx_object_new(typeobj))
#define PyMem_Malloc hx_malloc
#define PyMem_Realloc hx_realloc
#define PyMem_Free free
#undef PyArg_ParseTuple
#define PyArg_ParseTuple hx_parse
#define sem_clockwait hx_sem_clockwait

/* ---- the core, compiled with -fsanitize=thread ---- */
#ifndef CORE_SOURCE
#error "build with -DCORE_SOURCE='\"path/to/shmq/_core.c\"' (stress/tsan.py does)"
#endif
#include CORE_SOURCE

/* ---- the harness's API onto the core ---- */

typedef struct {
    uint64_t ring_offset, ring_bytes, slot_offset, slot_count;
    int policy, checksum;
    const char *wsem, *rsem, *fsem; /* the spool's named semaphores */
} hx_geo;

typedef Ring hx_ring;       /* one handle per thread, like one per process */
typedef Cursor hx_cursor;   /* a reader's cursor (anonymous, named or group member) */
typedef Reservation hx_resv;
enum { HX_ANON = K_ANON, HX_NAMED = K_NAMED, HX_GROUP = K_GROUP };
#define HX_NO_ROOM ST_NO_ROOM
#define HX_LOCK_WAIT 60.0 /* seconds: a stuck lock is a failure here, never a status */

static const char *hx_error(void) { return hx_err[0] ? hx_err : NULL; }

/* Once, before any thread starts. */
static void hx_init(void) {
    crc_init();
    ReservationType.tp_free = hx_obj_free_v;
    (void)PyThread_get_thread_ident(); /* its lazy initialization, before the threads */
}

static sem_t *hx_sem(const char *name) {
    sem_t *s = sem_open(name, 0);
    if (s == SEM_FAILED) {
        fprintf(stderr, "sem_open %s: %s\n", name, strerror(errno));
        exit(3);
    }
    return s;
}

/* A handle over the mapping `base` of the spool open at `fd`: Ring_init's fields. */
static hx_ring *hx_ring_open(const hx_geo *g, char *base, int fd) {
    Ring *r = calloc(1, sizeof(Ring));
    Py_SET_REFCNT(r, 1 << 20); /* never freed through Python */
    Py_SET_TYPE(r, &RingType);
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
    Cursor *c = calloc(1, sizeof(Cursor));
    Py_SET_REFCNT(c, 1 << 20);
    Py_SET_TYPE(c, &CursorType);
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
    return c;
}

/* Put a batch of `count` (<= 64) frames in one call: first seq, or a negative status. */
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

/* Reserve room for n bytes: 0 and *out (the writer lock is then held), a
 * negative status, or -100 (error). */
static int hx_reserve(hx_ring *r, size_t n, hx_resv **out) {
    hx_args a;
    memset(&a, 0, sizeof a);
    a.n = 3;
    a.v[0].K = n;
    a.v[1].i = 0;
    a.v[2].d = HX_LOCK_WAIT;
    PyObject *res = Ring_reserve(r, (PyObject *)&a);
    if (!res) return -100;
    if (Py_TYPE(res) == &ReservationType) {
        *out = (Reservation *)res;
        return 0;
    }
    int st = (int)((hx_int *)res)->value;
    Py_DECREF(res);
    return st;
}
static char *hx_resv_buf(hx_resv *rv) { return rv->ring->ring + rv->off + FRAME_BYTES; }
/* Commit: the frame's seq, or -100; abandon: 0.  Both drop the reservation. */
static int64_t hx_resv_commit(hx_resv *rv) {
    PyObject *res = Reservation_commit(rv, NULL);
    int64_t seq = res ? ((hx_int *)res)->value : -100;
    Py_XDECREF(res);
    Py_DECREF(rv);
    return seq;
}
static int hx_resv_abandon(hx_resv *rv) {
    Reservation_abandon(rv, NULL);
    Py_DECREF(rv);
    return hx_error() ? -100 : 0;
}

/* Take one frame: 1 and its seq/payload copied to buf (up to cap bytes,
 * *len the full length), 0 nothing to read, -100 error. */
static int hx_take(hx_cursor *c, uint64_t *seq, char *buf, size_t cap, size_t *len) {
    FrameHeader h;
    PyObject *f = cursor_take(c, 1, 0, HX_LOCK_WAIT, &h, NULL);
    if (!f) return -100;
    if (f == Py_None) return 0;
    if (Py_TYPE(f) != &hx_bytes_type) { /* a status (a stuck group lock) */
        Py_DECREF(f);
        hx_set_err("harness", "take returned a status");
        return -100;
    }
    *seq = h.seq;
    *len = (size_t)PyBytes_GET_SIZE(f);
    memcpy(buf, PyBytes_AS_STRING(f), *len < cap ? *len : cap);
    Py_DECREF(f);
    return 1;
}
static void hx_flush(hx_cursor *c) {
    if (c->kind == K_NAMED) {
        named_commit(c);
        flush_locked(c);
    }
}
static uint64_t hx_cursor_lost(hx_cursor *c) { return c->lost; }
/* An idle reader trims a growable ring (Spool.trim_idle): takes the writer lock
 * if free at once, evicts what every consumer has consumed, punches the pages
 * nothing lives in.  0 done or lock busy, -100 error. */
static int hx_trim(hx_ring *r) {
    hx_args a;
    memset(&a, 0, sizeof a);
    a.n = 1;
    a.v[0].d = 0.0;
    PyObject *res = Ring_trim(r, (PyObject *)&a);
    return res ? 0 : -100;
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
static uint64_t hx_group_seq(hx_cursor *c) { return ld_rlx(&cur_slot(c)[S_SEQ]); }

#endif
