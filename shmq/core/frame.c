/*
 * shmq/core/frame.c: what a frame becomes in Python (the Frame struct
 * sequence, and the private copy of a large payload).  Its checksum is the
 * engine's (crc.c).
 */
#include "binding.h"

#include <pthread.h>
#include <sys/mman.h>
#include <unistd.h>

/* A new Frame (steals `data`), or NULL with an exception. */
PyObject *make_frame(CoreState *st, uint64_t seq, uint64_t ts, PyObject *data, int codec) {
    PyObject *f = PyStructSequence_New(st->FrameType);
    if (!f) {
        Py_DECREF(data);
        return NULL;
    }
    PyObject *s = PyLong_FromUnsignedLongLong(seq), *t = PyLong_FromUnsignedLongLong(ts), *cd = PyLong_FromLong(codec);
    if (!s || !t || !cd) {
        Py_XDECREF(s);
        Py_XDECREF(t);
        Py_XDECREF(cd);
        Py_DECREF(data);
        Py_DECREF(f);
        return NULL;
    }
    PyStructSequence_SET_ITEM(f, 0, s);
    PyStructSequence_SET_ITEM(f, 1, t);
    PyStructSequence_SET_ITEM(f, 2, data);
    PyStructSequence_SET_ITEM(f, 3, cd);
    return f;
}

static PyObject *frame_repr(PyObject *f) {
    PyObject *data = PyStructSequence_GET_ITEM(f, 2);
    PyObject *r = PyObject_Repr(data);
    if (!r) return NULL;
    Py_ssize_t n = PyUnicode_GET_LENGTH(r);
    if (n > 60) Py_SETREF(r, PyUnicode_Substring(r, 0, 60));
    if (!r) return NULL;
    PyObject *out = PyUnicode_FromFormat("Frame(seq=%S, timestamp_ns=%S, data=%U)", PyStructSequence_GET_ITEM(f, 0),
                                         PyStructSequence_GET_ITEM(f, 1), r);
    Py_DECREF(r);
    return out;
}

#ifdef Py_LIMITED_API
static PyObject *frame_repr_method(PyObject *f, PyObject *Py_UNUSED(ignored)) { return frame_repr(f); }
static PyMethodDef frame_repr_def = {"__repr__", frame_repr_method, METH_NOARGS, NULL};
#endif

static PyStructSequence_Field frame_fields[] = {
    {"seq", "Sequence number (strictly increasing)."},
    {"timestamp_ns", "Wall-clock ns when it was put."},
    {"data", "The payload (bytes; a bytearray for numpy and out-of-band pickle frames)."},
    {"codec", "The codec tag of the payload (shmq._format.CODEC_*)."},
    {NULL}};

static PyStructSequence_Desc frame_desc = {
    "shmq.Frame",
    "One message: (seq, timestamp_ns, data), a tuple with named fields; .codec names the payload's encoding.",
    frame_fields, 3};


/* The Frame type of one module instance: a named tuple of (seq,
 * timestamp_ns, data), .codec a hidden field. */
PyTypeObject *frame_type_new(void) {
    PyTypeObject *t = PyStructSequence_NewType(&frame_desc);
    if (!t) return NULL;
#ifndef Py_LIMITED_API
    t->tp_repr = frame_repr;
    PyType_Modified(t);
#else
    /* No slot writes in the limited API: a __repr__ method set on the (mutable)
     * type points its tp_repr at that method (abi.h). */
    PyObject *m = PyDescr_NewMethod(t, &frame_repr_def);
    if (!m || PyObject_SetAttrString((PyObject *)t, "__repr__", m) < 0) {
        Py_XDECREF(m);
        Py_DECREF(t);
        return NULL;
    }
    Py_DECREF(m);
#endif
    return t;
}

/* ---- LargeCopy: a large payload's private copy, on a mapping of its own ----
 *
 * A reader's copy of a numpy or out-of-band pickle payload of LARGE_COPY bytes
 * or more is memory the process keeps (a pool's result, a worker's argument).
 * On 4 KiB pages an 8 MiB copy costs 2,048 page faults, and a block from the
 * C allocator is not aligned to huge pages.  A private anonymous mapping
 * aligned to a huge page, with MADV_HUGEPAGE over its whole huge pages, takes
 * one fault per 2 MiB where THP is enabled (or "madvise").
 *
 * Fresh pages are still zeroed by the kernel before the copy overwrites them,
 * and that zeroing is what varies: a pool parent's map over 32 arrays of
 * 8 MiB spends 0.01 s to 0.4 s in clear_page_erms under the huge-page faults
 * of its result copies, from one map to the next on the same machine.  So a
 * released copy's mapping is not unmapped but kept for the next copy, up to
 * COPY_CACHE_BYTES in all, its pages marked MADV_FREE: reused while the
 * system has memory (no fault, no zeroing: the stdlib's pickles get the same
 * from glibc's heap), taken back by the kernel under memory pressure (a write
 * then faults a zeroed page in, as for a fresh mapping).  Python sees a copy
 * through a writable memoryview. */

#define HUGE_PAGE ((size_t)2 << 20)
#define COPY_CACHE_BYTES ((size_t)256 << 20)
#define COPY_CACHE_SLOTS 64

typedef struct {
    PyObject_HEAD
    char *base;      /* the mapping (huge-page aligned) */
    size_t map_len;  /* its length, whole pages */
    Py_ssize_t len;  /* the payload's bytes at base */
} LargeCopy;

/* Released mappings kept for reuse: process-wide (interpreters with their own
 * GIL share it, hence the mutex; a child after fork() starts empty). */
static struct {
    pthread_mutex_t mu;
    char *base[COPY_CACHE_SLOTS];
    size_t len[COPY_CACHE_SLOTS];
    int n;
    size_t bytes;
} cache = {PTHREAD_MUTEX_INITIALIZER};

/* The child has none of the kept mappings (MADV_DONTFORK). */
static void cache_after_fork(void) {
    pthread_mutex_init(&cache.mu, NULL);
    cache.n = 0;
    cache.bytes = 0;
}

static pthread_once_t cache_once = PTHREAD_ONCE_INIT;
static void cache_init(void) { (void)pthread_atfork(NULL, NULL, cache_after_fork); }

/* A kept mapping of at least `len` bytes and at most twice that (the smallest),
 * or NULL. */
static char *cache_take(size_t len, size_t *map_len) {
    char *got = NULL;
    pthread_mutex_lock(&cache.mu);
    int best = -1;
    for (int i = 0; i < cache.n; i++)
        if (cache.len[i] >= len && cache.len[i] / 2 <= len && (best < 0 || cache.len[i] < cache.len[best])) best = i;
    if (best >= 0) {
        got = cache.base[best];
        *map_len = cache.len[best];
        cache.bytes -= cache.len[best];
        cache.n--;
        cache.base[best] = cache.base[cache.n];
        cache.len[best] = cache.len[cache.n];
    }
    pthread_mutex_unlock(&cache.mu);
    if (got) (void)madvise(got, *map_len, MADV_DOFORK); /* a copy in use is inherited, as any memory */
    return got;
}

/* Keep a released mapping if there is room in the cache, else unmap it.  A
 * kept mapping is not inherited by fork(): a child would share its pages
 * copy-on-write, and the next copy written into it here would fault and copy
 * every page (a pool's parent forks its workers). */
static void cache_put(char *base, size_t map_len) {
    int kept = 0;
    /* both before the mapping is in the list: once there, another thread may take it
     * and write to it, and pages marked free after its writes could be dropped */
    if (madvise(base, map_len, MADV_DONTFORK) == 0) {
#ifdef MADV_FREE
        (void)madvise(base, map_len, MADV_FREE); /* the kernel may take the pages back */
#endif
        pthread_mutex_lock(&cache.mu);
        kept = cache.n < COPY_CACHE_SLOTS && cache.bytes + map_len <= COPY_CACHE_BYTES;
        if (kept) {
            cache.base[cache.n] = base;
            cache.len[cache.n] = map_len;
            cache.n++;
            cache.bytes += map_len;
        }
        pthread_mutex_unlock(&cache.mu);
    }
    if (!kept) munmap(base, map_len);
}

static void LargeCopy_dealloc(LargeCopy *c) {
    if (c->base) cache_put(c->base, c->map_len);
    PyTypeObject *tp = Py_TYPE((PyObject *)c);
    SHMQ_TP_FREE(tp)((PyObject *)c);
    Py_DECREF(tp);
}

static int LargeCopy_getbuffer(LargeCopy *c, Py_buffer *view, int flags) {
    return PyBuffer_FillInfo(view, (PyObject *)c, c->base, c->len, 0, flags);
}

static PyType_Slot largecopy_slots[] = {
    {Py_tp_dealloc, LargeCopy_dealloc},
    {Py_bf_getbuffer, LargeCopy_getbuffer},
    {Py_tp_doc, (void *)"A reader's private copy of a large payload (numpy, out-of-band pickle), on an\n"
                        "anonymous mapping of its own aligned to huge pages: the writable buffer behind\n"
                        "Frame.data's memoryview.  When the last view of it is gone its mapping is kept\n"
                        "for the next copy (at most 256 MiB a process, marked MADV_FREE) or unmapped."},
    {0, NULL}};

PyType_Spec largecopy_spec = {"shmq._core.LargeCopy", sizeof(LargeCopy), 0,
                              Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE | Py_TPFLAGS_DISALLOW_INSTANTIATION,
                              largecopy_slots};

/* A private anonymous mapping of `len` bytes (whole pages) starting on a huge
 * page: mapped one huge page longer, then trimmed at both ends, and advised
 * onto huge pages over its whole huge pages (a partial one would be allocated
 * whole for a tail of a few bytes; advice only, nothing changes where THP is
 * "never").  NULL if the system has no room (errno). */
static char *map_aligned(size_t len) {
    char *p = mmap(NULL, len + HUGE_PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return NULL;
    char *a = (char *)(((uintptr_t)p + HUGE_PAGE - 1) & ~(uintptr_t)(HUGE_PAGE - 1));
    if (a > p) munmap(p, (size_t)(a - p));
    size_t tail = (size_t)(p + len + HUGE_PAGE - (a + len));
    if (tail) munmap(a + len, tail);
#ifdef MADV_HUGEPAGE
    size_t whole = len & ~(HUGE_PAGE - 1);
    if (whole) (void)madvise(a, whole, MADV_HUGEPAGE);
#endif
    return a;
}

/* A writable memoryview over a new LargeCopy of n bytes (uninitialised: a
 * kept mapping holds an earlier copy's bytes), its bytes at *dst; NULL with
 * MemoryError or another exception. */
PyObject *large_copy_new(CoreState *st, Py_ssize_t n, char **dst) {
    (void)pthread_once(&cache_once, cache_init);
    size_t page = (size_t)sysconf(_SC_PAGESIZE); /* 4 KiB, or 16/64 KiB on some arm64 kernels */
    size_t len = ((size_t)n + page - 1) & ~(page - 1), map_len = len;
    char *base = cache_take(len, &map_len);
    if (!base && !(base = map_aligned(len))) return PyErr_NoMemory();
    LargeCopy *c = PyObject_New(LargeCopy, st->LargeCopyType);
    if (!c) {
        cache_put(base, map_len);
        return NULL;
    }
    c->base = base;
    c->map_len = map_len;
    c->len = n;
    PyObject *view = PyMemoryView_FromObject((PyObject *)c);
    Py_DECREF(c); /* the view holds it */
    if (!view) return NULL;
    *dst = base;
    return view;
}

/* copy_cache() -> (mappings, bytes): the released large copies kept for reuse. */
PyObject *core_copy_cache(PyObject *m, PyObject *unused) {
    (void)m, (void)unused;
    pthread_mutex_lock(&cache.mu);
    int n = cache.n;
    size_t bytes = cache.bytes;
    pthread_mutex_unlock(&cache.mu);
    return Py_BuildValue("(in)", n, (Py_ssize_t)bytes);
}
