/*
 * shmq/core/core.h: the compiled core's internal header -- its structs, the
 * small inline helpers every file uses, and the declarations one file
 * offers another.  Not installed and not an API: shmq._core is built from
 * the files in this folder (pyproject.toml's ext-modules), and the
 * ThreadSanitizer harness (stress/tsan.py) compiles against it to drive the
 * Python-free internals from pthreads.
 *
 * Map of the files (docs/format.md, "The compiled core", says the same):
 *   layout.h   shared words, flags, limits, status codes (plain C)
 *   core.h     this header
 *   wait.c     semaphore waits, doorbells, the reader's spin and park
 *   write.c    placement, eviction and commit: put, put_many, reserve
 *   options.c  put_many's options: Deferred, before_commit, timestamps, sync
 *   zone.c     growable rings: the hot zone's pages (allocate, punch, trim)
 *   reserve.c  the Reservation type (zero-copy writes)
 *   read.c     the lock-free read loop and the private / group takes
 *   ring.c     the Ring type: one spool mapping
 *   api.c      the entry points Spool, Reader and Queue bind, and their
 *              hand-off to the Python slow paths
 *   cursor.c   the Cursor type: a reader's position
 *   lock.c     the Lock and Waiting types
 *   frame.c    Frame, CRC-32
 *   module.c   module state, init, module functions
 *
 * Thread and signal safety: every function here holds the GIL for the whole
 * time it holds the writer lock or a group lock, and runs no Python code
 * while holding one, but for three callouts a caller asks for: put_many's
 * Deferred fill() and before_commit() (options.c) and the crash hook of the
 * fault-injection harness.  Python signal handlers and other threads only
 * run between bytecodes, so a call without callouts is atomic for them:
 * Ctrl-C can never leave a shared lock held; a callout that raises (a
 * signal handler's exception included) aborts its batch and the lock is
 * released before the exception propagates.  The GIL is released only to
 * wait for a lock that is not yet ours, and, with the writer lock held
 * (Ring.busy counted, so a close() meanwhile is deferred), around a growable
 * ring's fallocate and a sync=True batch's msync.
 *
 * Memory ordering (C11 atomics, correct on x86-64 and aarch64):
 *   writer: payload and header stores, then a release store of NEXT_SEQ
 *           (the commit point); eviction stores FIRST_POS, then a release
 *           fence, before any byte of the evicted region is overwritten.
 *   reader: acquire load of NEXT_SEQ, copy, acquire fence, load FIRST_POS:
 *           a frame is intact iff FIRST_POS did not pass it (seqlock).
 *
 * Every length, offset and sequence number read from the shared mapping is
 * bounds-checked before use: a corrupt or hostile file can make a call fail
 * with SpoolFormatError, never read outside the mapping.
 */
#ifndef SHMQ_CORE_H
#define SHMQ_CORE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <semaphore.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <limits.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "layout.h"
#include "abi.h" /* the stable-ABI build (Py_LIMITED_API); nothing without it */

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23 /* Linux 5.14; older kernels refuse it (EINVAL): only a missed optimization */
#endif

/* ---- module state (PEP 630): one per interpreter that imports shmq._core ---- */
typedef struct {
    PyObject *SpoolFormatError; /* set by _core.setup() */
    PyObject *crash_hook;       /* fault-injection harness only */
    PyObject *pickle_loads;     /* for Cursor.get_obj */
    PyObject *EmptyError;       /* shmq.Empty, raised when a wait in C times out */
    PyObject *pickle_dumps;     /* for Ring.put_obj_api, with: */
    PyObject *dumps_protocol;   /*   shmq.codec.PROTOCOL */
    PyObject *dumps_kwnames;    /*   ("buffer_callback",) */
    PyObject *inband_callback;  /*   core_inband, as a callable */
    unsigned long buffers_seen; /* bumped by core_inband */
    double safety_net_s;        /* the longest futex sleep of a parked get (set_safety_net) */
    PyObject *EMPTY, *STUCK, *UNDECODED; /* get_obj's sentinels */
    PyTypeObject *FrameType, *RingType, *CursorType, *ReservationType, *LockType, *WaitingType, *QueuePortType;
    PyTypeObject *DeferredType; /* shmq.Deferred: a payload written by fill() under the writer lock */
} CoreState;

/* Hot loops whose callers pass constant callbacks: inlined so the calls are
 * direct (a function pointer resolved at compile time). */
#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* ---- atomics on words of the shared mapping ---- */
#define AW(p) ((_Atomic uint64_t *)(p))
static inline uint64_t ld_acq(uint64_t *p) { return atomic_load_explicit(AW(p), memory_order_acquire); }
static inline uint64_t ld_rlx(uint64_t *p) { return atomic_load_explicit(AW(p), memory_order_relaxed); }
static inline void st_rel(uint64_t *p, uint64_t v) { atomic_store_explicit(AW(p), v, memory_order_release); }
static inline void st_rlx(uint64_t *p, uint64_t v) { atomic_store_explicit(AW(p), v, memory_order_relaxed); }

static inline uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static inline uint64_t mono_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts); /* vDSO: no syscall */
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* ---- the Ring: one spool mapping's hot path ---- */
struct Reservation_;
typedef struct {
    PyObject_HEAD
    CoreState *st;        /* the module state of the module that made this type (hot paths: no lookup) */
    Py_buffer buf;
    int have_buf;
    char *base;
    uint64_t *ctl;
    uint64_t *slots;
    char *ring;
    uint64_t ring_bytes;
    uint64_t ring_offset; /* file offset of the ring (for fallocate) */
    uint64_t segment;     /* growable spools: W_SEGMENT, read once at open (0: fixed) */
    int fd_owned;         /* fd is our own duplicate of the mapping's descriptor */
    int busy;             /* threads inside a GIL-released section of this handle */
    int closing;          /* close() came while busy: the last one out releases */
    uint64_t slot_count;
    uint64_t max_payload;
    int policy; /* 0 overwrite, 1 block, 2 error */
    int checksum;
    int fd;
    uint64_t holder;
    sem_t *wsem, *rsem, *fsem;
    uint64_t rate_until;
    int rate_word;
    uint64_t lap_ns; /* growable: when this handle last wrapped early (0: not yet) */
    uint64_t full_floor, full_pin; /* room marker, taken under the lock when full */
    double lock_wait;              /* default wait before reporting a stuck lock (recovery timeout) */
    struct Reservation_ *reserved_by; /* an open reservation of this handle (it holds the lock) */
    unsigned long callout;            /* thread running a write's Python callout (fill, before_commit) under
                                         the writer lock; 0: none.  A put from it would deadlock. */
    PyObject *owner;    /* weak reference to the Python handle whose slow path completes put_api */
    PyObject *put_slow; /* owner's slow path, a plain function: put_slow(owner, data, block, timeout, codec) */
    int fast_put;       /* 0: put_api always takes the slow path (sync=True) */
    PyObject *path;
    uint64_t pop_start, pop_pos; /* ring positions this process pre-faulted: [pop_start, pop_pos) */
    int pop_state;               /* 0 not started, 1 going, 2 done or unsupported */
} Ring;

typedef struct Reservation_ {
    PyObject_HEAD
    Ring *ring;
    uint64_t seq, off, nbytes, stored, end, start; /* start: NEXT_POS when placed (see unplace) */
    int codec, open; /* open: the writer lock is held for us */
    unsigned long thread;
    PyObject *view;
} Reservation;

/* ---- Cursor: a reader's position ---- */
enum { K_ANON = 0, K_NAMED = 1, K_GROUP = 2 };

typedef struct {
    PyObject_HEAD
    Ring *ring;
    uint64_t seq, pos, lost;
    int64_t slot;
    int kind, autocommit, verify;
    sem_t *gsem;
    uint64_t n, bytes, dsum, dmax, dcount, lag_peak, lost_pending;
    uint64_t rng;      /* xorshift state of delay_clock */
    PyObject *closed_msg;
    PyObject *last;     /* the frame get_obj() could not decode (UNDECODED) */
    PyObject *owner;    /* weak reference to the handle whose get_slow completes get_api / get_obj_api */
    PyObject *get_slow; /* owner's slow path, a plain function: get_slow(owner, block, timeout, first) */
    uint64_t released; /* ring position up to which this cursor has released its pages */
    int busy;          /* threads waiting for the group lock with the GIL released */
    uint64_t known;    /* a NEXT_SEQ loaded before: frames below it are committed (read_one) */
} Cursor;

/* One item of a batch: up to a few segments written one after the other.
 * Only .buf and .len of the views are used below the entry points. */
typedef struct {
    Py_buffer views[MAX_SEGS];
    int nviews;
    uint64_t n;
    uint32_t crc;
    PyObject *fill; /* a Deferred's fill (nviews 0; borrowed: the batch holds it); read only if WriteOpts.deferred */
} Item;

/* What put_many's keyword options ask of a batch (options.c parses them, write.c's
 * write_locked acts on them); the plain path
 * passes none (NULL) and reads none of it.  The Python callouts (fill,
 * before_commit) run under the writer lock; one that raises aborts the
 * batch: nothing is published (see write.c's unplace). */
typedef struct {
    PyObject *before_commit; /* before_commit(first_seq, [positions]) once placed, before any byte is written */
    uint64_t *timestamps;    /* one per frame (ns), replacing the put time in its header; NULL: now */
    int sync;                /* msync the batch's pages before the commit, the header page after it */
    int deferred;            /* some item is a Deferred (Item.fill set): filled in place, crc after */
} WriteOpts;

/* Where a batch goes (write.c's place_batch): a frame that does not fit
 * before the ring's end is preceded by padding to the end (a PAD header if
 * 32+ bytes remain); a batch wraps at most twice. */
typedef struct {
    uint64_t seq0, start, end; /* first seq, NEXT_POS before, NEXT_POS after */
    int npads;
    uint64_t pads_off[2], pads_gap[2];
    Py_ssize_t pads_k[2];
} Placement;

/* ---- small helpers ---- */
static inline int ring_check_open(Ring *r) {
    if (!r->have_buf) {
        PyErr_SetString(PyExc_ValueError, "spool handle is closed");
        return -1;
    }
    return 0;
}

static inline void read_header(Ring *r, uint64_t off, FrameHeader *h) { memcpy(h, r->ring + off, FRAME_BYTES); }

static inline int header_sane(const FrameHeader *h, uint64_t off, uint64_t ring) {
    return (uint64_t)h->stored >= FRAME_BYTES + (uint64_t)h->length && h->stored % ALIGN == 0 &&
           off + h->stored <= ring;
}

static inline void wlock_release(Ring *r) {
    st_rlx(&r->ctl[W_LOCK_HOLDER], 0);
    sem_post(r->wsem); /* a release operation: the holder word and all writes are visible first */
}

/* The 32-bit futex word of a doorbell: the low half of control word `word`
 * (little-endian: x86-64 and aarch64 Linux, the supported platforms). */
static inline _Atomic uint32_t *bell_word(Ring *r, int word) { return (_Atomic uint32_t *)&r->ctl[word]; }

static inline uint64_t *cur_slot(Cursor *c) { return c->ring->slots + c->slot * SLOT_WORDS; }

/* The fault-injection harness's hook at `point`: 0, or ST_PYERR if it raised.
 * A Ring made outside the module (a C harness: st NULL) has none. */
int call_crash_hook(CoreState *st, const char *point);
static inline int crash_point(Ring *r, const char *point) {
    return r->st && r->st->crash_hook ? call_crash_hook(r->st, point) : 0;
}

/* ---- ring.c ---- */
void ring_release(Ring *r);
PyObject *corrupt(Ring *r, const char *fmt, ...);
sem_t *open_sem(const char *name);

/* A close() that came while another thread was inside a GIL-released section
 * (busy) was deferred: the last one out finishes it. */
static inline void ring_finish(Ring *r) {
    if (r->closing && !r->busy) {
        r->closing = 0;
        ring_release(r);
    }
}

/* ---- wait.c ---- */
int sem_lock_as(sem_t *s, double wait_s, Ring *ring, uint64_t *word, uint64_t holder);
static inline int sem_lock_on(sem_t *s, double wait_s, Ring *ring) { return sem_lock_as(s, wait_s, ring, NULL, 0); }
static inline int sem_lock(sem_t *s, double wait_s) { return sem_lock_as(s, wait_s, NULL, NULL, 0); }
int ring_closed_meanwhile(Ring *r, int held, sem_t *s);
void ring_bell(Ring *r, sem_t *waiters);
int wait_caught_up(Ring *r, uint64_t start, uint64_t lag, uint64_t lap_share);
typedef PyObject *(*take_fn)(Cursor *);
PyObject *wait_take(Cursor *c, take_fn take, PyObject *nothing, uint64_t deadline, PyObject *timeout);
int park_deadline(PyObject *block, PyObject *timeout, uint64_t *deadline);
PyObject *time_left(PyObject *timeout, uint64_t deadline);

/* ---- write.c (Python-free: the TSan harness calls these under the writer lock) ---- */
uint64_t slot_hwm(Ring *r);
int slot_floor(Ring *r, int word, uint64_t *out);
uint64_t pin_floor(Ring *r);
void take_full_marker(Ring *r);
int make_room(Ring *r, uint64_t limit, uint64_t next_seq, uint64_t batch_pos);
int place_batch(Ring *r, Py_ssize_t count, const uint64_t *needs, uint64_t total, int64_t max_backlog,
                uint64_t *placed, Placement *pl);
void write_pads(Ring *r, const Placement *pl, uint64_t ts);
void commit_batch(Ring *r, uint64_t next_seq, uint64_t end, uint64_t count, uint64_t nbytes, uint64_t ts);
void unplace(Ring *r, uint64_t seq0, uint64_t start);
int64_t write_locked(Ring *r, Item *items, Py_ssize_t count, uint64_t *needs, uint64_t total, int codec,
                     int64_t max_backlog, uint64_t *placed, const WriteOpts *o);
void populate_ahead(Ring *r, uint64_t pos, uint64_t len);
/* with the GIL (takes the writer lock, may raise) */
int load_item(Item *it, PyObject *o, int checksum);
void release_items(Item *items, Py_ssize_t k);
int64_t ring_write_opts(Ring *r, Item *items, Py_ssize_t count, int codec, int64_t max_backlog, double lock_wait,
                        int patient, const WriteOpts *o);
static inline int64_t ring_write(Ring *r, Item *items, Py_ssize_t count, int codec, int64_t max_backlog,
                                 double lock_wait, int patient) {
    return ring_write_opts(r, items, count, codec, max_backlog, lock_wait, patient, NULL);
}

/* ---- options.c: put_many's options ---- */
extern PyType_Spec deferred_spec;
int load_deferred(Ring *r, Item *it, PyObject *o); /* 1: o is a Deferred (loaded), 0: it is not, -1: error */
int parse_write_opts(Ring *r, PyObject *const *kwargs, PyObject *kwnames, Py_ssize_t count, WriteOpts *o);
void free_write_opts(WriteOpts *o);
/* writer lock held; 0, or -1 with an exception: */
int call_before_commit(Ring *r, PyObject *fn, uint64_t seq0, const uint64_t *placed, Py_ssize_t count);
int fill_payload(Ring *r, PyObject *fill, char *dst, uint64_t n);
int sync_ring(Ring *r, uint64_t a, uint64_t b); /* msync ring positions [a, b), GIL released */
int sync_header(Ring *r);                       /* msync the header page */

/* ---- zone.c ---- */
int trim_due(Ring *r);
int zone_place(Ring *r, uint64_t start, Py_ssize_t count, const uint64_t *needs, uint64_t total, uint64_t *placed,
               Placement *pl, uint64_t next_seq);
int zone_alloc(Ring *r, uint64_t a, uint64_t b);
int zone_punch(Ring *r, uint64_t a, uint64_t b);
int trim_locked(Ring *r);

/* ---- reserve.c ---- */
int reserve_locked(Ring *r, uint64_t nbytes, Reservation *rv); /* Python-free, writer lock held */
void commit_reserved(Ring *r, const Reservation *rv);            /* Python-free, writer lock held */
PyObject *Ring_reserve(Ring *r, PyObject *args);
extern PyType_Spec reservation_spec;

/* ---- read.c ---- */
#define RD_NONE ((PyObject *)1) /* caught up: nothing to read */
/* `codes` (as_list only): the objects mode of get_obj_many: a list entry is
 * the payload alone, its codec in codes[i], or for a codec the core does not
 * decode a Frame (codes[i] = CODE_FRAME). */
#define CODE_FRAME 255
typedef struct {
    uint8_t *v;
    Py_ssize_t cap; /* grown as frames come: max may be far more than will be taken */
    int unpickle;   /* in-band pickles decoded here (a trusted queue), else left as Frames */
} Codes;
typedef const char *(*copy_fn)(void *ctx, const char *src, const FrameHeader *h);
typedef void (*drop_fn)(void *ctx);
int read_frame(Ring *r, uint64_t *seqp, uint64_t *posp, int verify, uint64_t *lost, FrameHeader *hout,
               uint64_t *known, copy_fn copy, drop_fn drop, void *ctx); /* Python-free on a sane ring */
/* Where a take puts each frame: copy its payload out, drop a torn copy, and
 * `taken(ctx, h)` once a copy passed the seqlock check (0, or -1: stop). */
typedef int (*taken_fn)(void *ctx, const FrameHeader *h);
typedef struct {
    copy_fn copy;
    drop_fn drop;
    taken_fn taken;
    void *ctx;
} Sink;
/* Python-free with a Python-free sink, on a sane ring (the TSan harness): */
Py_ssize_t private_take_frames(Cursor *c, Py_ssize_t max, const Sink *k);
Py_ssize_t group_take_locked(Cursor *c, Py_ssize_t max, const Sink *k, uint64_t *pos_out, uint64_t *lost_out);
int first_cursor(Ring *r, uint64_t *oseq, uint64_t *opos);
PyObject *read_one(Ring *r, uint64_t *seqp, uint64_t *posp, int verify, uint64_t *lost, FrameHeader *hout, int raw,
                   uint64_t *known);
void release_behind(Ring *r, uint64_t *released, uint64_t pos);
void cursor_finish(Cursor *c);
int group_lock(Cursor *c, double wait, uint64_t *word, uint64_t holder);
void flush_locked(Cursor *c);
void named_commit(Cursor *c);
int cursor_check(Cursor *c);
PyObject *cursor_take(Cursor *c, Py_ssize_t max, int as_list, double lock_wait, FrameHeader *rawh, Codes *codes);

/* ---- api.c ---- */
int parse_api(PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames, const char *const *names, int nnames,
              PyObject **out);
PyObject *Ring_put_api(Ring *r, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames);
PyObject *Ring_bind(Ring *r, PyObject *args);
PyObject *Ring_reduce(Ring *r, PyObject *ignored);
PyObject *Cursor_reduce(Cursor *c, PyObject *ignored);
PyObject *Cursor_get_api(Cursor *c, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames);
PyObject *Cursor_bind(Cursor *c, PyObject *args);
PyObject *Cursor_get_obj(Cursor *c, PyObject *unused);
PyObject *take_one(Cursor *c);
PyObject *dumps_inband(CoreState *st, PyObject *obj);

/* ---- cursor.c, lock.c, ring.c: the types' specs ---- */
extern PyType_Spec ring_spec, cursor_spec, lock_spec, waiting_spec, queue_port_spec;

/* ---- frame.c ---- */
void crc_init(void); /* once per process, before crc_update */
uint32_t crc_update(uint32_t crc, const unsigned char *p, size_t n);
PyObject *make_frame(CoreState *st, uint64_t seq, uint64_t ts, PyObject *data, int codec);
PyTypeObject *frame_type_new(void);

#endif
