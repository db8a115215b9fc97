/*
 * shmq._core: the ring's hot path in C (see docs/format.md, "The compiled core").
 *
 * This is the one place that knows the frame layout on the hot path:
 * writing and committing frames, reading them lock-free, group takes and
 * named-reader commits, the writer lock's fast path and eviction.  Python
 * (shmq/spool.py, shmq/reader.py) keeps the slow paths: creating and
 * validating files, lock recovery, fsck, dumps, statistics shaping and
 * blocking for frames or room.
 *
 * Thread and signal safety: every function here holds the GIL for the whole
 * time it holds the writer lock or a group lock, and never runs Python code
 * while holding one (the crash hook of the fault-injection harness aside).
 * Python signal handlers and other threads only run between bytecodes, so
 * a call is atomic for them: Ctrl-C can never leave a shared lock held.
 * The GIL is released only to wait for a lock that is not yet ours.
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
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <fcntl.h>
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

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23 /* Linux 5.14; older kernels refuse it (EINVAL): only a missed optimization */
#endif

/* ---- layout: mirrors shmq/_format.py (checked at import, see LAYOUT) ---- */
#define HEADER_BYTES 4096
#define FRAME_BYTES 32
#define ALIGN 8
#define W_NEXT_SEQ 16
#define W_NEXT_POS 17
#define W_FIRST_SEQ 40 /* off the writer's line (16..23): see FORMAT_VERSION in _format.py */
#define W_FIRST_POS 41
#define W_ALLOC_MIN 20 /* growable rings: the writer wraps early only past this offset */
#define W_ALLOC 21     /* growable rings: offsets at or above it have no pages */
#define W_LOCK_HOLDER 22
#define W_PUT_BYTES 26
#define W_LAST_PUT_NS 27
#define W_EVICTED 28
#define W_HIGH_FRAMES 29
#define W_HIGH_BYTES 30
#define W_SLOT_HWM 31
#define W_SEGMENT 34  /* growable spools: bytes allocated / released at a time (0: fixed) */
#define W_GROWTHS 35  /* segments allocated since creation */
#define W_HOLE_LO 36  /* growable rings: [HOLE_LO, HOLE_HI) below W_ALLOC may have no pages (trim) */
#define W_HOLE_HI 37
#define W_DATA_BELL 38  /* futex words: bumped by every doorbell ring (see ring_bell) */
#define W_SPACE_BELL 39
#define W_RATE 64
#define RATE_SECONDS 60
#define RATE_WORDS 3
#define DOORBELL_BYTE 4000
#define SLOT_BYTES 256
#define SLOT_WORDS 32
#define SLOT_FREE 0
#define SLOT_READER 1
#define SLOT_GROUP 2
#define SLOT_PIN 3
#define S_STATE 0
#define S_SEQ 1
#define S_POS 2
#define S_LOST 5
#define S_GETS 6
#define S_GET_BYTES 7
#define S_LAST_GET_NS 8
#define S_DELAY_SUM_NS 9
#define S_DELAY_MAX_NS 10
#define S_LAG_HIGH 11
#define S_LAG_LOW 12
#define S_LOCK_HOLDER 13
#define S_DELAY_COUNT 18 /* gets whose delay was measured (sampled: see sample_delay) */
#define FLAG_PAD 0x1
#define FLAG_CRC 0x4
#define CODEC_NUMPY 3
#define CODEC_PICKLE_OOB 6
#define STATS_FLUSH_FRAMES 64
#define MAX_COUNTER (1ull << 62)
#define RING_ADVICE "see 'shmq fsck'; to keep what is readable: 'shmq export --skip-corrupt', 'shmq rm', 'shmq import'"
#define MAX_BATCH 65536

/* status codes returned to Python instead of a seq / frame */
#define ST_LOCK_STUCK (-1) /* the lock was not free within lock_wait: Python checks the holder */
#define ST_NO_ROOM (-2)    /* block/error policy (or maxsize): no room now */
#define ST_SLOW (-3)       /* a zero-copy pin is in the way: Python's general path */
#define ST_TOO_LARGE (-4)  /* the frame or batch can never fit */
#define ST_NO_SPACE (-5)   /* a growable spool could not allocate its next segment (ENOSPC) */
#define ST_BACKLOG (-6)    /* max_backlog (a queue's maxsize) items wait: no room for items, not bytes */

typedef struct {
    uint64_t seq;
    uint32_t stored;
    uint32_t length;
    uint64_t ts;
    uint32_t crc;
    uint16_t flags;
    uint8_t codec;
    uint8_t ext;
} FrameHeader;

_Static_assert(sizeof(FrameHeader) == FRAME_BYTES, "frame header is 32 bytes");

static PyObject *SpoolFormatError = NULL; /* set by _core.setup() */
static PyObject *crash_hook = NULL;       /* fault-injection harness only */
static PyObject *pickle_loads = NULL;     /* for Cursor.get_obj */
static PyObject *notify_module = NULL;    /* shmq._notify: its SAFETY_NET_S caps park_take's sleeps */
static PyObject *EmptyError = NULL;       /* shmq.Empty, raised when a wait in C times out */
static PyObject *pickle_dumps = NULL;     /* for Ring.put_obj_api, with: */
static PyObject *dumps_protocol = NULL;   /*   shmq.codec.PROTOCOL */
static PyObject *dumps_kwnames = NULL;    /*   ("buffer_callback",) */
static PyObject *inband_callback = NULL;  /*   core_inband, as a callable */
static unsigned long buffers_seen = 0;    /* bumped by core_inband */
static PyObject *EMPTY = NULL, *STUCK = NULL, *UNDECODED = NULL; /* get_obj's sentinels */
static PyTypeObject *FrameType = NULL;

/* ---- atomics on words of the shared mapping ---- */
#define AW(p) ((_Atomic uint64_t *)(p))
static inline uint64_t ld_acq(uint64_t *p) { return atomic_load_explicit(AW(p), memory_order_acquire); }
static inline uint64_t ld_rlx(uint64_t *p) { return atomic_load_explicit(AW(p), memory_order_relaxed); }
static inline void st_rel(uint64_t *p, uint64_t v) { atomic_store_explicit(AW(p), v, memory_order_release); }
static inline void st_rlx(uint64_t *p, uint64_t v) { atomic_store_explicit(AW(p), v, memory_order_relaxed); }

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* ---- CRC-32 (IEEE 802.3, the same as zlib.crc32) ---- */
static uint32_t crc_table[256];
static void crc_init(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        crc_table[i] = c;
    }
}
static uint32_t crc_update(uint32_t crc, const unsigned char *p, size_t n) {
    crc = ~crc;
    while (n--) crc = crc_table[(crc ^ *p++) & 0xFF] ^ (crc >> 8);
    return ~crc;
}

/* ---- the Ring object: one spool mapping's hot path ---- */
typedef struct {
    PyObject_HEAD
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
    PyObject *owner; /* weak reference to the Python object whose slow path completes put_api */
    PyObject *qowner; /* weak reference to the shmq.Queue whose _put_slow completes put_obj_api */
    long long q_backlog; /* that queue's maxsize (-1: unbounded) */
    int fast_put;    /* 0: put_api always takes the slow path (sync=True) */
    PyObject *path;
    uint64_t pop_start, pop_pos; /* ring positions this process pre-faulted: [pop_start, pop_pos) */
    int pop_state;               /* 0 not started, 1 going, 2 done or unsupported */
} Ring;

static void ring_release(Ring *r);
static int *ring_busy(PyObject *ring) { return &((Ring *)ring)->busy; }

/* A close() that came while another thread was inside a GIL-released section
 * (busy) was deferred: the last one out finishes it. */
static void ring_finish(Ring *r) {
    if (r->closing && !r->busy) {
        r->closing = 0;
        ring_release(r);
    }
}

/* After a GIL-released wait on `s`: if the handle was closed meanwhile, give
 * back what we took (`held`: the semaphore was acquired), finish the deferred
 * close and raise.  1: closed (exception set); 0: carry on. */
static int ring_closed_meanwhile(PyObject *ring, int held, sem_t *s) {
    Ring *r = (Ring *)ring;
    if (!r->closing) return 0;
    if (held) sem_post(s);
    ring_finish(r);
    PyErr_SetString(PyExc_ValueError, "spool handle was closed by another thread");
    return 1;
}

typedef struct Reservation_ {
    PyObject_HEAD
    Ring *ring;
    uint64_t seq, off, nbytes, stored, end;
    int codec, open; /* open: the writer lock is held for us */
    unsigned long thread;
    PyObject *view;
} Reservation;

static PyObject *corrupt(Ring *r, const char *fmt, ...) {
    char msg[400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    PyErr_Format(SpoolFormatError ? SpoolFormatError : PyExc_RuntimeError, "%U: %s", r->path, msg);
    return NULL;
}

static int ring_check_open(Ring *r) {
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

struct Ring_;
static int ring_closed_meanwhile(PyObject *self_ring, int held, sem_t *s);

/* Wait for a POSIX semaphore for at most wait_s seconds, GIL released while
 * waiting.  0: acquired; 1: not within wait_s; -1: exception set (a signal
 * handler raised: nothing is held at that point).  `ring` (a Ring, or NULL)
 * is marked busy while the GIL is released, so that another thread closing
 * it meanwhile defers the release and this call fails cleanly instead of
 * touching an unmapped file. */
static int sem_lock_on(sem_t *s, double wait_s, PyObject *ring);
static int sem_lock(sem_t *s, double wait_s) { return sem_lock_on(s, wait_s, NULL); }
static int *ring_busy(PyObject *ring);

static int sem_lock_on(sem_t *s, double wait_s, PyObject *ring) {
    if (sem_trywait(s) == 0) return 0;
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
        if (ring) ++*ring_busy(ring);
        Py_BEGIN_ALLOW_THREADS
        rc = SEM_WAIT_UNTIL(s, &dl);
        err = errno;
        Py_END_ALLOW_THREADS
        if (ring) --*ring_busy(ring);
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

static inline void wlock_release(Ring *r) {
    st_rlx(&r->ctl[W_LOCK_HOLDER], 0);
    sem_post(r->wsem); /* a release operation: the holder word and all writes are visible first */
}

/* A growable ring whose zone spans more than TRIM_DUE_SEGS segments: a reader
 * that stays idle gives the consumed ones back (Spool.trim_due / trim_idle). */
#define TRIM_DUE_SEGS 4
static int trim_due(Ring *r) {
    uint64_t seg = ld_rlx(&r->ctl[W_SEGMENT]);
    return seg && ld_rlx(&r->ctl[W_ALLOC]) > TRIM_DUE_SEGS * seg;
}

static PyObject *Ring_trim_due(Ring *r, PyObject *unused) {
    if (ring_check_open(r) < 0) return NULL;
    return PyBool_FromLong(trim_due(r));
}

/* The 32-bit futex word of a doorbell: the low half of control word `word`
 * (little-endian: x86-64 and aarch64 Linux, the supported platforms). */
static inline _Atomic uint32_t *bell_word(Ring *r, int word) { return (_Atomic uint32_t *)&r->ctl[word]; }

/* Wake the other side if it has registered waiters.  The seq_cst fence
 * orders our publication before reading the waiter count (the Dekker pair
 * with the waiter's "register, then re-check").  Two wake-ups: the futex
 * word, which blocking calls sleep on (a futex wake is as quick as a
 * pipe's), then the doorbell byte, whose inotify event wakes asyncio
 * loops.  The word is bumped (release: after the publication) before the
 * wake, so a waiter that read it before re-checking either sees the bump
 * and does not sleep, or is asleep and woken. */
static void ring_bell(Ring *r, sem_t *waiters) {
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

static uint64_t slot_hwm(Ring *r) {
    uint64_t h = ld_rlx(&r->ctl[W_SLOT_HWM]);
    return h < r->slot_count ? h : r->slot_count; /* clamped: a corrupt word must not index past the table */
}

/* Minimum of slot word `word` over named readers and groups; returns 0 and
 * leaves *out alone when there are none. */
static int slot_floor(Ring *r, int word, uint64_t *out) {
    int found = 0;
    uint64_t h = slot_hwm(r), m = 0;
    for (uint64_t i = 0; i < h; i++) {
        uint64_t *s = r->slots + i * SLOT_WORDS;
        uint64_t st = ld_rlx(&s[S_STATE]);
        if (st == SLOT_READER || st == SLOT_GROUP) {
            uint64_t v = ld_acq(&s[word]);
            if (!found || v < m) m = v;
            found = 1;
        }
    }
    if (found) *out = m;
    return found;
}

static uint64_t pin_floor(Ring *r) {
    uint64_t h = slot_hwm(r), m = UINT64_MAX;
    for (uint64_t i = 0; i < h; i++) {
        uint64_t *s = r->slots + i * SLOT_WORDS;
        if (ld_rlx(&s[S_STATE]) == SLOT_PIN) {
            uint64_t v = ld_acq(&s[S_POS]);
            if (v < m) m = v;
        }
    }
    return m;
}

static void take_full_marker(Ring *r) {
    uint64_t f;
    if (!slot_floor(r, S_POS, &f)) f = ld_rlx(&r->ctl[W_FIRST_POS]);
    r->full_floor = f;
    r->full_pin = pin_floor(r);
}

static void record_high_water(Ring *r) {
    uint64_t *c = r->ctl;
    uint64_t frames = ld_rlx(&c[W_NEXT_SEQ]) - ld_rlx(&c[W_FIRST_SEQ]);
    uint64_t used = ld_rlx(&c[W_NEXT_POS]) - ld_rlx(&c[W_FIRST_POS]);
    if (frames > ld_rlx(&c[W_HIGH_FRAMES])) st_rlx(&c[W_HIGH_FRAMES], frames);
    if (used > ld_rlx(&c[W_HIGH_BYTES])) st_rlx(&c[W_HIGH_BYTES], used);
}

static int call_crash_hook(const char *point) {
    if (!crash_hook) return 0;
    PyObject *res = PyObject_CallFunction(crash_hook, "sO", point, Py_None);
    if (!res) return -1;
    Py_DECREF(res);
    return 0;
}

/* Store the new oldest frame (writer lock held), both words before any byte
 * below `pos` is overwritten.  While frames stay resident, the position goes
 * first: a writer killed in between leaves FIRST_POS at a real frame, whose
 * header recovery re-reads the seq from.  When everything is evicted, `pos` is
 * where the next batch goes and holds no header of this lap yet (an older
 * lap's frame may sit there and look valid): the seq goes first, so a writer
 * killed in between leaves FIRST_SEQ = NEXT_SEQ, which recovery reads as an
 * empty ring.  0, or -100 if the fault-injection hook raised. */
static int publish_first(uint64_t *c, uint64_t seq, uint64_t pos, uint64_t next_seq) {
    if (seq >= next_seq) {
        st_rel(&c[W_FIRST_SEQ], seq);
        if (call_crash_hook("evicting") < 0) return -100;
        st_rlx(&c[W_FIRST_POS], pos);
        atomic_thread_fence(memory_order_release); /* before any overwritten byte, as below */
        return 0;
    }
    st_rlx(&c[W_FIRST_POS], pos); /* position first: readers re-derive seq from its header */
    atomic_thread_fence(memory_order_release); /* ... and see it before any overwritten byte */
    if (call_crash_hook("evicting") < 0) return -100;
    st_rel(&c[W_FIRST_SEQ], seq);
    return 0;
}

/* Move FIRST_* past everything below byte position `limit` (writer lock
 * held).  Returns 0 on success, ST_NO_ROOM / ST_SLOW, or -100 with an
 * exception set.  Overwrite policy walks the evicted headers (a few loads
 * each); block/error jump in one step to the slowest named cursor. */
static int make_room(Ring *r, uint64_t limit, uint64_t next_seq, uint64_t batch_pos) {
    uint64_t *c = r->ctl, ring = r->ring_bytes;
    uint64_t pin = pin_floor(r);
    if (pin < limit) return ST_SLOW; /* a zero-copy view reads that frame */
    uint64_t seq = ld_rlx(&c[W_FIRST_SEQ]), pos = ld_rlx(&c[W_FIRST_POS]), start_seq = seq;
    uint64_t next_pos = ld_rlx(&c[W_NEXT_POS]);
    record_high_water(r);
    if (r->policy != 0) {
        uint64_t floor;
        if (!slot_floor(r, S_POS, &floor)) floor = pos; /* no consumers registered: keep everything */
        /* The jump below goes past `limit`, up to the slowest cursor: never past a
         * pinned frame (a reader moves its cursor on before it releases its view).
         * A pin is the header position of a resident data frame, >= limit here. */
        if (pin < floor) floor = pin;
        if (floor < limit && floor < next_pos) {
            take_full_marker(r);
            return ST_NO_ROOM; /* unconsumed frames in the way */
        }
        if (floor >= next_pos) {
            seq = next_seq; /* all consumed */
        } else if (floor > pos) {
            /* Jump to the slowest cursor: its header names its seq (a pad
             * carries the seq of the frame after it). */
            uint64_t off = floor % ring, p = floor;
            if (ring - off < FRAME_BYTES) {
                p += ring - off;
                off = 0;
            }
            FrameHeader h;
            read_header(r, off, &h);
            if (h.seq < seq || h.seq >= next_seq || !header_sane(&h, off, ring)) {
                corrupt(r, "reader cursor at position %llu does not point at a frame "
                        "(header says seq %llu); see 'shmq fsck'; to keep what is readable: 'shmq export --skip-corrupt', 'shmq rm', 'shmq import'",
                        (unsigned long long)floor, (unsigned long long)h.seq);
                return -100;
            }
            seq = h.seq;
            pos = floor;
            (void)p;
        }
        if (seq >= next_seq) pos = batch_pos;
        if (publish_first(c, seq, pos, next_seq) < 0) return -100;
        st_rlx(&c[W_EVICTED], ld_rlx(&c[W_EVICTED]) + (seq - start_seq));
        return 0;
    }
    uint64_t walk_start = pos;
    while (pos < limit && seq < next_seq) {
        uint64_t off = pos % ring;
        if (ring - off < FRAME_BYTES) {
            pos += ring - off;
            continue;
        }
        FrameHeader h;
        read_header(r, off, &h);
        /* A PAD fills the ring's tail exactly and never starts the ring, and no
         * walk of resident frames spans more than the ring: anything else is
         * corruption (and would otherwise spin on a self-repeating PAD). */
        if (h.seq != seq || !header_sane(&h, off, ring) ||
            ((h.flags & FLAG_PAD) && (off == 0 || off + h.stored != ring)) || pos + h.stored - walk_start > ring) {
            corrupt(r, "ring is corrupt at seq %llu (offset %llu: header says seq %llu, %u bytes); "
                    "see 'shmq fsck'; to keep what is readable: 'shmq export --skip-corrupt', 'shmq rm', 'shmq import'",
                    (unsigned long long)seq, (unsigned long long)off, (unsigned long long)h.seq, h.stored);
            return -100;
        }
        pos += h.stored;
        if (!(h.flags & FLAG_PAD)) seq++;
    }
    if (seq >= next_seq) pos = batch_pos; /* everything evicted: the ring restarts at this batch */
    if (publish_first(c, seq, pos, next_seq) < 0) return -100;
    st_rlx(&c[W_EVICTED], ld_rlx(&c[W_EVICTED]) + (seq - start_seq));
    return 0;
}

/* ---- growable rings: the hot zone ----
 *
 * A growable ring (W_SEGMENT != 0) is a sparse file.  The writer allocates
 * (fallocate) each segment of ring offsets before it writes in it, and pages
 * go back (PUNCH_HOLE) only where nothing resident lives:
 *  - the writer wraps early, back to offset 0, once it is past W_ALLOC_MIN and
 *    every named reader and group has consumed everything: no older frame can
 *    then be in its way on the next lap (so it never blocks before the
 *    ceiling), the pages above the wrap point go, and the next laps reuse the
 *    same pages, already mapped everywhere: the hot zone;
 *  - while consumers lag, it keeps climbing into fresh segments, up to the
 *    ring's end (the ceiling);
 *  - Spool.trim() (and a reader about to wait) punches all but the writer's
 *    current segment and the start allocation once nothing is resident.
 * Offsets below W_ALLOC and outside [W_HOLE_LO, W_HOLE_HI) have pages: W_ALLOC
 * is raised after allocating and lowered (or the hole widened) before
 * punching.  A full filesystem gives ST_NO_SPACE before anything is evicted
 * or written, and records nothing: never SIGBUS. */

static int zone_syscall(Ring *r, uint64_t a, uint64_t b, int punch) {
    int rc, err = 0;
    int mode = punch ? FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE : 0;
    r->busy++; /* a close() meanwhile is deferred: our fd and mapping stay valid */
    Py_BEGIN_ALLOW_THREADS
    rc = fallocate(r->fd, mode, (off_t)(r->ring_offset + a), (off_t)(b - a));
    if (rc < 0) err = errno;
    /* Map the pages into our page table in one call (the writer is about to
     * touch them): one fault per page would cost more than the copy. */
    else if (!punch) (void)madvise(r->ring + a, (size_t)(b - a), MADV_POPULATE_WRITE);
    Py_END_ALLOW_THREADS
    r->busy--;
    if (r->closing) return ECANCELED;
    return rc < 0 ? err : 0;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static uint64_t mono_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts); /* vDSO: no syscall */
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
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
#define WRAP_SLACK_SEGS 4 /* segments kept above an early wrap's point (see zone_place) */
#define CATCH_UP_STALL_NS 50000ull
static int wait_caught_up(Ring *r, uint64_t start, uint64_t lag, uint64_t lap_share) {
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

static int zone_status(Ring *r, int err) {
    if (!err || err == EOPNOTSUPP) return 0; /* no fallocate here: pages come on first touch */
    if (err == ECANCELED) {
        PyErr_SetString(PyExc_ValueError, "spool handle was closed by another thread");
        return -100;
    }
    if (err == ENOSPC || err == EFBIG || err == EDQUOT) return ST_NO_SPACE;
    errno = err;
    PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, r->path);
    return -100;
}

/* Allocate the segments holding ring offsets [a, b) (writer lock held). */
static int zone_alloc(Ring *r, uint64_t a, uint64_t b) {
    uint64_t seg = r->segment, ring = r->ring_bytes, *c = r->ctl;
    a = a / seg * seg;
    b = (b + seg - 1) / seg * seg;
    if (b > ring) b = ring;
    uint64_t z = ld_rlx(&c[W_ALLOC]), hl0 = ld_rlx(&c[W_HOLE_LO]), hh0 = ld_rlx(&c[W_HOLE_HI]);
    /* [a, ALLOC) has pages unless the hole cuts into it: start at ALLOC then (a
     * batch entering the next segment would otherwise fallocate and populate its
     * current one again, doubling what each growth costs). */
    if (a < z && !(hl0 < hh0 && a < hh0 && b > hl0)) a = z;
    if (a >= b) return 0;
    if (call_crash_hook("allocating") < 0) return -100;
    int st = zone_status(r, zone_syscall(r, a, b, 0));
    if (st) return st; /* (nothing recorded: a retry allocates again) */
    /* Recorded once the pages exist: a writer killed in between leaves pages above
     * W_ALLOC, which the next trim (it punches to the ring's end) gives back. */
    if (b > z) {
        st_rlx(&c[W_ALLOC], b);
        st_rlx(&c[W_GROWTHS], ld_rlx(&c[W_GROWTHS]) + (b - z + seg - 1) / seg);
    }
    uint64_t hl = ld_rlx(&c[W_HOLE_LO]), hh = ld_rlx(&c[W_HOLE_HI]); /* the hole shrinks: after */
    if (a <= hl && b > hl) st_rlx(&c[W_HOLE_LO], b < hh ? b : hh);
    else if (a < hh && b >= hh) st_rlx(&c[W_HOLE_HI], a > hl ? a : hl);
    return 0;
}

/* Punch out the whole segments within ring offsets [a, b), where nothing is
 * resident (writer lock held).  A lock-free reader still copying a frame
 * evicted there reads zeros (and fails its seqlock check) or faults one page
 * back in, released by the next punch. */
static int zone_punch(Ring *r, uint64_t a, uint64_t b) {
    uint64_t seg = r->segment, ring = r->ring_bytes, *c = r->ctl;
    a = (a + seg - 1) / seg * seg;
    b = b >= ring ? ring : b / seg * seg;
    if (a >= b) return 0;
    uint64_t z = ld_rlx(&c[W_ALLOC]);
    if (b >= z) {
        if (a < z) st_rlx(&c[W_ALLOC], a);
    } else { /* a hole below the zone's top (trim): the hole words cover it first */
        uint64_t hl = ld_rlx(&c[W_HOLE_LO]), hh = ld_rlx(&c[W_HOLE_HI]);
        if (hl >= hh) hl = a, hh = b;
        st_rlx(&c[W_HOLE_LO], a < hl ? a : hl);
        st_rlx(&c[W_HOLE_HI], b > hh ? b : hh);
    }
    if (call_crash_hook("releasing") < 0) return -100;
    int st = zone_status(r, zone_syscall(r, a, b, 1));
    return st == ST_NO_SPACE ? 0 : st;
}

/* A growable ring, after the normal placement of a batch starting at `start`
 * (writer lock held): wrap early if everything is consumed, then allocate the
 * segments the batch enters.  May rewrite the placement.  0, ST_NO_SPACE or
 * -100 (exception set); nothing is evicted unless it returns 0. */
static int zone_place(Ring *r, uint64_t start, Py_ssize_t count, const uint64_t *needs, uint64_t total,
                      uint64_t *placed, int *npads, uint64_t *pads_off, uint64_t *pads_gap, Py_ssize_t *pads_k,
                      uint64_t *end, uint64_t next_seq) {
    uint64_t ring = r->ring_bytes, seg = r->segment, n_off = start % ring, lap = start - n_off;
    uint64_t top = n_off, low = 0; /* offsets touched: [n_off, top) this lap, [0, low) the next */
    for (Py_ssize_t k = 0; k < count; k++) {
        if (placed[k] < lap + ring) {
            if (placed[k] - lap + needs[k] > top) top = placed[k] - lap + needs[k];
        } else if (placed[k] - lap - ring + needs[k] > low) {
            low = placed[k] - lap - ring + needs[k];
        }
    }
    for (int p = 0; p < *npads; p++) {
        if (p == 0 && pads_off[p] >= n_off) {
            if (pads_off[p] + FRAME_BYTES > top) top = pads_off[p] + FRAME_BYTES;
        } else if (pads_off[p] + FRAME_BYTES > low) {
            low = pads_off[p] + FRAME_BYTES;
        }
    }
    uint64_t *c = r->ctl, z = ld_rlx(&c[W_ALLOC]), hl = ld_rlx(&c[W_HOLE_LO]), hh = ld_rlx(&c[W_HOLE_HI]);
    /* Offsets below W_ALLOC and outside the hole have pages. */
    int need = top > z || low > z || (hl < hh && ((n_off < hh && top > hl) || (low && low > hl)));
    /* The early wrap is tried when the writer enters a new segment (a few loads per segment). */
    int entering = n_off % seg == 0 || (top - 1) / seg != n_off / seg || low;
    if (!r->lap_ns) r->lap_ns = mono_ns(); /* this handle's first lap starts with its first write */
    if (!need && !entering) return 0;
    uint64_t gap = ring - n_off;
    if (entering && r->policy != 0 && n_off && n_off >= ld_rlx(&c[W_ALLOC_MIN]) && total <= n_off &&
        gap >= FRAME_BYTES && gap <= 0xFFFFFFF8ull) {
        uint64_t floor = 0;
        int found = slot_floor(r, S_POS, &floor), caught = found && floor >= start;
        if (found && !caught && need && start - floor <= 2 * seg) {
            if (call_crash_hook("catching-up") < 0) return -100;
            uint64_t now = mono_ns(), lap = now > r->lap_ns ? now - r->lap_ns : 0;
            int w = wait_caught_up(r, start, start - floor, lap / 16); /* cheaper than fresh pages */
            if (w == ECANCELED) return zone_status(r, ECANCELED);
            caught = w;
        }
        if (caught) { /* every consumer is caught up */
            if (total > z || (hl < hh && total > hl)) { /* first: a full filesystem evicts nothing */
                int st = zone_alloc(r, 0, total);
                if (st) return st;
            }
            int st = make_room(r, lap + total, next_seq, lap + ring); /* evicts all: FIRST_POS = lap + ring */
            if (st == -100) return -100;
            if (st == 0) {
                r->lap_ns = mono_ns(); /* a new lap of the hot zone */
                *npads = 1;
                pads_off[0] = n_off;
                pads_gap[0] = gap;
                pads_k[0] = 0;
                uint64_t p = lap + ring;
                for (Py_ssize_t k = 0; k < count; k++) {
                    placed[k] = p;
                    p += needs[k];
                }
                *end = p;
                /* All above the pad is dead: give back what the zone holds there,
                 * but for WRAP_SLACK_SEGS segments above the wrap point: laps end at
                 * varying segments (wherever the consumers happened to be caught
                 * up), and punching right above each would make the next longer lap
                 * allocate fresh pages again.  Only up to ALLOC: a punch to the
                 * ring's end would walk gigabytes of holes each time. */
                return zone_punch(r, n_off + FRAME_BYTES + WRAP_SLACK_SEGS * seg, ld_rlx(&r->ctl[W_ALLOC]));
            } /* a pin holds a frame: no early wrap this time */
        }
    }
    if (!need) return 0;
    int st = top > n_off ? zone_alloc(r, n_off, top) : 0;
    if (st == 0 && low) st = zone_alloc(r, 0, low);
    return st;
}

static void roll_rate(Ring *r, uint64_t ts) {
    uint64_t sec = ts / 1000000000ull;
    int b = W_RATE + (int)(sec % RATE_SECONDS) * RATE_WORDS;
    r->rate_word = b + 1;
    r->rate_until = (sec + 1) * 1000000000ull;
    if (ld_rlx(&r->ctl[b]) != sec) {
        st_rlx(&r->ctl[b], sec);
        st_rlx(&r->ctl[b + 1], 0);
        st_rlx(&r->ctl[b + 2], 0);
    }
}

/* One item of a batch: up to a few segments written one after the other. */
#define MAX_SEGS 64
typedef struct {
    Py_buffer views[MAX_SEGS];
    int nviews;
    uint64_t n;
    uint32_t crc;
} Item;

static int get_segment(PyObject *o, Py_buffer *v) {
    if (PyUnicode_Check(o)) {
        PyErr_SetString(PyExc_TypeError, "frames are bytes-like objects, not str: encode it first (e.g. s.encode())");
        return -1;
    }
    if (PyObject_GetBuffer(o, v, PyBUF_C_CONTIGUOUS) == 0) return 0;
    if (PyErr_ExceptionMatches(PyExc_BufferError) || PyErr_ExceptionMatches(PyExc_ValueError)) {
        Py_buffer probe;
        PyErr_Clear();
        if (PyObject_GetBuffer(o, &probe, PyBUF_STRIDES) == 0) {
            PyBuffer_Release(&probe);
            PyErr_SetString(PyExc_ValueError, "frame buffer must be C-contiguous");
            return -1;
        }
        PyErr_Clear();
    } else if (!PyErr_ExceptionMatches(PyExc_TypeError)) {
        return -1;
    }
    PyErr_Clear();
    PyErr_Format(PyExc_TypeError, "frames are bytes-like objects, not %.100s", Py_TYPE(o)->tp_name);
    return -1;
}

static void release_items(Item *items, Py_ssize_t k) {
    for (Py_ssize_t i = 0; i < k; i++)
        for (int j = 0; j < items[i].nviews; j++) PyBuffer_Release(&items[i].views[j]);
}

static int load_item(Item *it, PyObject *o, int checksum) {
    it->nviews = 0;
    it->n = 0;
    it->crc = 0;
    if (PyTuple_CheckExact(o)) {
        Py_ssize_t k = PyTuple_GET_SIZE(o);
        if (k > MAX_SEGS) {
            PyErr_Format(PyExc_ValueError, "a frame has at most %d segments", MAX_SEGS);
            return -1;
        }
        for (Py_ssize_t j = 0; j < k; j++) {
            if (get_segment(PyTuple_GET_ITEM(o, j), &it->views[j]) < 0) {
                for (int q = 0; q < it->nviews; q++) PyBuffer_Release(&it->views[q]);
                it->nviews = 0;
                return -1;
            }
            it->nviews++;
            it->n += (uint64_t)it->views[j].len;
        }
    } else {
        if (get_segment(o, &it->views[0]) < 0) return -1;
        it->nviews = 1;
        it->n = (uint64_t)it->views[0].len;
    }
    if (checksum) {
        uint32_t crc = 0;
        for (int j = 0; j < it->nviews; j++) crc = crc_update(crc, it->views[j].buf, (size_t)it->views[j].len);
        it->crc = crc;
    }
    return 0;
}

/* Place, write and publish a batch (writer lock held).  Returns the first
 * seq, or a negative status (-100: exception set). */
static int64_t write_locked(Ring *r, Item *items, Py_ssize_t count, uint64_t *needs, uint64_t total,
                            int codec, int64_t max_backlog, uint64_t *placed) {
    uint64_t *c = r->ctl, ring = r->ring_bytes;
    uint64_t seq0 = ld_rlx(&c[W_NEXT_SEQ]), start = ld_rlx(&c[W_NEXT_POS]);
    if (max_backlog >= 0) {
        uint64_t floor;
        if (slot_floor(r, S_SEQ, &floor) && seq0 - floor + (uint64_t)count > (uint64_t)max_backlog) {
            take_full_marker(r);
            return ST_BACKLOG;
        }
    }
    /* Placement: a frame that does not fit before the ring's end is preceded
     * by padding to the end (a PAD header if 32+ bytes remain). */
    uint64_t pos = start, pad_off = 0, pad_gap = 0;
    Py_ssize_t pad_k = -1;
    int npads = 0;
    uint64_t pads_off[2], pads_gap[2];
    Py_ssize_t pads_k[2];
    int restart = 0;
    for (Py_ssize_t k = 0; k < count; k++) {
        uint64_t off = pos % ring;
        if (ring - off < needs[k]) {
            if (npads == 2) { restart = 1; break; } /* wraps more than once: start at the ring's start */
            if (ring - off >= FRAME_BYTES) {
                pads_off[npads] = off;
                pads_gap[npads] = ring - off;
                pads_k[npads] = k;
                npads++;
            }
            pos += ring - off;
        }
        placed[k] = pos;
        pos += needs[k];
    }
    if (restart || pos - placed[0] > ring) {
        /* The batch would wrap onto itself: start it at the ring's start. */
        pos = start;
        uint64_t off = pos % ring;
        npads = 0;
        if (off && ring - off >= FRAME_BYTES) {
            pads_off[0] = off;
            pads_gap[0] = ring - off;
            pads_k[0] = 0;
            npads = 1;
        }
        if (off) pos += ring - off;
        for (Py_ssize_t k = 0; k < count; k++) {
            placed[k] = pos;
            pos += needs[k];
        }
    }
    (void)pad_off; (void)pad_gap; (void)pad_k;
    uint64_t end = pos;
    if (r->segment) { /* a growable ring: its pages first (may wrap early) */
        int st = zone_place(r, start, count, needs, total, placed, &npads, pads_off, pads_gap, pads_k, &end, seq0);
        if (st != 0) return st;
    }
    if (end - ld_rlx(&c[W_FIRST_POS]) > ring) {
        int st = make_room(r, end - ring, seq0, placed[0]);
        if (st != 0) return st;
    }
    uint64_t ts = now_ns();
    for (int p = 0; p < npads; p++) {
        FrameHeader h = {seq0 + (uint64_t)pads_k[p], (uint32_t)pads_gap[p], 0, ts, 0, FLAG_PAD, 0, 0};
        memcpy(r->ring + pads_off[p], &h, FRAME_BYTES);
    }
    uint64_t nbytes = 0, seq = seq0;
    uint16_t flags = r->checksum ? FLAG_CRC : 0;
    for (Py_ssize_t k = 0; k < count; k++) {
        uint64_t off = placed[k] % ring;
        FrameHeader h = {seq, (uint32_t)needs[k], (uint32_t)items[k].n, ts, items[k].crc, flags, (uint8_t)codec, 0};
        memcpy(r->ring + off, &h, FRAME_BYTES);
        char *dst = r->ring + off + FRAME_BYTES;
        for (int j = 0; j < items[k].nviews; j++) {
            memcpy(dst, items[k].views[j].buf, (size_t)items[k].views[j].len);
            dst += items[k].views[j].len;
        }
        uint64_t pad = needs[k] - FRAME_BYTES - items[k].n;
        if (pad) memset(dst, 0, (size_t)pad);
        seq++;
        nbytes += items[k].n;
        if (crash_hook && count > 1 && call_crash_hook("frame-written") < 0) return -100;
    }
    st_rel(&c[W_NEXT_SEQ], seq); /* <- the commit point */
    if (crash_hook && count > 1 && call_crash_hook("committed") < 0) return -100;
    st_rlx(&c[W_NEXT_POS], end);
    /* statistics, exact under the lock: puts are next_seq itself */
    st_rlx(&c[W_PUT_BYTES], ld_rlx(&c[W_PUT_BYTES]) + nbytes);
    st_rlx(&c[W_LAST_PUT_NS], ts);
    if (ts >= r->rate_until) roll_rate(r, ts);
    st_rlx(&c[r->rate_word], ld_rlx(&c[r->rate_word]) + (uint64_t)count);
    return (int64_t)seq0;
}


/* Pre-fault the ring ahead of this process's writes, for its first lap.
 * A process that starts writing into an existing ring (a new producer, a
 * Spark task) otherwise takes a write fault per 4 KiB page for a whole lap,
 * and short-lived producers never leave that lap: on a wrapped 64 MiB ring,
 * 100 B frames, 4.4-4.8 -> 6.7-6.8 M frames/s with the pages populated.
 * MADV_POPULATE_WRITE (Linux 5.14) maps a chunk's pages in one call instead
 * of one fault each; on older kernels (EINVAL) it is not tried again.  Fixed
 * rings only: a growable ring's pages past its zone or in a trimmed hole must
 * not be allocated behind the writer's bookkeeping.  Failures cost nothing
 * but the faults the writes then take. */
#define POPULATE_CHUNK (256u << 10)
static void populate_ahead(Ring *r, uint64_t pos, uint64_t len) {
    if (r->pop_state == 2 || r->segment) return;
    uint64_t ring = r->ring_bytes, page = 4096;
    if (r->pop_state == 0 || pos > r->pop_pos) { /* first write, or written past: restart at pos */
        if (r->pop_state == 0) r->pop_start = pos & ~(page - 1);
        r->pop_pos = pos & ~(page - 1);
        r->pop_state = 1;
    }
    uint64_t want = pos + len + POPULATE_CHUNK;
    while (r->pop_pos < want) {
        if (r->pop_pos - r->pop_start >= ring) { /* a whole lap is mapped in this process */
            r->pop_state = 2;
            return;
        }
        uint64_t off = r->pop_pos % ring, n = POPULATE_CHUNK;
        if (n > ring - off) n = ring - off;
        if (madvise(r->ring + off, n, MADV_POPULATE_WRITE) != 0) {
            r->pop_state = 2;
            return;
        }
        r->pop_pos += n;
    }
}

/* Ask for the lines the next puts will write, for writing, while this one
 * returns.  On a ring that has wrapped they were last touched a lap ago (out
 * of cache: on a 64 MiB ring every store missed to memory, 3.3 against 6.2 M
 * frames/s with the prefetch); on a fresh one the page fault that zeroed them
 * warmed them anyway.  Only into free space ([NEXT_POS, FIRST_POS + ring),
 * evicted frames): when the ring is full those lines are the ones a reader is
 * about to read, and taking them exclusive made it refetch each one (a 1 MiB
 * full ring: 7.7 -> 4.1 M/s). */
#define PREFETCH_FROM 256
#define PREFETCH_TO 512
static void prefetch_ahead(Ring *r, uint64_t next) {
    uint64_t ring = r->ring_bytes, first = ld_rlx(&r->ctl[W_FIRST_POS]);
    if (first + ring < next + PREFETCH_TO + 4096) return; /* little free space: a reader is near */
    uint64_t off = next % ring;
    for (uint64_t k = PREFETCH_FROM; k < PREFETCH_TO && off + k < ring; k += 64)
        __builtin_prefetch(r->ring + off + k, 1, 3);
}

/* Headroom before evicting (block policy, a blocking put: `patient`).  A
 * producer faster than its consumers keeps the ring full: each put then
 * evicts the one or two frames the reader has just committed and writes
 * into the lines right behind the one the reader is reading, so the two
 * processes take those lines, the oldest-frame words and the reader's slot
 * from each other about every 10 frames (the 1 MiB wrapped benchmark row
 * ran at 88% of an unwrapped ring).  Waiting, GIL held, until consumers
 * have freed ROOM_HEADROOM bytes (an eighth of a small ring), at most
 * ROOM_WAIT_NS, lets the writer then put a burst while the reader reads
 * elsewhere: +7-8% on that row in an interleaved A/B, fresh rings
 * unchanged.  Never longer than ROOM_WAIT_NS: a consumer that stops leaves
 * the room it freed usable, as before. */
#define ROOM_HEADROOM (16u << 10)
#define ROOM_WAIT_NS 20000ull
static void wait_for_headroom(Ring *r, uint64_t total) {
    uint64_t ring = r->ring_bytes, nxt = ld_rlx(&r->ctl[W_NEXT_POS]), f;
    if (r->segment || nxt + total - ld_rlx(&r->ctl[W_FIRST_POS]) <= ring) return; /* room without evicting */
    uint64_t want = nxt + total + (ring / 8 < ROOM_HEADROOM ? ring / 8 : ROOM_HEADROOM), t0 = mono_ns();
    while (slot_floor(r, S_POS, &f) && f < nxt && f + ring < want && mono_ns() - t0 < ROOM_WAIT_NS)
        for (int k = 0; k < 64; k++) cpu_relax(); /* poll the consumers' slots sparingly: they store there */
}

static int64_t ring_write(Ring *r, Item *items, Py_ssize_t count, int codec, int64_t max_backlog, double lock_wait,
                          int patient) {
    if (r->reserved_by && r->reserved_by->thread == PyThread_get_thread_ident()) {
        PyErr_SetString(PyExc_RuntimeError, "put inside an open reservation of the same spool in the same "
                                            "thread would deadlock: commit or abandon it first");
        return -100;
    }
    uint64_t stack_needs[64], stack_placed[64];
    uint64_t *needs = stack_needs, *placed = stack_placed;
    if (count > 64) {
        needs = PyMem_Malloc(sizeof(uint64_t) * 2 * (size_t)count);
        if (!needs) {
            PyErr_NoMemory();
            return -100;
        }
        placed = needs + count;
    }
    int64_t res;
    uint64_t total = 0;
    for (Py_ssize_t k = 0; k < count; k++) {
        if (items[k].n > r->max_payload) {
            res = ST_TOO_LARGE;
            goto out;
        }
        needs[k] = FRAME_BYTES + ((items[k].n + 7) & ~(uint64_t)7);
        total += needs[k];
    }
    if (total > r->ring_bytes || (max_backlog >= 0 && count > max_backlog)) {
        res = ST_TOO_LARGE;
        goto out;
    }
    if (patient && r->policy == 1) wait_for_headroom(r, total);
    int lk = sem_lock_on(r->wsem, lock_wait, (PyObject *)r);
    if (lk != 0) {
        res = lk > 0 ? ST_LOCK_STUCK : -100;
        goto out;
    }
    st_rlx(&r->ctl[W_LOCK_HOLDER], r->holder);
    res = write_locked(r, items, count, needs, total, codec, max_backlog, placed);
    wlock_release(r);
    if (res >= 0) {
        ring_bell(r, r->rsem);
        uint64_t next = ld_rlx(&r->ctl[W_NEXT_POS]);
        populate_ahead(r, next, total);
        prefetch_ahead(r, next);
    }
    ring_finish(r);
out:
    if (needs != stack_needs) PyMem_Free(needs);
    return res;
}

/* ---- reservations: zero-copy writes ---- */


static PyTypeObject ReservationType;

static void reservation_unlock(Reservation *rv) {
    Ring *r = rv->ring;
    rv->open = 0;
    if (r->reserved_by == rv) r->reserved_by = NULL;
    if (r->have_buf) wlock_release(r);
}

static void reservation_drop_view(Reservation *rv) {
    if (rv->view) {
        PyObject *res = PyObject_CallMethod(rv->view, "release", NULL);
        if (!res) PyErr_Clear(); /* a derived view still exports it: documented as invalid now */
        Py_XDECREF(res);
        Py_CLEAR(rv->view);
    }
}

static PyObject *Reservation_commit(Reservation *rv, PyObject *unused) {
    if (!rv->open) {
        PyErr_SetString(PyExc_ValueError, "the reservation is closed (committed or abandoned)");
        return NULL;
    }
    Ring *r = rv->ring;
    if (!r->have_buf) {
        rv->open = 0;
        PyErr_SetString(PyExc_ValueError, "spool handle is closed");
        return NULL;
    }
    reservation_drop_view(rv);
    uint64_t *c = r->ctl;
    char *payload = r->ring + rv->off + FRAME_BYTES;
    uint64_t pad = rv->stored - FRAME_BYTES - rv->nbytes;
    if (pad) memset(payload + rv->nbytes, 0, (size_t)pad);
    uint64_t ts = now_ns();
    FrameHeader h = {rv->seq, (uint32_t)rv->stored, (uint32_t)rv->nbytes, ts, 0, 0, (uint8_t)rv->codec, 0};
    if (r->checksum) {
        h.crc = crc_update(0, (const unsigned char *)payload, (size_t)rv->nbytes);
        h.flags = FLAG_CRC;
    }
    memcpy(r->ring + rv->off, &h, FRAME_BYTES);
    st_rel(&c[W_NEXT_SEQ], rv->seq + 1); /* <- the commit point */
    st_rlx(&c[W_NEXT_POS], rv->end);
    st_rlx(&c[W_PUT_BYTES], ld_rlx(&c[W_PUT_BYTES]) + rv->nbytes);
    st_rlx(&c[W_LAST_PUT_NS], ts);
    if (ts >= r->rate_until) roll_rate(r, ts);
    st_rlx(&c[r->rate_word], ld_rlx(&c[r->rate_word]) + 1);
    reservation_unlock(rv);
    ring_bell(r, r->rsem);
    return PyLong_FromUnsignedLongLong(rv->seq);
}

static PyObject *Reservation_abandon(Reservation *rv, PyObject *unused) {
    if (rv->open) {
        reservation_drop_view(rv);
        reservation_unlock(rv); /* nothing was published: the space is reused by the next write */
    }
    Py_RETURN_NONE;
}

static PyObject *Reservation_enter(Reservation *rv, PyObject *unused) {
    if (!rv->open) {
        PyErr_SetString(PyExc_ValueError, "the reservation is closed (committed or abandoned)");
        return NULL;
    }
    if (!rv->view) {
        /* A slice of a view over the mmap object itself: the mapping knows it
         * is exported, so closing the spool cannot unmap it under the view. */
        Ring *r = rv->ring;
        if (ring_check_open(r) < 0) return NULL;
        PyObject *mv = PyMemoryView_FromObject(r->buf.obj);
        if (!mv) return NULL;
        Py_ssize_t a = (Py_ssize_t)(r->ring - r->base + rv->off + FRAME_BYTES);
        PyObject *lo = PyLong_FromSsize_t(a), *hi = PyLong_FromSsize_t(a + (Py_ssize_t)rv->nbytes);
        PyObject *sl = lo && hi ? PySlice_New(lo, hi, NULL) : NULL;
        Py_XDECREF(lo);
        Py_XDECREF(hi);
        if (!sl) {
            Py_DECREF(mv);
            return NULL;
        }
        rv->view = PyObject_GetItem(mv, sl);
        Py_DECREF(sl);
        Py_DECREF(mv);
        if (!rv->view) return NULL;
    }
    return Py_NewRef(rv->view);
}

static PyObject *Reservation_exit(Reservation *rv, PyObject *args) {
    PyObject *et = Py_None;
    if (PyTuple_GET_SIZE(args) > 0) et = PyTuple_GET_ITEM(args, 0);
    if (et != Py_None) return Reservation_abandon(rv, NULL), Py_NewRef(Py_False);
    PyObject *seq = Reservation_commit(rv, NULL);
    if (!seq) return NULL;
    Py_DECREF(seq);
    Py_RETURN_FALSE;
}

static void Reservation_dealloc(Reservation *rv) {
    if (rv->open) reservation_unlock(rv); /* dropped without commit: abandoned */
    Py_XDECREF(rv->view);
    Py_XDECREF(rv->ring);
    Py_TYPE(rv)->tp_free((PyObject *)rv);
}

static PyObject *Reservation_get_seq(Reservation *rv, void *x) { return PyLong_FromUnsignedLongLong(rv->seq); }
static PyObject *Reservation_get_nbytes(Reservation *rv, void *x) { return PyLong_FromUnsignedLongLong(rv->nbytes); }
static PyObject *Reservation_get_open(Reservation *rv, void *x) { return PyBool_FromLong(rv->open); }

static PyGetSetDef Reservation_getset[] = {
    {"seq", (getter)Reservation_get_seq, NULL, "the seq the frame gets when committed", NULL},
    {"nbytes", (getter)Reservation_get_nbytes, NULL, "payload size", NULL},
    {"open", (getter)Reservation_get_open, NULL, "True until committed or abandoned", NULL},
    {NULL}};

static PyMethodDef Reservation_methods[] = {
    {"commit", (PyCFunction)Reservation_commit, METH_NOARGS, "publish the frame; return its seq"},
    {"abandon", (PyCFunction)Reservation_abandon, METH_NOARGS, "release the space without publishing anything"},
    {"__enter__", (PyCFunction)Reservation_enter, METH_NOARGS, "a writable memoryview of the payload"},
    {"__exit__", (PyCFunction)Reservation_exit, METH_VARARGS, "commit on a clean exit, abandon on an exception"},
    {NULL}};

static PyTypeObject ReservationType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "shmq.Reservation",
    .tp_basicsize = sizeof(Reservation),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_dealloc = (destructor)Reservation_dealloc,
    .tp_methods = Reservation_methods,
    .tp_getset = Reservation_getset,
    .tp_doc = "Room for one frame, written in place: `with sp.reserve(n) as buf: buf[:] = ...` commits on a\n"
              "clean exit and abandons on an exception; a process killed inside exposes nothing.\n"
              "The writer lock is held while it is open: keep the block short.",
};

static PyObject *Ring_reserve(Ring *r, PyObject *args) {
    /* reserve(nbytes, codec, lock_wait) -> Reservation, or a negative status */
    unsigned long long nbytes;
    int codec;
    double wait;
    if (!PyArg_ParseTuple(args, "Kid", &nbytes, &codec, &wait)) return NULL;
    if (ring_check_open(r) < 0) return NULL;
    if (r->reserved_by && r->reserved_by->thread == PyThread_get_thread_ident()) {
        PyErr_SetString(PyExc_RuntimeError, "this thread already holds an open reservation of this spool: "
                                            "commit or abandon it first (it holds the writer lock)");
        return NULL;
    }
    if (nbytes > r->max_payload) return PyLong_FromLong(ST_TOO_LARGE);
    uint64_t need = FRAME_BYTES + ((nbytes + 7) & ~(uint64_t)7);
    int lk = sem_lock_on(r->wsem, wait, (PyObject *)r);
    if (lk < 0) return NULL;
    if (lk > 0) return PyLong_FromLong(ST_LOCK_STUCK);
    st_rlx(&r->ctl[W_LOCK_HOLDER], r->holder);
    uint64_t *c = r->ctl, ring = r->ring_bytes;
    uint64_t seq = ld_rlx(&c[W_NEXT_SEQ]), pos = ld_rlx(&c[W_NEXT_POS]);
    uint64_t off = pos % ring, pad_off = 0, pad_gap = 0;
    int has_pad = 0;
    if (ring - off < need) {
        if (ring - off >= FRAME_BYTES) {
            has_pad = 1;
            pad_off = off;
            pad_gap = ring - off;
        }
        pos += ring - off;
    }
    uint64_t end = pos + need;
    if (r->segment) { /* a growable ring: its pages first (may wrap early) */
        uint64_t placed1 = pos, poff[1] = {pad_off}, pgap[1] = {pad_gap};
        Py_ssize_t pk[1] = {0};
        int npads = has_pad;
        int st = zone_place(r, ld_rlx(&c[W_NEXT_POS]), 1, &need, need, &placed1, &npads, poff, pgap, pk, &end, seq);
        if (st != 0) {
            wlock_release(r);
            ring_finish(r);
            if (st == -100) return NULL;
            return PyLong_FromLong(st);
        }
        pos = placed1;
        has_pad = npads;
        pad_off = poff[0];
        pad_gap = pgap[0];
    }
    if (end - ld_rlx(&c[W_FIRST_POS]) > ring) {
        int st = make_room(r, end - ring, seq, pos);
        if (st != 0) {
            wlock_release(r);
            if (st == -100) return NULL;
            return PyLong_FromLong(st);
        }
    }
    if (has_pad) {
        FrameHeader h = {seq, (uint32_t)pad_gap, 0, now_ns(), 0, FLAG_PAD, 0, 0};
        memcpy(r->ring + pad_off, &h, FRAME_BYTES);
    }
    populate_ahead(r, pos, need); /* the caller writes the payload in place: no fault per page */
    /* A header that is not frame `seq` yet: nothing past NEXT_SEQ is read, and
     * recovery after a kill re-derives NEXT_POS from committed frames only. */
    memset(r->ring + pos % ring, 0, FRAME_BYTES);
    Reservation *rv = PyObject_New(Reservation, &ReservationType);
    if (!rv) {
        wlock_release(r);
        return NULL;
    }
    rv->ring = (Ring *)Py_NewRef((PyObject *)r);
    rv->seq = seq;
    rv->off = pos % ring;
    rv->nbytes = nbytes;
    rv->stored = need;
    rv->end = end;
    rv->codec = codec;
    rv->open = 1;
    rv->thread = PyThread_get_thread_ident();
    rv->view = NULL;
    r->reserved_by = rv;
    return (PyObject *)rv;
}

/* Call owner._slow_name(*args) through a weak reference. */
static PyObject *call_owner(PyObject *owner, const char *name, PyObject *const *args, size_t nargs) {
    PyObject *o = owner ? PyWeakref_GetObject(owner) : Py_None;
    if (!o || o == Py_None) {
        PyErr_SetString(PyExc_ValueError, "handle is closed");
        return NULL;
    }
    Py_INCREF(o);
    PyObject *meth = PyObject_GetAttrString(o, name);
    Py_DECREF(o);
    if (!meth) return NULL;
    PyObject *res = PyObject_Vectorcall(meth, args, nargs, NULL);
    Py_DECREF(meth);
    return res;
}

/* Parse (first positional, block=True, timeout=None, codec/extra) for the *_api entry points. */
static int parse_api(PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames, const char *const *names, int nnames,
                     PyObject **out) {
    for (int i = 0; i < nnames; i++) out[i] = NULL;
    if (nargs > nnames) {
        PyErr_Format(PyExc_TypeError, "takes at most %d positional arguments", nnames);
        return -1;
    }
    for (Py_ssize_t i = 0; i < nargs; i++) out[i] = args[i];
    if (kwnames) {
        Py_ssize_t nk = PyTuple_GET_SIZE(kwnames);
        for (Py_ssize_t k = 0; k < nk; k++) {
            const char *kn = PyUnicode_AsUTF8(PyTuple_GET_ITEM(kwnames, k));
            if (!kn) return -1;
            int found = 0;
            for (int i = 0; i < nnames; i++) {
                if (strcmp(kn, names[i]) == 0) {
                    if (out[i]) {
                        PyErr_Format(PyExc_TypeError, "got multiple values for argument '%s'", kn);
                        return -1;
                    }
                    out[i] = args[nargs + k];
                    found = 1;
                    break;
                }
            }
            if (!found) {
                PyErr_Format(PyExc_TypeError, "got an unexpected keyword argument '%s'", kn);
                return -1;
            }
        }
    }
    return 0;
}

static PyObject *Ring_put_api(Ring *r, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    /* Spool.put(data, block=True, timeout=None, codec=0): the uncontended put
     * in one C call; anything else goes to the owner's _put_slow. */
    static const char *const names[] = {"data", "block", "timeout", "codec"};
    PyObject *a[4];
    if (parse_api(args, nargs, kwnames, names, 4, a) < 0) return NULL;
    if (!a[0]) {
        PyErr_SetString(PyExc_TypeError, "put() missing required argument: 'data'");
        return NULL;
    }
    int block = a[1] ? PyObject_IsTrue(a[1]) : 1;
    if (block < 0) return NULL;
    int codec = 0;
    if (a[3] && (codec = (int)PyLong_AsLong(a[3])) == -1 && PyErr_Occurred()) return NULL;
    if (block && (!a[2] || a[2] == Py_None) && r->fast_put && r->have_buf) {
        Item item;
        if (load_item(&item, a[0], r->checksum) < 0) return NULL;
        int64_t res = ring_write(r, &item, 1, codec, -1, r->lock_wait, 1);
        release_items(&item, 1);
        if (res == -100) return NULL;
        if (res >= 0) return PyLong_FromLongLong(res);
    }
    PyObject *cargs[4] = {a[0], a[1] ? a[1] : Py_True, a[2] ? a[2] : Py_None, NULL};
    PyObject *cd = PyLong_FromLong(codec);
    if (!cd) return NULL;
    cargs[3] = cd;
    PyObject *res = call_owner(r->owner, "_put_slow", cargs, 4);
    Py_DECREF(cd);
    return res;
}

/* *slot = a weak reference to obj (the Python object whose slow path a
 * *_api entry point hands its remaining cases to).  0, or -1 with an exception. */
static int set_weak(PyObject **slot, PyObject *obj) {
    PyObject *ref = PyWeakref_NewRef(obj, NULL);
    if (!ref) return -1;
    Py_XSETREF(*slot, ref);
    return 0;
}

/* The pickle of a shmq.Queue item, every buffer kept in-band and counted in
 * buffers_seen (a caller that sees the count move hands the object to the
 * Python encoder, which keeps the buffers out of band, uncopied). */
static PyObject *dumps_inband(PyObject *obj) {
    PyObject *dargs[3] = {obj, dumps_protocol, inband_callback};
    return PyObject_Vectorcall(pickle_dumps, dargs, 2, dumps_kwnames);
}

/* Queue.put(obj, block=True, timeout=None): bytes as they are, anything else
 * pickled, written in one C call when there is room and no timeout to
 * check; anything else (and any object with out-of-band buffers, which the
 * Python encoder keeps uncopied) goes to the queue's _put_slow. */
static PyObject *Ring_put_obj_api(Ring *r, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    static const char *const names[] = {"obj", "block", "timeout"};
    PyObject *a[3];
    if (parse_api(args, nargs, kwnames, names, 3, a) < 0) return NULL;
    if (!a[0]) {
        PyErr_SetString(PyExc_TypeError, "put() missing required argument: 'obj'");
        return NULL;
    }
    if ((!a[2] || a[2] == Py_None) && r->fast_put && r->have_buf && r->qowner && pickle_dumps) {
        PyObject *data;
        int codec = 0;
        if (PyBytes_CheckExact(a[0])) {
            data = Py_NewRef(a[0]);
        } else {
            /* The callback keeps every buffer in-band and counts it: a
             * count that moved (ours, or another thread's: harmless) sends
             * the object to the Python encoder, which keeps them out of band. */
            unsigned long before = buffers_seen;
            data = dumps_inband(a[0]);
            if (!data) return NULL; /* unpicklable: at once, as the Python put */
            codec = 1;
            if (buffers_seen != before) Py_CLEAR(data);
        }
        if (data && r->have_buf) { /* (__reduce__ code may have closed the handle) */
            Item item;
            int rc = load_item(&item, data, r->checksum);
            Py_DECREF(data);
            if (rc < 0) return NULL;
            int64_t res = ring_write(r, &item, 1, codec, r->q_backlog, r->lock_wait, 1);
            release_items(&item, 1);
            if (res == -100) return NULL;
            if (res >= 0) Py_RETURN_NONE;
        } else {
            Py_XDECREF(data);
        }
    }
    PyObject *cargs[3] = {a[0], a[1] ? a[1] : Py_True, a[2] ? a[2] : Py_None};
    return call_owner(r->qowner, "_put_slow", cargs, 3);
}

/* bind_queue(queue, max_backlog): queue._put_slow completes put_obj_api. */
static PyObject *Ring_bind_queue(Ring *r, PyObject *args) {
    PyObject *queue;
    long long backlog;
    if (!PyArg_ParseTuple(args, "OL", &queue, &backlog)) return NULL;
    if (set_weak(&r->qowner, queue) < 0) return NULL;
    r->q_backlog = backlog;
    Py_RETURN_NONE;
}

static PyObject *Ring_bind(Ring *r, PyObject *args) {
    PyObject *owner;
    int fast;
    if (!PyArg_ParseTuple(args, "Op", &owner, &fast)) return NULL;
    if (set_weak(&r->owner, owner) < 0) return NULL;
    r->fast_put = fast;
    Py_RETURN_NONE;
}

/* The optional (codec, max_backlog, lock_wait) arguments of put / put_many. */
static int parse_put_args(Ring *r, PyObject *const *args, Py_ssize_t nargs, int *codec, long long *backlog,
                          double *wait) {
    if (ring_check_open(r) < 0) return -1;
    *codec = 0;
    *backlog = -1;
    *wait = r->lock_wait;
    if (nargs > 1 && (*codec = (int)PyLong_AsLong(args[1])) == -1 && PyErr_Occurred()) return -1;
    if (nargs > 2 && (*backlog = PyLong_AsLongLong(args[2])) == -1 && PyErr_Occurred()) return -1;
    if (nargs > 3 && args[3] != Py_None && (*wait = PyFloat_AsDouble(args[3])) == -1 && PyErr_Occurred()) return -1;
    return 0;
}

static PyObject *Ring_put(Ring *r, PyObject *const *args, Py_ssize_t nargs) {
    /* put(data, codec=0, max_backlog=-1, lock_wait=default) -> seq or status */
    if (nargs < 1 || nargs > 4) {
        PyErr_SetString(PyExc_TypeError, "put(data, codec=0, max_backlog=-1, lock_wait=None)");
        return NULL;
    }
    int codec;
    long long backlog;
    double wait;
    if (parse_put_args(r, args, nargs, &codec, &backlog, &wait) < 0) return NULL;
    Item item;
    if (load_item(&item, args[0], r->checksum) < 0) return NULL;
    int64_t res = ring_write(r, &item, 1, codec, backlog, wait, 0);
    release_items(&item, 1);
    if (res == -100) return NULL;
    return PyLong_FromLongLong(res);
}

static PyObject *Ring_put_many(Ring *r, PyObject *const *args, Py_ssize_t nargs) {
    /* put_many(items, codec=0, max_backlog=-1, lock_wait=default) -> first seq or status */
    if (nargs < 1 || nargs > 4) {
        PyErr_SetString(PyExc_TypeError, "put_many(items, codec=0, max_backlog=-1, lock_wait=None)");
        return NULL;
    }
    int codec;
    long long backlog;
    double wait;
    if (parse_put_args(r, args, nargs, &codec, &backlog, &wait) < 0) return NULL;
    PyObject *seq = PySequence_Fast(args[0], "put_many() needs a sequence of bytes-like objects");
    if (!seq) return NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    if (count == 0) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "put_many() needs at least one item");
        return NULL;
    }
    if (count > MAX_BATCH) {
        Py_DECREF(seq);
        return PyLong_FromLong(ST_TOO_LARGE);
    }
    Item *items = PyMem_Malloc(sizeof(Item) * (size_t)count);
    if (!items) {
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    PyObject **objs = PySequence_Fast_ITEMS(seq);
    Py_ssize_t k;
    for (k = 0; k < count; k++) {
        if (load_item(&items[k], objs[k], r->checksum) < 0) {
            release_items(items, k);
            PyMem_Free(items);
            Py_DECREF(seq);
            return NULL;
        }
    }
    int64_t res = ring_write(r, items, count, codec, backlog, wait, 0);
    release_items(items, count);
    PyMem_Free(items);
    Py_DECREF(seq);
    if (res == -100) return NULL;
    return PyLong_FromLongLong(res);
}

/* ---- reading ---- */

/* A consistent (seq, pos) of the oldest frame, read lock-free. */
static int first_cursor(Ring *r, uint64_t *oseq, uint64_t *opos) {
    uint64_t *c = r->ctl, ring = r->ring_bytes;
    for (int i = 0; i < 10000; i++) {
        uint64_t seq = ld_acq(&c[W_FIRST_SEQ]); /* seq before pos: the writer stores pos first */
        uint64_t pos = ld_acq(&c[W_FIRST_POS]);
        uint64_t nxt = ld_acq(&c[W_NEXT_SEQ]);
        if (pos >= MAX_COUNTER || nxt >= MAX_COUNTER || seq >= MAX_COUNTER) break; /* would wrap: corrupt */
        if (seq >= nxt) {
            *oseq = seq;
            *opos = pos;
            return 0;
        }
        uint64_t off = pos % ring;
        if (ring - off < FRAME_BYTES) off = 0;
        FrameHeader h;
        read_header(r, off, &h);
        atomic_thread_fence(memory_order_acquire);
        if (header_sane(&h, off, ring) && seq <= h.seq && h.seq < nxt && ld_rlx(&c[W_FIRST_POS]) == pos) {
            *oseq = h.seq;
            *opos = pos;
            return 0;
        }
    }
    corrupt(r, "cannot find the oldest frame (ring corrupt?); see 'shmq fsck'; to keep what is readable: 'shmq export --skip-corrupt', 'shmq rm', 'shmq import'");
    return -1;
}

/* The header at the cursor is not frame `seq` (or was evicted): find out why.
 * Adds skipped frames to *lost. */
static int resync(Ring *r, uint64_t *seq, uint64_t *pos, const FrameHeader *h, uint64_t off, uint64_t *lost) {
    uint64_t *c = r->ctl;
    if (*seq < ld_acq(&c[W_FIRST_SEQ]) || *pos < ld_acq(&c[W_FIRST_POS])) {
        uint64_t s, p;
        if (first_cursor(r, &s, &p) < 0) return -1;
        if (s < *seq) {
            corrupt(r, "reader cursor seq %llu is ahead of the oldest frame %llu yet unreadable; see 'shmq fsck'; to keep what is readable: 'shmq export --skip-corrupt', 'shmq rm', 'shmq import'",
                    (unsigned long long)*seq, (unsigned long long)s);
            return -1;
        }
        *lost += s - *seq; /* overwritten: jump to the oldest frame, count exactly */
        *seq = s;
        *pos = p;
        return 0;
    }
    if (*seq < h->seq && h->seq < ld_acq(&c[W_NEXT_SEQ]) && header_sane(h, off, r->ring_bytes)) {
        /* A cursor committed with its position but not its seq (process
         * killed between the two stores): the frames in between were read. */
        *seq = h->seq;
        return 0;
    }
    corrupt(r, "corrupt frame header at seq %llu (ring offset %llu: header says seq %llu, %u bytes stored, "
            "%u bytes long); see 'shmq fsck'; to keep what is readable: 'shmq export --skip-corrupt', 'shmq rm', 'shmq import'",
            (unsigned long long)*seq, (unsigned long long)off, (unsigned long long)h->seq, h->stored, h->length);
    return -1;
}

static PyObject *make_frame(uint64_t seq, uint64_t ts, PyObject *data, int codec) {
    PyObject *f = PyStructSequence_New(FrameType);
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

#define RD_NONE ((PyObject *)1) /* caught up: nothing to read */

/* Read the frame at cursor (seq, pos), lock-free.  Returns a new Frame,
 * RD_NONE, or NULL with an exception set.  Advances the cursor and adds
 * overwritten frames to *lost. */
static PyObject *read_one(Ring *r, uint64_t *seqp, uint64_t *posp, int verify, uint64_t *lost,
                          FrameHeader *hout, int raw, uint64_t *known) {
    uint64_t *c = r->ctl, ring = r->ring_bytes;
    uint64_t seq = *seqp, pos = *posp;
    int pads = 0;
    /* Positions and seqs never get near 2**62 (centuries at memory bandwidth):
     * larger ones come from a corrupt or hostile cursor, and would wrap. */
    if (seq > MAX_COUNTER || pos > MAX_COUNTER)
        return corrupt(r, "reader cursor out of range (seq %llu, position %llu); reset it with "
                       "'shmq readers seek'", (unsigned long long)seq, (unsigned long long)pos);
    for (long spins = 0;; spins++) {
        if (spins > 1000000) /* resyncs and pads always make progress on a sane ring */
            return corrupt(r, "cannot read at seq %llu (the ring does not converge); " RING_ADVICE,
                           (unsigned long long)seq);
        /* `known`: a NEXT_SEQ this reader loaded (acquire) before, so every
         * frame below it is committed and its bytes visible.  Loading the
         * word only past it spares a reader that is behind one transfer per
         * frame of the control line the writer stores to on every put. */
        if (!known || seq >= *known) {
            uint64_t next = ld_acq(&c[W_NEXT_SEQ]);
            if (known) *known = next;
            if (seq >= next) {
                *seqp = seq;
                *posp = pos;
                return RD_NONE;
            }
        }
        uint64_t off = pos % ring;
        if (ring - off < FRAME_BYTES) {
            pos += ring - off;
            off = 0;
        }
        FrameHeader h;
        read_header(r, off, &h);
        if (h.seq != seq || !header_sane(&h, off, ring)) {
            atomic_thread_fence(memory_order_acquire);
            if (resync(r, &seq, &pos, &h, off, lost) < 0) return NULL;
            continue;
        }
        if (h.flags & FLAG_PAD) {
            atomic_thread_fence(memory_order_acquire);
            if (ld_rlx(&c[W_FIRST_POS]) > pos) { /* the pad itself was overwritten */
                if (resync(r, &seq, &pos, &h, off, lost) < 0) return NULL;
            } else {
                if (++pads > 2 || off == 0) { /* a pad never starts the ring, never repeats */
                    return corrupt(r, "corrupt padding at seq %llu (ring offset %llu); see 'shmq fsck'; to keep what is readable: 'shmq export --skip-corrupt', 'shmq rm', 'shmq import'",
                                   (unsigned long long)seq, (unsigned long long)off);
                }
                pos += h.stored;
            }
            continue;
        }
        const char *src = r->ring + off + FRAME_BYTES;
        PyObject *data;
        if (h.codec == CODEC_PICKLE_OOB || h.codec == CODEC_NUMPY) /* arrays rebuilt over it are writable */
            data = PyByteArray_FromStringAndSize(src, h.length);
        else
            data = PyBytes_FromStringAndSize(src, h.length);
        if (!data) return NULL;
        atomic_thread_fence(memory_order_acquire); /* the copy happens before the re-check */
        if (ld_rlx(&c[W_FIRST_POS]) > pos) {          /* overwritten while we copied */
            Py_DECREF(data);
            if (resync(r, &seq, &pos, &h, off, lost) < 0) return NULL;
            continue;
        }
        if (verify && (h.flags & FLAG_CRC)) {
            const char *p = PyBytes_Check(data) ? PyBytes_AS_STRING(data) : PyByteArray_AS_STRING(data);
            if (crc_update(0, (const unsigned char *)p, h.length) != h.crc) {
                Py_DECREF(data);
                return corrupt(r, "frame %llu fails its CRC check (memory corruption?); see 'shmq fsck'; to keep what is readable: 'shmq export --skip-corrupt', 'shmq rm', 'shmq import'",
                               (unsigned long long)seq);
            }
        }
        *seqp = seq + 1;
        *posp = pos + h.stored;
        if (hout) *hout = h;
        return raw ? data : make_frame(seq, h.ts, data, h.codec);
    }
}

/* ---- Ring methods used by Python's slow paths ---- */

static PyObject *Ring_read(Ring *r, PyObject *args) {
    /* read(seq, pos, verify=False) -> (frame|None, seq, pos, lost, codec) */
    unsigned long long seq, pos;
    int verify = 0;
    if (!PyArg_ParseTuple(args, "KK|p", &seq, &pos, &verify)) return NULL;
    if (ring_check_open(r) < 0) return NULL;
    uint64_t s = seq, p = pos, lost = 0;
    PyObject *f = read_one(r, &s, &p, verify, &lost, NULL, 0, NULL);
    if (!f) return NULL;
    if (f == RD_NONE) return Py_BuildValue("(OKKKi)", Py_None, s, p, lost, 0);
    PyObject *codec = PyStructSequence_GET_ITEM(f, 3);
    PyObject *res = Py_BuildValue("(NKKKO)", f, s, p, lost, codec);
    return res;
}

static PyObject *Ring_locate(Ring *r, PyObject *args) {
    /* locate(seq, hint_seq, hint_pos) -> header position of frame seq;
     * -1: already overwritten; -2: the ring was rewritten under every attempt.
     * Walks headers lock-free from the oldest frame (or the hint). */
    unsigned long long want, hseq, hpos;
    if (!PyArg_ParseTuple(args, "KKK", &want, &hseq, &hpos)) return NULL;
    if (ring_check_open(r) < 0) return NULL;
    uint64_t *c = r->ctl, ring = r->ring_bytes;
    for (int attempt = 0; attempt < 100; attempt++) {
        uint64_t s, p;
        if (first_cursor(r, &s, &p) < 0) return NULL;
        if (want < s) return PyLong_FromLong(-1);
        if (s <= hseq && hseq <= want && hpos >= p) {
            s = hseq;
            p = hpos;
        }
        uint64_t limit = ld_acq(&c[W_NEXT_POS]) + ring; /* a sane walk never gets this far */
        int pads = 0;
        for (;;) {
            uint64_t off = p % ring;
            if (ring - off < FRAME_BYTES) {
                p += ring - off;
                off = 0;
            }
            FrameHeader h;
            read_header(r, off, &h);
            atomic_thread_fence(memory_order_acquire);
            if (ld_rlx(&c[W_FIRST_POS]) > p) break; /* overtaken by the writer: start again */
            if (h.seq != s || !header_sane(&h, off, ring) || p > limit)
                return corrupt(r, "ring is corrupt near seq %llu; see 'shmq fsck'; to keep what is readable: 'shmq export --skip-corrupt', 'shmq rm', 'shmq import'", (unsigned long long)s);
            if (h.flags & FLAG_PAD) {
                if (off == 0 || ++pads > 2)
                    return corrupt(r, "corrupt padding near seq %llu", (unsigned long long)s);
                p += h.stored;
                continue;
            }
            pads = 0;
            if (s == want) return PyLong_FromUnsignedLongLong(p);
            s++;
            p += h.stored;
        }
    }
    return PyLong_FromLong(-2);
}

static PyObject *Ring_first_cursor(Ring *r, PyObject *unused) {
    if (ring_check_open(r) < 0) return NULL;
    uint64_t s, p;
    if (first_cursor(r, &s, &p) < 0) return NULL;
    return Py_BuildValue("(KK)", s, p);
}

static PyObject *Ring_latest(Ring *r, PyObject *args) {
    /* latest(lock_wait) -> (NEXT_SEQ, NEXT_POS) as a consistent pair, or None if the lock is stuck */
    double wait = r->lock_wait;
    if (!PyArg_ParseTuple(args, "|d", &wait)) return NULL;
    if (ring_check_open(r) < 0) return NULL;
    int lk = sem_lock_on(r->wsem, wait, (PyObject *)r);
    if (lk < 0) return NULL;
    if (lk > 0) Py_RETURN_NONE;
    uint64_t s = ld_rlx(&r->ctl[W_NEXT_SEQ]), p = ld_rlx(&r->ctl[W_NEXT_POS]);
    sem_post(r->wsem);
    return Py_BuildValue("(KK)", s, p);
}

static PyObject *Ring_ring_space(Ring *r, PyObject *unused) {
    if (ring_check_open(r) < 0) return NULL;
    ring_bell(r, r->fsem);
    Py_RETURN_NONE;
}

static PyObject *Ring_ring_data(Ring *r, PyObject *unused) {
    if (ring_check_open(r) < 0) return NULL;
    ring_bell(r, r->rsem);
    Py_RETURN_NONE;
}

/* bell_seen(space) -> the doorbell word's value; read it after registering
 * as a waiter and before re-checking, then pass it to bell_wait. */
static PyObject *Ring_bell_seen(Ring *r, PyObject *space) {
    if (ring_check_open(r) < 0) return NULL;
    int sp = PyObject_IsTrue(space);
    if (sp < 0) return NULL;
    int word = sp ? W_SPACE_BELL : W_DATA_BELL;
    return PyLong_FromUnsignedLong(atomic_load_explicit(bell_word(r, word), memory_order_acquire));
}

/* bell_wait(space, seen, timeout): sleep, GIL released, until the doorbell
 * word is no longer `seen` (someone rang), a signal arrives or `timeout`
 * seconds pass.  Any return means "re-check"; a signal handler's exception
 * propagates (nothing is held here).  The futex is a shared one (keyed by
 * the file's page), so rings from any process wake it. */
static PyObject *Ring_bell_wait(Ring *r, PyObject *args) {
    int space;
    unsigned long seen;
    double timeout;
    if (!PyArg_ParseTuple(args, "pkd", &space, &seen, &timeout)) return NULL;
    if (ring_check_open(r) < 0) return NULL;
    if (timeout <= 0) Py_RETURN_NONE;
    if (timeout > 3600) timeout = 3600;
    struct timespec ts = {(time_t)timeout, (long)((timeout - (double)(time_t)timeout) * 1e9)};
    _Atomic uint32_t *w = bell_word(r, space ? W_SPACE_BELL : W_DATA_BELL);
    r->busy++;
    Py_BEGIN_ALLOW_THREADS
    syscall(SYS_futex, w, FUTEX_WAIT, (uint32_t)seen, &ts, NULL, 0); /* any return means re-check */
    Py_END_ALLOW_THREADS
    r->busy--;
    if (ring_closed_meanwhile((PyObject *)r, 0, NULL)) return NULL;
    if (PyErr_CheckSignals() < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *Ring_set_fd(Ring *r, PyObject *args) {
    unsigned long long holder;
    int fd;
    if (!PyArg_ParseTuple(args, "iK", &fd, &holder)) return NULL;
    int mine = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (mine < 0) return PyErr_SetFromErrno(PyExc_OSError);
    if (r->fd_owned) close(r->fd);
    r->fd = mine;
    r->fd_owned = 1;
    r->holder = holder;
    Py_RETURN_NONE;
}

static PyObject *Ring_zone_alloc(Ring *r, PyObject *args) {
    /* zone_alloc(lo, hi) -> 0 or NO_SPACE: allocate a growable ring's offsets [lo, hi);
     * the caller (Python's general write path) holds the writer lock */
    unsigned long long lo, hi;
    if (!PyArg_ParseTuple(args, "KK", &lo, &hi)) return NULL;
    if (ring_check_open(r) < 0) return NULL;
    if (!r->segment) return PyLong_FromLong(0);
    int st = zone_alloc(r, lo, hi > r->ring_bytes ? r->ring_bytes : hi);
    ring_finish(r); /* the caller's lock is its own semaphore handle: nothing of ours is held */
    if (st == -100) return NULL;
    return PyLong_FromLong(st);
}

static PyObject *Ring_trim(Ring *r, PyObject *args) {
    /* trim(lock_wait) -> True, or None if the writer lock was not free within
     * lock_wait: a growable ring with nothing resident (after evicting what every
     * named reader and group consumed) keeps only the writer's current segment
     * and the start allocation (below ALLOC_MIN). */
    double wait = 0;
    if (!PyArg_ParseTuple(args, "|d", &wait)) return NULL;
    if (ring_check_open(r) < 0) return NULL;
    if (!r->segment) Py_RETURN_TRUE;
    int lk = sem_lock_on(r->wsem, wait, (PyObject *)r);
    if (lk < 0) return NULL;
    if (lk > 0) Py_RETURN_NONE;
    st_rlx(&r->ctl[W_LOCK_HOLDER], r->holder);
    uint64_t *c = r->ctl, seg = r->segment, ring = r->ring_bytes;
    uint64_t nseq = ld_rlx(&c[W_NEXT_SEQ]), npos = ld_rlx(&c[W_NEXT_POS]);
    int rc = 0;
    if (r->policy != 0) rc = make_room(r, ld_rlx(&c[W_FIRST_POS]), nseq, npos);
    if (rc != -100 && ld_rlx(&c[W_FIRST_SEQ]) >= nseq) { /* nothing resident */
        /* Keep the writer's current segment and the start allocation below
         * ALLOC_MIN: the writer wraps early into it next, and freeing it would
         * make every lap after a trim pay for fresh pages again. */
        uint64_t cur = npos % ring / seg * seg, keep = (ld_rlx(&c[W_ALLOC_MIN]) + seg - 1) / seg * seg;
        rc = zone_punch(r, cur + seg > keep ? cur + seg : keep, ring);
        if (rc == 0 && cur > keep) rc = zone_punch(r, keep, cur);
    }
    wlock_release(r);
    ring_finish(r);
    if (rc == -100) return NULL;
    ring_bell(r, r->fsem);
    Py_RETURN_TRUE;
}

static PyObject *Ring_full_marker(Ring *r, PyObject *unused) {
    return Py_BuildValue("(KK)", r->full_floor, r->full_pin);
}

static void ring_release(Ring *r) {
    if (r->busy) { /* another thread is in fallocate or a lock wait on this handle */
        r->closing = 1;
        return;
    }
    if (r->fd_owned) {
        close(r->fd); /* our own duplicate: never reused under a concurrent fallocate */
        r->fd_owned = 0;
        r->fd = -1;
    }
    if (r->reserved_by) { /* closing with a reservation open: abandon it (release the lock) */
        r->reserved_by->open = 0;
        if (r->have_buf && r->wsem) wlock_release(r);
        r->reserved_by = NULL;
    }
    if (r->have_buf) {
        PyBuffer_Release(&r->buf);
        r->have_buf = 0;
    }
    if (r->wsem) sem_close(r->wsem);
    if (r->rsem) sem_close(r->rsem);
    if (r->fsem) sem_close(r->fsem);
    r->wsem = r->rsem = r->fsem = NULL;
    r->base = r->ring = NULL;
    r->ctl = r->slots = NULL;
}

static PyObject *Ring_close(Ring *r, PyObject *unused) {
    ring_release(r);
    Py_RETURN_NONE;
}

static sem_t *open_sem(const char *name) {
    sem_t *s = sem_open(name, 0);
    if (s == SEM_FAILED) {
        PyErr_SetFromErrnoWithFilename(PyExc_OSError, name);
        return NULL;
    }
    return s;
}

static int Ring_init(Ring *r, PyObject *args, PyObject *kw) {
    /* Ring(mm, path, ring_offset, ring_bytes, slot_offset, slot_count, policy, checksum,
            writer_sem, read_waiters_sem, space_waiters_sem, fd, holder, lock_wait) */
    PyObject *mm, *path;
    unsigned long long ring_offset, ring_bytes, slot_offset, slot_count, holder;
    int policy, checksum, fd;
    const char *wname, *rname, *fname;
    double lock_wait;
    if (!PyArg_ParseTuple(args, "OUKKKKipsssiKd", &mm, &path, &ring_offset, &ring_bytes, &slot_offset, &slot_count,
                          &policy, &checksum, &wname, &rname, &fname, &fd, &holder, &lock_wait))
        return -1;
    ring_release(r);
    if (PyObject_GetBuffer(mm, &r->buf, PyBUF_WRITABLE) < 0) return -1;
    r->have_buf = 1;
    if (ring_bytes < 4096 || ring_bytes % 4096 || ring_offset % 4096 || ring_offset < HEADER_BYTES ||
        slot_offset < HEADER_BYTES || slot_offset + slot_count * SLOT_BYTES > ring_offset ||
        (uint64_t)r->buf.len < ring_offset + ring_bytes || policy < 0 || policy > 2 ||
        ((uint64_t *)r->buf.buf)[W_SEGMENT] % 4096 || ((uint64_t *)r->buf.buf)[W_SEGMENT] > ring_bytes) {
        ring_release(r);
        PyErr_SetString(PyExc_ValueError, "inconsistent ring geometry");
        return -1;
    }
    Py_XSETREF(r->path, Py_NewRef(path));
    r->base = r->buf.buf;
    r->ctl = (uint64_t *)r->base;
    r->slots = (uint64_t *)(r->base + slot_offset);
    r->ring = r->base + ring_offset;
    r->ring_bytes = ring_bytes;
    r->ring_offset = ring_offset;
    r->segment = ld_rlx(&r->ctl[W_SEGMENT]);
    r->slot_count = slot_count;
    r->max_payload = ring_bytes - FRAME_BYTES;
    if (r->max_payload > 0xFFFFFFFFull - FRAME_BYTES - ALIGN) r->max_payload = 0xFFFFFFFFull - FRAME_BYTES - ALIGN;
    r->policy = policy;
    r->checksum = checksum;
    r->fd = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (r->fd < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        ring_release(r);
        return -1;
    }
    r->fd_owned = 1;
    r->holder = holder;
    r->lock_wait = lock_wait;
    r->rate_until = 0;
    r->rate_word = W_RATE + 1;
    if (!(r->wsem = open_sem(wname)) || !(r->rsem = open_sem(rname)) || !(r->fsem = open_sem(fname))) {
        ring_release(r);
        return -1;
    }
    return 0;
}

static void Ring_dealloc(Ring *r) {
    ring_release(r);
    Py_XDECREF(r->path);
    Py_XDECREF(r->owner);
    Py_XDECREF(r->qowner);
    Py_TYPE(r)->tp_free((PyObject *)r);
}

static PyObject *Ring_get_max_payload(Ring *r, void *c) { return PyLong_FromUnsignedLongLong(r->max_payload); }

static PyMethodDef Ring_methods[] = {
    {"trim", (PyCFunction)Ring_trim, METH_VARARGS,
     "trim(lock_wait=0) -> True, or None if the lock was busy: a drained growable ring keeps its current segment and the start allocation"},
    {"zone_alloc", (PyCFunction)Ring_zone_alloc, METH_VARARGS,
     "zone_alloc(lo, hi) -> 0 or NO_SPACE (writer lock held): allocate a growable ring's offsets"},
    {"put", (PyCFunction)(void (*)(void))Ring_put, METH_FASTCALL,
     "put(data, codec=0, max_backlog=-1, lock_wait=None) -> seq, or a negative status"},
    {"put_many", (PyCFunction)(void (*)(void))Ring_put_many, METH_FASTCALL,
     "put_many(items, codec=0, max_backlog=-1, lock_wait=None) -> first seq, or a negative status"},
    {"read", (PyCFunction)Ring_read, METH_VARARGS, "read(seq, pos, verify=False) -> (frame|None, seq, pos, lost, codec)"},
    {"put_api", (PyCFunction)(void (*)(void))Ring_put_api, METH_FASTCALL | METH_KEYWORDS,
     "put(data, block=True, timeout=None, codec=0) -> seq (see shmq.Spool.put)"},
    {"bind", (PyCFunction)Ring_bind, METH_VARARGS, "bind(owner, fast): owner._put_slow completes put_api"},
    {"put_obj_api", (PyCFunction)(void (*)(void))Ring_put_obj_api, METH_FASTCALL | METH_KEYWORDS,
     "shmq.Queue.put(obj, block=True, timeout=None)"},
    {"bind_queue", (PyCFunction)Ring_bind_queue, METH_VARARGS, "bind_queue(queue, max_backlog): queue._put_slow completes put_obj_api"},
    {"first_cursor", (PyCFunction)Ring_first_cursor, METH_NOARGS, "(seq, pos) of the oldest frame"},
    {"reserve", (PyCFunction)Ring_reserve, METH_VARARGS, "reserve(nbytes, codec, lock_wait) -> Reservation or status"},
    {"locate", (PyCFunction)Ring_locate, METH_VARARGS, "locate(seq, hint_seq, hint_pos) -> position, -1 lost, -2 busy"},
    {"latest", (PyCFunction)Ring_latest, METH_VARARGS, "latest(lock_wait) -> (next_seq, next_pos) or None"},
    {"ring_space", (PyCFunction)Ring_ring_space, METH_NOARGS, "wake writers waiting for room, if any"},
    {"ring_data", (PyCFunction)Ring_ring_data, METH_NOARGS, "wake readers waiting for frames, if any"},
    {"trim_due", (PyCFunction)Ring_trim_due, METH_NOARGS,
     "True if a growable ring's zone spans more than 4 segments (an idle reader trims it)"},
    {"bell_seen", (PyCFunction)Ring_bell_seen, METH_O, "bell_seen(space) -> the doorbell word (read before re-checking)"},
    {"bell_wait", (PyCFunction)Ring_bell_wait, METH_VARARGS,
     "bell_wait(space, seen, timeout): sleep until the doorbell word moves from seen"},
    {"set_fd", (PyCFunction)Ring_set_fd, METH_VARARGS, "set_fd(fd, holder): after fork"},
    {"full_marker", (PyCFunction)Ring_full_marker, METH_NOARGS, "room marker taken under the lock when full"},
    {"close", (PyCFunction)Ring_close, METH_NOARGS, "release the mapping and semaphores"},
    {NULL}};

static PyGetSetDef Ring_getset[] = {{"max_payload", (getter)Ring_get_max_payload, NULL, NULL, NULL}, {NULL}};

static PyTypeObject RingType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "shmq._core.Ring",
    .tp_basicsize = sizeof(Ring),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Ring_init,
    .tp_dealloc = (destructor)Ring_dealloc,
    .tp_methods = Ring_methods,
    .tp_getset = Ring_getset,
    .tp_doc = "The hot path of one spool mapping (internal: use shmq.Spool).",
};

/* ---- Cursor: a reader's position, read and committed in C ---- */

enum { K_ANON = 0, K_NAMED = 1, K_GROUP = 2 };

typedef struct {
    PyObject_HEAD
    Ring *ring;
    uint64_t seq, pos, lost;
    int64_t slot;
    int kind, autocommit, verify;
    sem_t *gsem;
    uint64_t n, bytes, dsum, dmax, dcount, lag_peak, lost_pending;
    uint64_t rng;      /* xorshift state of sample_delay */
    PyObject *closed_msg;
    PyObject *last;  /* the frame get_obj() could not decode (UNDECODED) */
    PyObject *owner;  /* weak reference to the reader whose _get_slow completes get_api */
    PyObject *qowner; /* weak reference to the shmq.Queue whose _get_slow completes get_obj_api */
    uint64_t released; /* ring position up to which this cursor has released its pages */
    int busy;          /* threads waiting for the group lock with the GIL released */
    uint64_t known;    /* a NEXT_SEQ loaded before: frames below it are committed (read_one) */
} Cursor;

/* Close the group semaphore once no thread waits on it any more. */
static void cursor_finish(Cursor *c) {
    if (c->closed_msg && !c->busy && c->gsem) {
        sem_close(c->gsem);
        c->gsem = NULL;
    }
}

/* Take the group lock like sem_lock; a close() of the reader or of its spool by
 * another thread meanwhile is deferred until we are out, then we give the lock
 * back and raise ValueError: nothing is touched after the handle is gone. */
static int group_lock(Cursor *c, double wait) {
    Ring *r = c->ring;
    c->busy++;
    r->busy++;
    int lk = sem_lock(c->gsem, wait);
    c->busy--;
    r->busy--;
    if (c->closed_msg || r->closing) {
        if (lk == 0) sem_post(c->gsem);
        int closed_reader = c->closed_msg != NULL;
        cursor_finish(c);
        ring_finish(r);
        if (lk >= 0) {
            if (closed_reader)
                PyErr_SetObject(PyExc_ValueError, c->closed_msg);
            else
                PyErr_SetString(PyExc_ValueError, "spool handle was closed by another thread");
        }
        return -1;
    }
    return lk;
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

static void release_behind(Ring *r, uint64_t *released, uint64_t pos) {
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
    if (r->segment && ld_rlx(&r->ctl[W_ALLOC]) <= KEEP_WHOLE) { /* a small hot zone: all of it stays */
        *released = pos; /* ... and the next look is RELEASE_CHUNK on, not at every get */
        return;
    }
    static uint64_t page = 0;
    if (!page) page = (uint64_t)sysconf(_SC_PAGESIZE);
    uint64_t start = *released, end = (pos - KEEP_BEHIND) & ~(page - 1);
    if (end - start > ring) start = end - ring;            /* jumped (loss, seek): the whole ring */
    start &= ~(page - 1);
    *released = end;
    uint64_t len = end - start, off = start % ring, first = len < ring - off ? len : ring - off;
    /* errors (EINVAL where pages are larger than the ring's alignment) only cost memory */
    (void)madvise(r->ring + off, (size_t)first, MADV_DONTNEED);
    if (len > first) (void)madvise(r->ring, (size_t)(len - first), MADV_DONTNEED);
}

static uint64_t *cur_slot(Cursor *c) { return c->ring->slots + c->slot * SLOT_WORDS; }

static void count_read_rate(Ring *r, uint64_t n, uint64_t now) {
    /* Unlocked read-modify-write: concurrent readers may lose an update
     * (documented as approximate); the per-reader counters are exact. */
    uint64_t sec = now / 1000000000ull;
    int b = W_RATE + (int)(sec % RATE_SECONDS) * RATE_WORDS;
    if (ld_rlx(&r->ctl[b]) != sec) {
        st_rlx(&r->ctl[b], sec);
        st_rlx(&r->ctl[b + 1], 0);
        st_rlx(&r->ctl[b + 2], 0);
    }
    st_rlx(&r->ctl[b + 2], ld_rlx(&r->ctl[b + 2]) + n);
}

/* Publish accumulated counters to the slot (named: exclusive; group: lock held). */
static void flush_locked(Cursor *c) {
    if (c->slot < 0 || !(c->n || c->lost_pending)) return;
    uint64_t *s = cur_slot(c), now = now_ns();
    st_rlx(&s[S_GETS], ld_rlx(&s[S_GETS]) + c->n);
    st_rlx(&s[S_GET_BYTES], ld_rlx(&s[S_GET_BYTES]) + c->bytes);
    st_rlx(&s[S_DELAY_SUM_NS], ld_rlx(&s[S_DELAY_SUM_NS]) + c->dsum);
    st_rlx(&s[S_DELAY_COUNT], ld_rlx(&s[S_DELAY_COUNT]) + c->dcount);
    if (c->dmax > ld_rlx(&s[S_DELAY_MAX_NS])) st_rlx(&s[S_DELAY_MAX_NS], c->dmax);
    if (c->kind == K_NAMED) st_rlx(&s[S_LOST], ld_rlx(&s[S_LOST]) + c->lost_pending);
    if (c->n) {
        st_rlx(&s[S_LAST_GET_NS], now);
        if (c->lag_peak > ld_rlx(&s[S_LAG_HIGH])) st_rlx(&s[S_LAG_HIGH], c->lag_peak);
    }
    uint64_t nxt = ld_rlx(&c->ring->ctl[W_NEXT_SEQ]);
    uint64_t cur = c->kind == K_GROUP ? ld_rlx(&s[S_SEQ]) : c->seq;
    uint64_t lag = nxt > cur ? nxt - cur : 0;
    if (lag < ld_rlx(&s[S_LAG_LOW])) st_rlx(&s[S_LAG_LOW], lag);
    count_read_rate(c->ring, c->n, now);
    c->n = c->bytes = c->dsum = c->dmax = c->dcount = c->lost_pending = 0;
}

/* The put-to-get delay needs a clock read (a vDSO clock_gettime, ~20 ns on
 * this VM: 3-5% of a Queue.get of a small dict).  A take of several frames
 * reads it once for all of them; a single get reads it on one get in
 * DELAY_SAMPLE_EVERY, chosen at random (xorshift) so that no periodic
 * pattern of the producer lines up with the samples.  Statistics divide the
 * delay sum by the measured count (S_DELAY_COUNT), not by the gets. */
#define DELAY_SAMPLE_EVERY 8
static uint64_t delay_clock(Cursor *c, Py_ssize_t max) {
    if (max == 1) {
        uint64_t x = c->rng;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        c->rng = x;
        if (x & (DELAY_SAMPLE_EVERY - 1)) return 0; /* not measured this time */
    }
    return now_ns();
}

/* Count one frame taken; `now` 0: its delay is not measured (delay_clock). */
static void account(Cursor *c, const FrameHeader *h, uint64_t now) {
    uint64_t seq = h->seq, ts = h->ts;
    if (!c->n) {
        uint64_t nxt = ld_rlx(&c->ring->ctl[W_NEXT_SEQ]);
        c->lag_peak = nxt > seq ? nxt - seq : 0;
    }
    c->n++;
    c->bytes += h->length;
    if (!now) return;
    c->dcount++;
    if (now > ts) { /* clocks can step backwards; never count a negative delay */
        uint64_t dl = now - ts;
        c->dsum += dl;
        if (dl > c->dmax) c->dmax = dl;
    }
}

static int cursor_check(Cursor *c) {
    if (c->closed_msg) {
        PyErr_SetObject(PyExc_ValueError, c->closed_msg);
        return -1;
    }
    return ring_check_open(c->ring);
}

static void named_commit(Cursor *c) {
    uint64_t *s = cur_slot(c);
    st_rel(&s[S_POS], c->pos); /* position first: see resync */
    st_rel(&s[S_SEQ], c->seq);
}

/* `codes` (as_list only): the objects mode of get_obj_many: a list entry is
 * the payload alone, its codec in codes[i], or for a codec the core does not
 * decode a Frame (codes[i] = CODE_FRAME). */
#define CODE_FRAME 255
typedef struct {
    uint8_t *v;
    Py_ssize_t cap; /* grown as frames come: max may be far more than will be taken */
    int unpickle;   /* in-band pickles decoded here (a trusted queue), else left as Frames */
} Codes;

static PyObject *obj_entry(PyObject *data, const FrameHeader *h, Codes *codes, Py_ssize_t i) {
    if (i >= codes->cap) {
        Py_ssize_t cap = codes->cap ? codes->cap * 2 : 128;
        uint8_t *v = PyMem_Realloc(codes->v, (size_t)cap);
        if (!v) {
            Py_DECREF(data);
            return PyErr_NoMemory();
        }
        codes->v = v;
        codes->cap = cap;
    }
    if (h->codec == 0 || (h->codec == 1 && codes->unpickle && pickle_loads)) {
        codes->v[i] = h->codec;
        return data;
    }
    codes->v[i] = CODE_FRAME;
    return make_frame(h->seq, h->ts, data, h->codec);
}

/* Read up to max frames from a private cursor (anonymous / named). */
static PyObject *private_take(Cursor *c, Py_ssize_t max, int as_list, FrameHeader *rawh, Codes *codes) {
    Ring *r = c->ring;
    PyObject *out = as_list ? PyList_New(0) : NULL;
    if (as_list && !out) return NULL;
    PyObject *single = NULL;
    uint64_t lost = 0, now = 0;
    int clocked = 0;
    Py_ssize_t got = 0;
    while (got < max) {
        FrameHeader h;
        PyObject *f = read_one(r, &c->seq, &c->pos, c->verify, &lost, &h, rawh || codes, &c->known);
        if (!f) {
            Py_XDECREF(out);
            return NULL;
        }
        if (f == RD_NONE) break;
        if (c->kind == K_NAMED) {
            if (!clocked) {
                now = delay_clock(c, max);
                clocked = 1;
            }
            account(c, &h, now);
        }
        got++;
        if (codes && !(f = obj_entry(f, &h, codes, got - 1))) {
            Py_DECREF(out);
            return NULL;
        }
        if (as_list) {
            int rc = PyList_Append(out, f);
            Py_DECREF(f);
            if (rc < 0) {
                Py_DECREF(out);
                return NULL;
            }
        } else {
            single = f;
            if (rawh) *rawh = h;
        }
    }
    if (lost) {
        c->lost += lost;
        c->lost_pending += lost;
    }
    if (got || lost) release_behind(r, &c->released, c->pos);
    if (c->kind == K_NAMED && (got || lost)) {
        if (c->autocommit) named_commit(c);
        if (c->n >= STATS_FLUSH_FRAMES || (lost && !got)) flush_locked(c);
        if (c->autocommit && r->policy != 0) ring_bell(r, r->fsem);
    }
    if (as_list) return out;
    if (single) return single;
    Py_RETURN_NONE;
}

/* Take up to max frames from the group's shared cursor under its lock. */
static PyObject *group_take(Cursor *c, Py_ssize_t max, int as_list, double lock_wait, FrameHeader *rawh,
                            Codes *codes) {
    Ring *r = c->ring;
    int lk = group_lock(c, lock_wait);
    if (lk < 0) return NULL;
    if (lk > 0) return PyLong_FromLong(ST_LOCK_STUCK);
    uint64_t *s = cur_slot(c);
    st_rlx(&s[S_LOCK_HOLDER], r->holder);
    uint64_t seq = ld_rlx(&s[S_SEQ]), pos = ld_rlx(&s[S_POS]), lost = 0, now = 0;
    int clocked = 0;
    PyObject *out = as_list ? PyList_New(0) : NULL, *single = NULL;
    Py_ssize_t got = 0;
    PyObject *err = NULL;
    if (as_list && !out) goto unlock;
    while (got < max) {
        FrameHeader h;
        PyObject *f = read_one(r, &seq, &pos, c->verify, &lost, &h, rawh || codes, &c->known);
        if (!f) {
            Py_CLEAR(out);
            err = (PyObject *)1;
            break;
        }
        if (f == RD_NONE) break;
        if (!clocked) {
            now = delay_clock(c, max);
            clocked = 1;
        }
        account(c, &h, now);
        got++;
        if (codes && !(f = obj_entry(f, &h, codes, got - 1))) {
            Py_CLEAR(out);
            err = (PyObject *)1;
            break;
        }
        if (as_list) {
            int rc = PyList_Append(out, f);
            Py_DECREF(f);
            if (rc < 0) {
                Py_CLEAR(out);
                err = (PyObject *)1;
                break;
            }
        } else {
            single = f;
            if (rawh) *rawh = h;
        }
    }
    if (!err && (got || lost)) {
        st_rel(&s[S_POS], pos); /* position first: see resync */
        st_rel(&s[S_SEQ], seq);
        if (lost) st_rlx(&s[S_LOST], ld_rlx(&s[S_LOST]) + lost);
        if (c->n >= STATS_FLUSH_FRAMES) flush_locked(c);
    }
unlock:
    st_rlx(&s[S_LOCK_HOLDER], 0);
    sem_post(c->gsem);
    if (err || (as_list && !out)) return NULL;
    if (got || lost) release_behind(r, &c->released, pos);
    if (got && r->policy != 0) ring_bell(r, r->fsem); /* outside the lock: wake writers waiting for room */
    if (as_list) return out;
    if (single) return single;
    Py_RETURN_NONE;
}

/* Up to max frames from any cursor: the group take under the group lock
 * (waiting up to lock_wait for it), else the private take.  See those two
 * for as_list, rawh and codes. */
static PyObject *cursor_take(Cursor *c, Py_ssize_t max, int as_list, double lock_wait, FrameHeader *rawh,
                             Codes *codes) {
    return c->kind == K_GROUP ? group_take(c, max, as_list, lock_wait, rawh, codes)
                              : private_take(c, max, as_list, rawh, codes);
}

/* The optional lock_wait argument of the Cursor take methods: seconds, or
 * None for the handle's default.  0, or -1 with an exception set. */
static int lock_wait_arg(Cursor *c, PyObject *const *args, Py_ssize_t nargs, Py_ssize_t i, double *wait) {
    *wait = c->ring->lock_wait;
    if (nargs > i && args[i] != Py_None && (*wait = PyFloat_AsDouble(args[i])) == -1 && PyErr_Occurred()) return -1;
    return 0;
}

/* The arguments of get_many / get_obj_many: (max, lock_wait=None), the cursor open. */
static int many_args(Cursor *c, PyObject *const *args, Py_ssize_t nargs, const char *usage, Py_ssize_t *max,
                     double *wait) {
    if (nargs < 1) {
        PyErr_SetString(PyExc_TypeError, usage);
        return -1;
    }
    *max = PyLong_AsSsize_t(args[0]);
    if (*max == -1 && PyErr_Occurred()) return -1;
    if (cursor_check(c) < 0) return -1;
    return lock_wait_arg(c, args, nargs, 1, wait);
}

static PyObject *Cursor_get(Cursor *c, PyObject *const *args, Py_ssize_t nargs) {
    /* get(lock_wait=None) -> Frame, None (nothing now) or ST_LOCK_STUCK (groups) */
    double wait;
    if (cursor_check(c) < 0 || lock_wait_arg(c, args, nargs, 0, &wait) < 0) return NULL;
    return cursor_take(c, 1, 0, wait, NULL, NULL);
}

/* One frame from the cursor: a Frame, None (nothing now) or ST_LOCK_STUCK (a
 * group whose lock was not free within the handle's lock wait). */
static PyObject *take_one(Cursor *c) { return cursor_take(c, 1, 0, c->ring->lock_wait, NULL, NULL); }

static PyObject *Cursor_get_obj(Cursor *c, PyObject *unused) {
    /* The shmq.Queue get path in one call: take one frame (group lock held
     * for the copy only), then decode raw and pickle frames after releasing
     * the lock.  Returns the object, EMPTY (nothing now), STUCK (the group
     * lock was not free in time) or UNDECODED (another codec: see .last). */
    if (cursor_check(c) < 0) return NULL;
    FrameHeader h; /* the data alone: no Frame object unless it goes to Python */
    PyObject *d = cursor_take(c, 1, 0, c->ring->lock_wait, &h, NULL);
    if (!d) return NULL;
    if (d == Py_None) {
        Py_DECREF(d);
        return Py_NewRef(EMPTY);
    }
    if (PyLong_Check(d)) {
        Py_DECREF(d);
        return Py_NewRef(STUCK);
    }
    if (h.codec == 0) return d; /* after the group lock was released */
    if (h.codec == 1 && pickle_loads) {
        PyObject *out = PyObject_CallOneArg(pickle_loads, d);
        Py_DECREF(d);
        return out;
    }
    PyObject *f = make_frame(h.seq, h.ts, d, h.codec);
    if (!f) return NULL;
    Py_XSETREF(c->last, f);
    return Py_NewRef(UNDECODED);
}

static PyObject *get_obj_take(Cursor *c) { return Cursor_get_obj(c, NULL); }

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

/* shmq._notify.SAFETY_NET_S (0.1 s unless a test raised it) as a timespec. */
static struct timespec safety_net(void) {
    double s = 0.1;
    PyObject *v = notify_module ? PyObject_GetAttrString(notify_module, "SAFETY_NET_S") : NULL;
    if (v) {
        double d = PyFloat_AsDouble(v);
        if (!(d == -1.0 && PyErr_Occurred()) && d > 0 && d < 3600) s = d;
        Py_DECREF(v);
    }
    PyErr_Clear();
    struct timespec ts = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
    return ts;
}

/* A blocking get that found nothing, even after the spin: wait for a frame
 * here, in C, until `deadline` (a mono_ns() value; 0: none), so that a
 * wake-up costs no Python between the futex returning and the frame being
 * taken.  The protocol is the one of shmq/_notify.py's Doorbell.wait:
 * register as a data waiter (sem_post, a full fence), read the doorbell
 * word, re-check by taking, sleep on the word (GIL released, at most
 * shmq._notify.SAFETY_NET_S, never past the deadline) while it still holds
 * what was read.  `take` returns a new reference; anything but `nothing` (a
 * frame, a status, NULL with an exception) ends the wait, and `nothing` is
 * returned once the deadline has passed.  Signals run their Python handlers
 * here; one that raises (Ctrl-C) ends the wait with nothing held; a close of
 * the reader or the handle by another thread ends it with ValueError.
 * Returns NULL with no exception set when this case is the Python slow
 * path's: a group with statistics to flush (that takes the group lock) or a
 * growable spool due for an idle trim (trim_due: the reader trims after a
 * while). */
static PyObject *park_take(Cursor *c, PyObject *(*take)(Cursor *), PyObject *nothing, uint64_t deadline) {
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
        struct timespec ts = safety_net();
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
static int park_deadline(PyObject *block, PyObject *timeout, uint64_t *deadline) {
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
static PyObject *time_left(PyObject *timeout, uint64_t deadline) {
    if (!deadline) return Py_NewRef(timeout ? timeout : Py_None);
    uint64_t now = mono_ns();
    return PyFloat_FromDouble(now >= deadline ? 0.0 : (double)(deadline - now) / 1e9);
}

static PyObject *raise_empty(PyObject *timeout) {
    PyErr_Format(EmptyError ? EmptyError : PyExc_RuntimeError, "no frame within %S s", timeout);
    return NULL;
}

/* What get_api and get_obj_api do once a take found `nothing` and the call
 * may wait here (park_deadline): spin, then park until `deadline`.  A new
 * reference to what a take returned instead (a frame or an object, or a
 * status for Python); `nothing` when the wait is Python's to do (see
 * park_take); NULL with an exception, shmq.Empty once `timeout` passed. */
static PyObject *wait_take(Cursor *c, PyObject *(*take)(Cursor *), PyObject *nothing, uint64_t deadline,
                           PyObject *timeout) {
    if (spin_for_frame(c)) {
        PyObject *got = take(c);
        if (got != nothing) return got;
        Py_DECREF(got);
    }
    PyObject *got = park_take(c, take, nothing, deadline);
    if (got == nothing) { /* the deadline passed */
        Py_DECREF(got);
        return raise_empty(timeout);
    }
    if (!got && !PyErr_Occurred()) return Py_NewRef(nothing);
    return got;
}

static PyObject *Cursor_get_api(Cursor *c, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    /* Reader.get(block=True, timeout=None): a frame in one C call when one is
     * there; otherwise owner._get_slow(block, timeout, first_result). */
    static const char *const names[] = {"block", "timeout"};
    PyObject *a[2];
    if (parse_api(args, nargs, kwnames, names, 2, a) < 0) return NULL;
    if (cursor_check(c) < 0) return NULL;
    PyObject *f = take_one(c);
    if (!f) return NULL;
    if (Py_IS_TYPE(f, FrameType)) return f;
    uint64_t deadline;
    int parkable = f == Py_None && park_deadline(a[0], a[1], &deadline);
    if (parkable) {
        Py_DECREF(f);
        f = wait_take(c, take_one, Py_None, deadline, a[1]);
        if (!f || Py_IS_TYPE(f, FrameType)) return f; /* else None or a busy group lock: Python's */
    }
    PyObject *left = parkable ? time_left(a[1], deadline) : Py_NewRef(a[1] ? a[1] : Py_None);
    if (!left) {
        Py_DECREF(f);
        return NULL;
    }
    PyObject *cargs[3] = {a[0] ? a[0] : Py_True, left, f};
    PyObject *res = call_owner(c->owner, "_get_slow", cargs, 3);
    Py_DECREF(left);
    Py_DECREF(f);
    return res;
}

static PyObject *Cursor_get_obj_api(Cursor *c, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    /* shmq.Queue.get(block=True, timeout=None): the item in one C call when
     * one is there (raw or pickle); otherwise owner._get_slow(block, timeout). */
    static const char *const names[] = {"block", "timeout"};
    PyObject *a[2];
    if (parse_api(args, nargs, kwnames, names, 2, a) < 0) return NULL;
    PyObject *block = a[0] ? a[0] : Py_True, *timeout = a[1] ? a[1] : Py_None;
    uint64_t deadline = 0;
    /* a timeout is validated by Python first (even with an item there), unless it is one we can wait on */
    int parkable = block == Py_True && park_deadline(block, timeout, &deadline);
    if ((timeout == Py_None || parkable) && !c->closed_msg) {
        PyObject *o = Cursor_get_obj(c, NULL);
        if (o == EMPTY && parkable) {
            Py_DECREF(o);
            o = wait_take(c, get_obj_take, EMPTY, deadline, timeout);
        }
        if (!o) return NULL;
        if (o != EMPTY && o != STUCK && o != UNDECODED) return o;
        Py_DECREF(o);
        PyObject *left = parkable ? time_left(timeout, deadline) : Py_NewRef(timeout);
        if (!left) return NULL;
        PyObject *cargs[3] = {block, left, c->last ? UNDECODED : EMPTY}; /* UNDECODED: Python decodes .last */
        PyObject *res = call_owner(c->qowner, "_get_slow", cargs, 3);
        Py_DECREF(left);
        return res;
    }
    PyObject *cargs[3] = {block, timeout, EMPTY};
    return call_owner(c->qowner, "_get_slow", cargs, 3);
}

static PyObject *Cursor_bind(Cursor *c, PyObject *args) {
    PyObject *owner, *queue = Py_None;
    if (!PyArg_ParseTuple(args, "O|O", &owner, &queue)) return NULL;
    if (set_weak(&c->owner, owner) < 0) return NULL;
    if (queue != Py_None && set_weak(&c->qowner, queue) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *Cursor_get_last(Cursor *c, void *x) {
    PyObject *f = c->last ? c->last : Py_None;
    Py_INCREF(f);
    Py_CLEAR(c->last);
    return f;
}

static PyObject *Cursor_get_many(Cursor *c, PyObject *const *args, Py_ssize_t nargs) {
    /* get_many(max, lock_wait=None) -> list (maybe empty) or ST_LOCK_STUCK */
    Py_ssize_t max;
    double wait;
    if (many_args(c, args, nargs, "get_many(max, lock_wait=None)", &max, &wait) < 0) return NULL;
    return cursor_take(c, max, 1, wait, NULL, NULL);
}

static PyObject *Cursor_get_obj_many(Cursor *c, PyObject *const *args, Py_ssize_t nargs) {
    /* get_obj_many(max, lock_wait=None, unpickle=False): shmq.Queue.get_many
     * in one call, as get_obj for one item: take up to max frames (no Frame
     * objects), release the group lock, then leave raw payloads as they are
     * and, with unpickle (only for a spool whose trust was checked: shmq.Queue
     * does at attach), unpickle in-band pickles.  Returns the list of objects
     * (maybe empty), ST_LOCK_STUCK, or (list, indices) when frames of other
     * codecs were taken: those entries are Frames for Python's decoder.  An
     * item that fails to unpickle raises; the batch is taken. */
    Py_ssize_t max;
    double wait;
    if (many_args(c, args, nargs, "get_obj_many(max, lock_wait=None)", &max, &wait) < 0) return NULL;
    if (max < 1) {
        PyErr_SetString(PyExc_ValueError, "get_obj_many: max must be >= 1");
        return NULL;
    }
    /* Per call, not per cursor: unpickling below may run Python code, and
     * another thread may take from this cursor meanwhile. */
    int unpickle = nargs > 2 ? PyObject_IsTrue(args[2]) : 0;
    if (unpickle < 0) return NULL;
    Codes codes = {NULL, 0, unpickle};
    PyObject *out = cursor_take(c, max, 1, wait, NULL, &codes);
    if (!out || !PyList_Check(out)) {
        PyMem_Free(codes.v);
        return out; /* an error, or ST_LOCK_STUCK */
    }
    PyObject *undecoded = NULL;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(out); i++) {
        if (codes.v[i] == 1) {
            PyObject *o = PyObject_CallOneArg(pickle_loads, PyList_GET_ITEM(out, i));
            if (!o) goto fail;
            PyObject *old = PyList_GET_ITEM(out, i);
            PyList_SET_ITEM(out, i, o);
            Py_DECREF(old);
        } else if (codes.v[i] == CODE_FRAME) {
            if (!undecoded && !(undecoded = PyList_New(0))) goto fail;
            PyObject *ix = PyLong_FromSsize_t(i);
            if (!ix || PyList_Append(undecoded, ix) < 0) {
                Py_XDECREF(ix);
                goto fail;
            }
            Py_DECREF(ix);
        }
    }
    PyMem_Free(codes.v);
    return undecoded ? Py_BuildValue("(NN)", out, undecoded) : out;
fail:
    PyMem_Free(codes.v);
    Py_DECREF(out);
    Py_XDECREF(undecoded);
    return NULL;
}

static PyObject *Cursor_commit(Cursor *c, PyObject *unused) {
    if (cursor_check(c) < 0) return NULL;
    if (c->kind == K_NAMED) {
        named_commit(c);
        flush_locked(c);
        if (c->ring->policy != 0) ring_bell(c->ring, c->ring->fsem);
    }
    Py_RETURN_NONE;
}

static PyObject *Cursor_flush(Cursor *c, PyObject *args) {
    /* flush(lock_wait) -> True if flushed (groups take their lock; False: lock stuck) */
    double wait = c->ring->lock_wait;
    if (!PyArg_ParseTuple(args, "|d", &wait)) return NULL;
    if (c->closed_msg || !c->ring->have_buf || c->slot < 0) Py_RETURN_TRUE;
    if (c->kind == K_GROUP) {
        if (!c->n) Py_RETURN_TRUE;
        int lk = group_lock(c, wait);
        if (lk < 0) return NULL;
        if (lk > 0) Py_RETURN_FALSE;
        flush_locked(c);
        sem_post(c->gsem);
    } else {
        flush_locked(c);
    }
    Py_RETURN_TRUE;
}

static PyObject *Cursor_available(Cursor *c, PyObject *unused) {
    if (c->closed_msg || !c->ring->have_buf) Py_RETURN_TRUE; /* let the caller raise */
    uint64_t seq = c->kind == K_GROUP ? ld_acq(&cur_slot(c)[S_SEQ]) : c->seq;
    return PyBool_FromLong(seq < ld_acq(&c->ring->ctl[W_NEXT_SEQ]));
}

static PyObject *Cursor_close(Cursor *c, PyObject *args) {
    PyObject *msg = NULL;
    if (!PyArg_ParseTuple(args, "|U", &msg)) return NULL;
    if (!c->closed_msg) {
        c->closed_msg = msg ? Py_NewRef(msg) : PyUnicode_FromString("reader is closed");
        cursor_finish(c); /* now, or when the last thread waiting on the group lock is out */
    }
    Py_RETURN_NONE;
}

static PyObject *Cursor_add_lost(Cursor *c, PyObject *arg) {
    unsigned long long n = PyLong_AsUnsignedLongLong(arg);
    if (n == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    c->lost += n;
    c->lost_pending += n; /* published to the slot by the next flush */
    Py_RETURN_NONE;
}

static PyObject *Cursor_reset_stats(Cursor *c, PyObject *unused) {
    c->n = c->bytes = c->dsum = c->dmax = c->dcount = c->lost_pending = 0;
    Py_RETURN_NONE;
}

static int Cursor_init(Cursor *c, PyObject *args, PyObject *kw) {
    /* Cursor(ring, kind, slot, seq, pos, autocommit, verify, group_sem_name or None) */
    PyObject *ring;
    int kind, autocommit, verify;
    long long slot;
    unsigned long long seq, pos;
    PyObject *gname;
    if (!PyArg_ParseTuple(args, "O!iLKKppO", &RingType, &ring, &kind, &slot, &seq, &pos, &autocommit, &verify, &gname))
        return -1;
    Ring *r = (Ring *)ring;
    if (kind < 0 || kind > 2 || (kind != K_ANON && (slot < 0 || (uint64_t)slot >= r->slot_count))) {
        PyErr_SetString(PyExc_ValueError, "bad cursor kind or slot");
        return -1;
    }
    Py_XSETREF(c->ring, (Ring *)Py_NewRef(ring));
    c->kind = kind;
    c->slot = kind == K_ANON ? -1 : slot;
    c->seq = seq;
    c->pos = pos;
    c->released = pos;
    c->rng = (now_ns() ^ (uint64_t)(uintptr_t)c) | 1; /* xorshift state: never 0 */
    c->autocommit = autocommit;
    c->verify = verify;
    if (kind == K_GROUP) {
        if (!PyUnicode_Check(gname)) {
            PyErr_SetString(PyExc_TypeError, "a group cursor needs its semaphore name");
            return -1;
        }
        if (!(c->gsem = open_sem(PyUnicode_AsUTF8(gname)))) return -1;
    }
    return 0;
}

static void Cursor_dealloc(Cursor *c) {
    if (c->gsem) sem_close(c->gsem);
    Py_XDECREF(c->ring);
    Py_XDECREF(c->closed_msg);
    Py_XDECREF(c->last);
    Py_XDECREF(c->owner);
    Py_XDECREF(c->qowner);
    Py_TYPE(c)->tp_free((PyObject *)c);
}

#define U64_GETSET(field)                                                                         \
    static PyObject *Cursor_get_##field(Cursor *c, void *x) { return PyLong_FromUnsignedLongLong(c->field); } \
    static int Cursor_set_##field(Cursor *c, PyObject *v, void *x) {                              \
        unsigned long long n = PyLong_AsUnsignedLongLong(v);                                      \
        if (n == (unsigned long long)-1 && PyErr_Occurred()) return -1;                           \
        c->field = n;                                                                             \
        return 0;                                                                                 \
    }
U64_GETSET(seq)
U64_GETSET(lost)

static PyObject *Cursor_get_pos(Cursor *c, void *x) { return PyLong_FromUnsignedLongLong(c->pos); }

/* Python moves the cursor itself past frames it read outside the core (zero-copy
 * columnar reads, seek): those reads release the pages behind them too. */
static int Cursor_set_pos(Cursor *c, PyObject *v, void *x) {
    unsigned long long n = PyLong_AsUnsignedLongLong(v);
    if (n == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    c->pos = n;
    if (c->ring) release_behind(c->ring, &c->released, c->pos);
    return 0;
}

static PyObject *Cursor_get_pending(Cursor *c, void *x) { return PyLong_FromUnsignedLongLong(c->n); }

static PyGetSetDef Cursor_getset[] = {
    {"seq", (getter)Cursor_get_seq, (setter)Cursor_set_seq, "next seq (private cursors)", NULL},
    {"pos", (getter)Cursor_get_pos, (setter)Cursor_set_pos, "byte position of the next frame", NULL},
    {"lost", (getter)Cursor_get_lost, (setter)Cursor_set_lost, "frames skipped by this cursor", NULL},
    {"pending", (getter)Cursor_get_pending, NULL, "frames counted but not yet flushed to the slot", NULL},
    {"last", (getter)Cursor_get_last, NULL, "the frame get_obj() returned UNDECODED for (read once)", NULL},
    {NULL}};

static PyMethodDef Cursor_methods[] = {
    {"get", (PyCFunction)(void (*)(void))Cursor_get, METH_FASTCALL, "get(lock_wait=None) -> Frame | None | status"},
    {"get_obj_many", (PyCFunction)(void (*)(void))Cursor_get_obj_many, METH_FASTCALL,
     "get_obj_many(max, lock_wait=None, unpickle=False) -> [objects], ST_LOCK_STUCK, or ([objects and Frames], undecoded indices)"},
    {"get_many", (PyCFunction)(void (*)(void))Cursor_get_many, METH_FASTCALL,
     "get_many(max, lock_wait=None) -> list | status"},
    {"get_obj", (PyCFunction)Cursor_get_obj, METH_NOARGS, "get_obj() -> object | EMPTY | STUCK | UNDECODED"},
    {"get_api", (PyCFunction)(void (*)(void))Cursor_get_api, METH_FASTCALL | METH_KEYWORDS,
     "get(block=True, timeout=None) -> Frame (see shmq.Reader.get)"},
    {"get_obj_api", (PyCFunction)(void (*)(void))Cursor_get_obj_api, METH_FASTCALL | METH_KEYWORDS,
     "get(block=True, timeout=None) -> item (see shmq.Queue.get)"},
    {"bind", (PyCFunction)Cursor_bind, METH_VARARGS,
     "bind(reader, queue=None): their _get_slow completes get_api / get_obj_api"},
    {"commit", (PyCFunction)Cursor_commit, METH_NOARGS, "store the position in the slot (named readers)"},
    {"flush", (PyCFunction)Cursor_flush, METH_VARARGS, "publish counters to the slot"},
    {"available", (PyCFunction)Cursor_available, METH_NOARGS, "True if a frame is committed past the cursor"},
    {"close", (PyCFunction)Cursor_close, METH_VARARGS, "close(message): later calls raise ValueError(message)"},
    {"reset_stats", (PyCFunction)Cursor_reset_stats, METH_NOARGS, "drop unflushed counters (fork child)"},
    {"add_lost", (PyCFunction)Cursor_add_lost, METH_O, "count frames skipped outside the core"},
    {NULL}};

static PyTypeObject CursorType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "shmq._core.Cursor",
    .tp_basicsize = sizeof(Cursor),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Cursor_init,
    .tp_dealloc = (destructor)Cursor_dealloc,
    .tp_methods = Cursor_methods,
    .tp_getset = Cursor_getset,
    .tp_doc = "A reader's cursor over a Ring (internal: use Spool.reader).",
};

/* ---- Lock: a named semaphore + holder word, whose `with` is signal-safe ---- */

typedef struct {
    PyObject_HEAD
    Py_buffer words;
    int have_words;
    uint64_t *holder_word;
    uint64_t holder;
    sem_t *sem;
    double wait;
    PyObject *on_stuck;
    unsigned long owner; /* thread that holds it through this object, 0: none */
} Lock;

static int lock_open(Lock *l) {
    if (!l->have_words || !l->sem) {
        PyErr_SetString(PyExc_ValueError, "lock is closed");
        return -1;
    }
    return 0;
}

/* 0 acquired, 1 not within wait, -1 exception */
static int lock_take(Lock *l, double wait) {
    int rc = sem_lock(l->sem, wait);
    if (rc == 0) {
        st_rlx(l->holder_word, l->holder);
        l->owner = PyThread_get_thread_ident();
    }
    return rc;
}

static void lock_give(Lock *l) {
    l->owner = 0;
    st_rlx(l->holder_word, 0);
    sem_post(l->sem);
}

static PyObject *Lock_try_acquire(Lock *l, PyObject *args) {
    double wait = l->wait;
    if (!PyArg_ParseTuple(args, "|d", &wait)) return NULL;
    if (lock_open(l) < 0) return NULL;
    int rc = lock_take(l, wait);
    if (rc < 0) return NULL;
    return PyBool_FromLong(rc == 0);
}

static PyObject *Lock_release(Lock *l, PyObject *unused) {
    if (lock_open(l) < 0) return NULL;
    lock_give(l);
    Py_RETURN_NONE;
}

static PyObject *Lock_release_if_held(Lock *l, PyObject *unused) {
    if (l->have_words && l->sem && l->owner == PyThread_get_thread_ident()) lock_give(l);
    Py_RETURN_NONE;
}

static PyObject *Lock_enter(Lock *l, PyObject *unused) {
    /* Waits as long as it takes; every `wait` seconds without the lock,
     * on_stuck() (Python) may break a dead holder's lock or raise. */
    for (;;) {
        if (lock_open(l) < 0) return NULL;
        int rc = lock_take(l, l->wait);
        if (rc < 0) return NULL;
        if (rc == 0) return Py_NewRef((PyObject *)l);
        if (l->on_stuck && l->on_stuck != Py_None) {
            PyObject *res = PyUnicode_Check(l->on_stuck) ? PyObject_CallMethodObjArgs((PyObject *)l, l->on_stuck, NULL)
                                                         : PyObject_CallNoArgs(l->on_stuck);
            if (!res) return NULL;
            Py_DECREF(res);
        }
    }
}

static PyObject *Lock_exit(Lock *l, PyObject *args) {
    if (l->have_words && l->sem) lock_give(l);
    Py_RETURN_FALSE;
}

static PyObject *Lock_set_holder(Lock *l, PyObject *arg) {
    unsigned long long h = PyLong_AsUnsignedLongLong(arg);
    if (h == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    l->holder = h;
    l->owner = 0;
    Py_RETURN_NONE;
}

static void lock_release_res(Lock *l) {
    if (l->have_words) {
        PyBuffer_Release(&l->words);
        l->have_words = 0;
    }
    if (l->sem) {
        sem_close(l->sem);
        l->sem = NULL;
    }
}

static PyObject *Lock_close(Lock *l, PyObject *unused) {
    lock_release_res(l);
    Py_RETURN_NONE;
}

static int Lock_init(Lock *l, PyObject *args, PyObject *kw) {
    /* Lock(sem_name, words, index, holder, wait, on_stuck) -- words: a writable u64 buffer */
    const char *name;
    PyObject *words, *on_stuck;
    Py_ssize_t index;
    unsigned long long holder;
    double wait;
    if (!PyArg_ParseTuple(args, "sOnKdO", &name, &words, &index, &holder, &wait, &on_stuck)) return -1;
    lock_release_res(l);
    if (PyObject_GetBuffer(words, &l->words, PyBUF_WRITABLE) < 0) return -1;
    l->have_words = 1;
    if (index < 0 || (index + 1) * 8 > l->words.len || ((uintptr_t)l->words.buf % 8)) {
        lock_release_res(l);
        PyErr_SetString(PyExc_ValueError, "holder word out of range");
        return -1;
    }
    l->holder_word = (uint64_t *)l->words.buf + index;
    l->holder = holder;
    l->wait = wait;
    l->owner = 0;
    Py_XSETREF(l->on_stuck, Py_NewRef(on_stuck));
    if (!(l->sem = open_sem(name))) {
        lock_release_res(l);
        return -1;
    }
    return 0;
}

static int Lock_traverse(Lock *l, visitproc visit, void *arg) {
    Py_VISIT(l->on_stuck);
    return 0;
}

static int Lock_clear(Lock *l) {
    Py_CLEAR(l->on_stuck);
    return 0;
}

static void Lock_dealloc(Lock *l) {
    PyObject_GC_UnTrack(l);
    lock_release_res(l);
    Lock_clear(l);
    Py_TYPE(l)->tp_free((PyObject *)l);
}

static PyObject *Lock_get_held(Lock *l, void *x) { return PyBool_FromLong(l->owner == PyThread_get_thread_ident()); }

static PyGetSetDef Lock_getset[] = {{"held", (getter)Lock_get_held, NULL, "held by this thread", NULL}, {NULL}};

static PyMethodDef Lock_methods[] = {
    {"try_acquire", (PyCFunction)Lock_try_acquire, METH_VARARGS, "try_acquire(wait) -> True if now held"},
    {"release", (PyCFunction)Lock_release, METH_NOARGS, "clear the holder word and post, in one call"},
    {"release_if_held", (PyCFunction)Lock_release_if_held, METH_NOARGS, "release if this thread holds it"},
    {"set_holder", (PyCFunction)Lock_set_holder, METH_O, "the holder word recorded on acquire (after fork)"},
    {"close", (PyCFunction)Lock_close, METH_NOARGS, "release the buffer and the semaphore"},
    {"__enter__", (PyCFunction)Lock_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)Lock_exit, METH_VARARGS, NULL},
    {NULL}};

static PyTypeObject LockType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "shmq._core.Lock",
    .tp_basicsize = sizeof(Lock),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Lock_init,
    .tp_dealloc = (destructor)Lock_dealloc,
    .tp_traverse = (traverseproc)Lock_traverse,
    .tp_clear = (inquiry)Lock_clear,
    .tp_methods = Lock_methods,
    .tp_getset = Lock_getset,
    .tp_doc = "A cross-process lock on a named semaphore recording its holder in a shared word.\n"
              "Acquire and release are single C calls, so `with lock:` cannot be interrupted by a\n"
              "Python signal handler between taking the lock and entering the block.",
};

/* ---- Waiting: a waiter registration whose `with` is signal-safe ---- */

typedef struct {
    PyObject_HEAD
    sem_t *sem;
} Waiting;

static int Waiting_init(Waiting *w, PyObject *args, PyObject *kw) {
    const char *name;
    if (!PyArg_ParseTuple(args, "s", &name)) return -1;
    if (w->sem) sem_close(w->sem);
    w->sem = open_sem(name);
    return w->sem ? 0 : -1;
}

static PyObject *Waiting_enter(Waiting *w, PyObject *unused) {
    if (!w->sem) {
        PyErr_SetString(PyExc_ValueError, "closed");
        return NULL;
    }
    sem_post(w->sem); /* register: a full fence before the caller re-checks */
    return Py_NewRef((PyObject *)w);
}

static PyObject *Waiting_exit(Waiting *w, PyObject *args) {
    if (w->sem) sem_trywait(w->sem); /* EAGAIN: the count was reset (fsck --repair) */
    Py_RETURN_FALSE;
}

static PyObject *Waiting_close(Waiting *w, PyObject *unused) {
    if (w->sem) sem_close(w->sem);
    w->sem = NULL;
    Py_RETURN_NONE;
}

static void Waiting_dealloc(Waiting *w) {
    if (w->sem) sem_close(w->sem);
    Py_TYPE(w)->tp_free((PyObject *)w);
}

static PyMethodDef Waiting_methods[] = {{"__enter__", (PyCFunction)Waiting_enter, METH_NOARGS, NULL},
                                        {"__exit__", (PyCFunction)Waiting_exit, METH_VARARGS, NULL},
                                        {"close", (PyCFunction)Waiting_close, METH_NOARGS, NULL},
                                        {NULL}};

static PyTypeObject WaitingType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "shmq._core.Waiting",
    .tp_basicsize = sizeof(Waiting),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Waiting_init,
    .tp_dealloc = (destructor)Waiting_dealloc,
    .tp_methods = Waiting_methods,
    .tp_doc = "`with Waiting(name):` counts this waiter in a waiter semaphore for the block; enter and exit\n"
              "are single C calls, so a signal handler cannot leak or drop a registration.",
};

/* ---- module ---- */

/* set_notify(shmq._notify): park_take reads its SAFETY_NET_S (tests raise it). */
static PyObject *core_set_notify(PyObject *m, PyObject *mod) {
    Py_XSETREF(notify_module, Py_NewRef(mod));
    Py_RETURN_NONE;
}

/* The buffer_callback of dumps_inband: keep the buffer in-band, count it. */
static PyObject *core_inband(PyObject *m, PyObject *buf) {
    buffers_seen++;
    Py_RETURN_TRUE;
}

static PyObject *core_setup(PyObject *m, PyObject *args) {
    /* setup(SpoolFormatError, pickle.loads, pickle.dumps, protocol, Empty) */
    PyObject *fmt_err, *loads, *dumps, *protocol, *empty;
    if (!PyArg_ParseTuple(args, "OOOOO", &fmt_err, &loads, &dumps, &protocol, &empty)) return NULL;
    Py_XSETREF(EmptyError, Py_NewRef(empty));
    if (!dumps_kwnames && !(dumps_kwnames = Py_BuildValue("(s)", "buffer_callback"))) return NULL;
    if (!inband_callback && !(inband_callback = PyObject_GetAttrString(m, "_inband"))) return NULL;
    Py_XSETREF(SpoolFormatError, Py_NewRef(fmt_err));
    Py_XSETREF(pickle_loads, Py_NewRef(loads));
    Py_XSETREF(pickle_dumps, Py_NewRef(dumps));
    Py_XSETREF(dumps_protocol, Py_NewRef(protocol));
    Py_RETURN_NONE;
}

/* encode_batch(items) -> (tuple of frame items, codec), or None.  shmq.Queue.put_many's
 * encoder in one call when the batch is of one kind: every item bytes (raw,
 * codec 0) or every item pickled with no out-of-band buffer (codec 1).  None
 * for a mixed batch or one with buffers: the Python encoder's (shmq.codec). */
static PyObject *core_encode_batch(PyObject *m, PyObject *items) {
    if (!pickle_dumps) Py_RETURN_NONE;
    PyObject *seq = PySequence_Fast(items, "put_many() needs an iterable of objects");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject *out = PyTuple_New(n);
    if (!out) {
        Py_DECREF(seq);
        return NULL;
    }
    int codec = -1;
    unsigned long before = buffers_seen;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *o = PySequence_Fast_GET_ITEM(seq, i), *data;
        int kind = PyBytes_CheckExact(o) ? 0 : 1;
        if (codec >= 0 && kind != codec) goto python; /* mixed: item by item, in Python */
        codec = kind;
        if (kind == 0) {
            data = Py_NewRef(o);
        } else {
            if (!(data = dumps_inband(o))) {
                Py_DECREF(out);
                Py_DECREF(seq);
                return NULL;
            }
        }
        PyTuple_SET_ITEM(out, i, data);
        if (buffers_seen != before) goto python; /* out-of-band buffers: kept uncopied in Python */
    }
    Py_DECREF(seq);
    return Py_BuildValue("(Ni)", out, codec < 0 ? 0 : codec);
python:
    Py_DECREF(out);
    Py_DECREF(seq);
    Py_RETURN_NONE;
}

static PyObject *core_set_crash_hook(PyObject *m, PyObject *hook) {
    Py_XSETREF(crash_hook, hook == Py_None ? NULL : Py_NewRef(hook));
    Py_RETURN_NONE;
}

static PyObject *core_crc32(PyObject *m, PyObject *args) {
    Py_buffer b;
    unsigned int crc = 0;
    if (!PyArg_ParseTuple(args, "y*|I", &b, &crc)) return NULL;
    uint32_t v = crc_update(crc, b.buf, (size_t)b.len);
    PyBuffer_Release(&b);
    return PyLong_FromUnsignedLong(v);
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

static PyMethodDef core_methods[] = {
    {"setup", core_setup, METH_VARARGS, "setup(SpoolFormatError, pickle.loads, pickle.dumps, protocol, Empty)"},
    {"set_notify", core_set_notify, METH_O, "set_notify(shmq._notify): where park_take reads SAFETY_NET_S"},
    {"_inband", core_inband, METH_O, "put_obj_api's pickle buffer_callback: keep the buffer in-band"},
    {"set_crash_hook", core_set_crash_hook, METH_O, "fault-injection harness only"},
    {"encode_batch", core_encode_batch, METH_O,
     "encode_batch(items) -> (tuple of frame items, codec) for a batch of one kind, or None"},
    {"crc32", core_crc32, METH_VARARGS, "crc32(data, crc=0): the frame checksum (equals zlib.crc32)"},
    {NULL}};

static struct PyModuleDef core_module = {PyModuleDef_HEAD_INIT, "shmq._core",
                                         "The ring's hot path in C (internal; see docs/format.md).", -1,
                                         core_methods};

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

PyMODINIT_FUNC PyInit__core(void) {
    crc_init();
    if (PyType_Ready(&RingType) < 0 || PyType_Ready(&CursorType) < 0 || PyType_Ready(&ReservationType) < 0 ||
        PyType_Ready(&LockType) < 0 || PyType_Ready(&WaitingType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&core_module);
    if (!m) return NULL;
    FrameType = PyStructSequence_NewType(&frame_desc);
    if (!FrameType) return NULL;
    FrameType->tp_repr = frame_repr;
    PyType_Modified(FrameType);
    PyModule_AddObjectRef(m, "Frame", (PyObject *)FrameType);
    PyModule_AddObjectRef(m, "Ring", (PyObject *)&RingType);
    PyModule_AddObjectRef(m, "Cursor", (PyObject *)&CursorType);
    PyModule_AddObjectRef(m, "Reservation", (PyObject *)&ReservationType);
    PyModule_AddObjectRef(m, "Lock", (PyObject *)&LockType);
    PyModule_AddObjectRef(m, "Waiting", (PyObject *)&WaitingType);
    PyObject *layout = Py_BuildValue(
        "{si si si si si si si si si si si si si si si si si si si si si si si si si si si si si si si si si si si si si si si si si}",
        "HEADER_BYTES", HEADER_BYTES, "FRAME_BYTES", FRAME_BYTES, "ALIGN", ALIGN, "W_NEXT_SEQ", W_NEXT_SEQ,
        "W_NEXT_POS", W_NEXT_POS, "W_FIRST_SEQ", W_FIRST_SEQ, "W_FIRST_POS", W_FIRST_POS, "W_LOCK_HOLDER",
        W_LOCK_HOLDER, "W_PUT_BYTES", W_PUT_BYTES, "W_LAST_PUT_NS", W_LAST_PUT_NS, "W_EVICTED", W_EVICTED,
        "W_HIGH_FRAMES", W_HIGH_FRAMES, "W_HIGH_BYTES", W_HIGH_BYTES, "W_SLOT_HWM", W_SLOT_HWM, "W_RATE", W_RATE,
        "RATE_SECONDS", RATE_SECONDS, "RATE_WORDS", RATE_WORDS, "DOORBELL_BYTE", DOORBELL_BYTE, "SLOT_BYTES",
        SLOT_BYTES, "SLOT_WORDS", SLOT_WORDS, "S_STATE", S_STATE, "S_SEQ", S_SEQ, "S_POS", S_POS, "S_LOST", S_LOST,
        "S_GETS", S_GETS, "S_GET_BYTES", S_GET_BYTES, "S_LAST_GET_NS", S_LAST_GET_NS, "S_DELAY_SUM_NS",
        S_DELAY_SUM_NS, "S_DELAY_MAX_NS", S_DELAY_MAX_NS, "S_LAG_HIGH", S_LAG_HIGH, "S_LAG_LOW", S_LAG_LOW,
        "S_LOCK_HOLDER", S_LOCK_HOLDER, "S_DELAY_COUNT", S_DELAY_COUNT, "W_ALLOC_MIN", W_ALLOC_MIN, "W_ALLOC", W_ALLOC, "W_HOLE_LO", W_HOLE_LO, "W_HOLE_HI", W_HOLE_HI, "W_SEGMENT", W_SEGMENT,
        "W_GROWTHS", W_GROWTHS, "W_DATA_BELL", W_DATA_BELL, "W_SPACE_BELL", W_SPACE_BELL);
    if (!layout) return NULL;
    PyModule_AddObject(m, "LAYOUT", layout);
    EMPTY = PyObject_CallNoArgs((PyObject *)&PyBaseObject_Type);
    STUCK = PyObject_CallNoArgs((PyObject *)&PyBaseObject_Type);
    UNDECODED = PyObject_CallNoArgs((PyObject *)&PyBaseObject_Type);
    if (!EMPTY || !STUCK || !UNDECODED) return NULL;
    PyModule_AddObjectRef(m, "EMPTY", EMPTY);
    PyModule_AddObjectRef(m, "STUCK", STUCK);
    PyModule_AddObjectRef(m, "UNDECODED", UNDECODED);
    PyModule_AddIntConstant(m, "LOCK_STUCK", ST_LOCK_STUCK);
    PyModule_AddIntConstant(m, "NO_ROOM", ST_NO_ROOM);
    PyModule_AddIntConstant(m, "SLOW", ST_SLOW);
    PyModule_AddIntConstant(m, "TOO_LARGE", ST_TOO_LARGE);
    PyModule_AddIntConstant(m, "NO_SPACE", ST_NO_SPACE);
    PyModule_AddIntConstant(m, "BACKLOG", ST_BACKLOG);
    return m;
}
