/*
 * shmq/engine/engine.h: the engine's internal header -- its structs, the
 * small inline helpers every file uses, and what one file offers another.
 * Not installed: the API is shmq.h.  The Python binding (shmq/core/) and
 * the ThreadSanitizer harness build on it too.
 *
 * Map of the files (docs/format.md, "The engine"):
 *   shmq_layout.h the on-disk layout (the one hand-written source)
 *   shmq.h        the public C API
 *   engine.h      this header
 *   take.h        the lock-free read loop and the takes, inline (a caller's sink known)
 *   crc.c         CRC-32; error codes, messages
 *   copy.c        payload copies at distances x86-64's rep movsb is slow at
 *   sem.c         named semaphores: create, open (refusing squatted names), unlink
 *   lock.c        semaphore locks with a deadline, holder words, the handle lock, dead-holder recovery
 *   wait.c        doorbells, the writer's wait for a catching-up consumer, parked reads
 *   write.c       placement, eviction and commit: put, put_many, reserve
 *   zone.c        growable rings: the hot zone's pages (allocate, punch, trim)
 *   read.c        first cursor, resync, page release, reader statistics, group locks
 *   inspect.c     frame headers, control-word checks, writer-death repair (fsck shares them)
 *   ring.c        one mapping: init, release, locate, latest, trim
 *   slots.c       the reader table: find, attach, liveness locks, pins
 *   spool.c       files: geometry, open by path, create, destroy
 *   api.c         shmq.h
 *
 * No Python, and no reliance on a global interpreter lock: the engine
 * carries its own thread safety.  A handle's writer-side state is guarded
 * by the writer lock (the spool's semaphore, which threads of a process
 * contend for as processes do); a private cursor by its own spin lock; a
 * group cursor by the group's semaphore; the counters that defer a close
 * while another thread waits are atomics.  A caller that holds a lock of
 * its own across calls (the Python binding: the GIL) hands the engine
 * hooks to drop it around every blocking wait (eng_hooks).
 *
 * Memory ordering (C11 atomics, correct on x86-64 and aarch64):
 *   writer: payload and header stores, then a release store of NEXT_SEQ
 *           (the commit point); eviction stores FIRST_POS, then a release
 *           fence, before any byte of the evicted region is overwritten.
 *   reader: acquire load of NEXT_SEQ, copy, acquire fence, load FIRST_POS:
 *           a frame is intact iff FIRST_POS did not pass it (seqlock).
 *
 * Every length, offset and sequence number read from the shared mapping is
 * bounds-checked before use: a corrupt or hostile file makes a call fail
 * with SHMQ_ECORRUPT, never read outside the mapping.
 */
#ifndef SHMQ_ENGINE_H
#define SHMQ_ENGINE_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* fallocate, F_OFD_*, sem_clockwait, MADV_* */
#endif
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <semaphore.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "shmq.h"

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23 /* Linux 5.14; older kernels refuse it (EINVAL): only a missed optimization */
#endif

/* Hot loops whose callers pass constant callbacks: inlined so the calls are direct. */
#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* ---- limits the engine applies ---- */
#define MAX_BATCH 65536       /* frames per put_many */
#define MAX_SEGS 64           /* segments of one frame (a Python tuple's items) */
#define STATS_FLUSH_FRAMES 64 /* a reader publishes its counters at least this often */

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

static inline unsigned long this_thread(void) { return (unsigned long)pthread_self(); }

/* ---- errors: codes are shmq.h's; the detail is the thread's message ---- */
int eng_fail(int code, const char *fmt, ...) __attribute__((format(printf, 2, 3))); /* sets the message, returns code */
void eng_clear_error(void);

/* ---- tracing a C take's copies: the ThreadSanitizer harness only ----
 * Built with -DSHMQ_TRACE_COPIES, the C API's sink (api.c) reports every copy
 * it makes out of the ring and what became of it to four functions the
 * program defines (stress/tsan_harness/harness.c, whose report classifier
 * needs them: reports.h).  Without it -- libshmq, the binding -- nothing. */
#ifdef SHMQ_TRACE_COPIES
void eng_trace_copy_begin(const void *frame, const void *end, uint64_t seq); /* about to copy frame seq at [frame, end) */
void eng_trace_copy_done(void);                                /* copied, not yet checked */
void eng_trace_copy_dropped(void);                             /* overwritten meanwhile: discarded */
void eng_trace_copy_accepted(void);                            /* passed the check: returned */
#define TRACE_COPY_BEGIN(frame, end, seq) eng_trace_copy_begin((frame), (end), (seq))
#define TRACE_COPY_DONE() eng_trace_copy_done()
#define TRACE_COPY_DROPPED() eng_trace_copy_dropped()
#define TRACE_COPY_ACCEPTED() eng_trace_copy_accepted()
#else
#define TRACE_COPY_BEGIN(frame, end, seq) ((void)0)
#define TRACE_COPY_DONE() ((void)0)
#define TRACE_COPY_DROPPED() ((void)0)
#define TRACE_COPY_ACCEPTED() ((void)0)
#endif

/* ---- hooks of a caller that holds a lock of its own (the binding: the GIL) ---- */
typedef struct eng_hooks {
    void *(*unlock)(void);        /* before a blocking wait: drop the caller's lock */
    void (*relock)(void *saved);  /* after it */
    int (*interrupted)(void);     /* after a wait woke (a signal, say): nonzero ends it (SHMQ_ECALLBACK) */
    int (*crash)(void *ctx, const char *point); /* fault injection: nonzero aborts (SHMQ_ECALLBACK) */
    void *crash_ctx;
    double safety_net_s;          /* the longest futex sleep of a parked wait (0: 0.1 s) */
} eng_hooks;

static inline void *hooks_unlock(const eng_hooks *h) { return h && h->unlock ? h->unlock() : NULL; }
static inline void hooks_relock(const eng_hooks *h, void *s) {
    if (h && h->relock) h->relock(s);
}
static inline int hooks_interrupted(const eng_hooks *h) { return h && h->interrupted ? h->interrupted() : 0; }

/* ---- the ring: one spool mapping ---- */
struct eng_resv;
typedef struct eng_ring {
    char *base;
    uint64_t *ctl, *slots;
    char *ring;
    uint64_t map_bytes, ring_bytes, ring_offset, slot_count, max_payload;
    uint64_t segment; /* growable spools: W_SEGMENT, read once at init (0: fixed) */
    int policy, checksum, fd;
    uint64_t holder;  /* this process's holder word (eng_holder_word) */
    sem_t *wsem, *rsem, *fsem;
    double lock_wait; /* how long a put waits for the lock before reporting it stuck */
    double recovery_timeout;
    const eng_hooks *hooks;
    const char *path; /* for messages (the owner keeps it alive) */
    /* Guarded by the writer lock (one holder at a time, any thread): */
    uint64_t rate_until;
    int rate_word;
    uint64_t lap_ns;               /* growable: when this handle last wrapped early (0: not yet) */
    uint64_t hot_retry;            /* no wait for an early wrap below this position (hot_wait: one in vain) */
    uint64_t wrap_lag;             /* growable: an early wrap may leave this many bytes unread behind (zone_place);
                                    * 0: only once every consumer is caught up.  Set before the first put. */
    struct eng_resv *resv;         /* the open reservation (it holds the writer lock) */
    /* Guarded by pop_busy (one thread pre-faults at a time, see eng_write): */
    uint64_t pop_start;            /* ring positions this handle pre-faulted: [pop_start, pop_pos) */
    _Atomic uint64_t pop_pos;
    _Atomic int pop_state;         /* 0 not started, 1 going, 2 done or unsupported */
    _Atomic int pop_busy;
    /* Any thread: */
    _Atomic int busy;                       /* threads inside a blocking section of this handle */
    _Atomic int closing;                    /* a close came while busy: the last one out releases */
    _Atomic unsigned long resv_thread;      /* the thread holding the open reservation */
    _Atomic unsigned long callout_thread;   /* a thread running a write's callout under the lock */
    void (*unmap)(struct eng_ring *r);      /* the owner's release of the mapping (deferred close) */
    void *owner;
    /* Lock recovery state of the writer lock (eng_lock_recover). */
    double unknown_since, unknown_last;
    pthread_mutex_t recover_mu;
} eng_ring;

/* What a ring is made from: the mapping (the owner keeps it mapped until
 * unmap) and the geometry the owner decoded and checked. */
typedef struct {
    char *base;
    uint64_t map_bytes, ring_offset, ring_bytes, slot_offset, slot_count;
    int policy, checksum, fd; /* fd: duplicated (the ring owns its copy) */
    const char *wsem, *rsem, *fsem; /* semaphore names (opened as they are, not created) */
    uint64_t holder;
    double lock_wait, recovery_timeout;
    const char *path;
    const eng_hooks *hooks;
} eng_ring_spec;

typedef struct eng_resv {
    eng_ring *ring;
    uint64_t seq, off, nbytes, stored, end, start; /* start: NEXT_POS when placed (see unplace) */
    int codec;
    uint8_t open;
    uint8_t sync; /* set before eng_reserve: the commit msyncs the frame first and the header page after */
} eng_resv;

/* ---- a cursor: a reader's position ---- */
enum { K_ANON = 0, K_NAMED = 1, K_GROUP = 2 };

typedef struct {
    eng_ring *ring;
    uint64_t seq, pos, lost;
    int64_t slot;
    int kind, autocommit, verify;
    sem_t *gsem;
    uint64_t n, bytes, dsum, dmax, dcount, lag_peak, lost_pending;
    uint64_t rng;      /* xorshift state of delay_clock */
    uint64_t released; /* ring position up to which this cursor released its pages */
    uint64_t known;    /* a NEXT_SEQ loaded before: frames below it are committed */
    uint64_t last_len; /* the payload length of the frame taken last (eng_spin_for_frame) */
    _Atomic int busy;  /* threads waiting for the group lock or parked (close deferred) */
    _Atomic int closed;
    _Atomic unsigned long mu; /* a private cursor's take lock: the holding thread (eng_cursor_lock) */
    double unknown_since, unknown_last; /* group lock recovery */
    pthread_mutex_t recover_mu;
} eng_cursor;

/* A private cursor's takes are atomic for the threads sharing it: a lock
 * held for the copy only (never across a wait).  Uncontended it is one
 * compare-and-swap; contended, the waiter spins a moment, then yields with
 * the caller's own lock dropped (the holder may need it to finish: the GIL).
 * 0, or SHMQ_ESTATE when the thread already holds it (a re-entrant take,
 * e.g. from a finalizer run inside a copy). */
int eng_cursor_lock_slow(eng_cursor *c, unsigned long me);
static inline int eng_cursor_lock(eng_cursor *c) {
    unsigned long me = this_thread(), free_ = 0;
    if (atomic_compare_exchange_strong_explicit(&c->mu, &free_, me, memory_order_acquire, memory_order_relaxed))
        return 0;
    return eng_cursor_lock_slow(c, me);
}
static inline void eng_cursor_unlock(eng_cursor *c) { atomic_store_explicit(&c->mu, 0, memory_order_release); }

/* ---- one frame of a batch: up to MAX_SEGS segments written one after the other ---- */
typedef struct {
    const void *buf;
    size_t len;
} eng_seg;
typedef struct {
    const eng_seg *segs;
    int nsegs;
    uint64_t n;
    uint32_t crc;
    /* a payload of n bytes written in place under the writer lock (nsegs 0): 0 or SHMQ_ECALLBACK */
    int (*fill)(void *ctx, char *dst, uint64_t n);
    void *fill_ctx;
} eng_item;

/* What a write asks beyond the plain path (NULL: none). */
typedef struct {
    /* before_commit(ctx, first seq, positions, count) once placed, before any byte is written */
    int (*before_commit)(void *ctx, uint64_t seq0, const uint64_t *placed, size_t count);
    void *ctx;
    const uint64_t *timestamps; /* one per frame (ns), replacing the put time in its header */
    int sync;                   /* msync the batch's pages before the commit, the header page after it */
    int deferred;               /* some item has a fill: filled in place, crc after */
} eng_wopts;

/* Where a batch goes: a frame that does not fit before the ring's end is
 * preceded by padding to the end (a PAD header if 32+ bytes remain); a batch
 * wraps at most twice. */
typedef struct {
    uint64_t seq0, start, end; /* first seq, NEXT_POS before, NEXT_POS after */
    int npads;
    uint64_t pads_off[2], pads_gap[2];
    size_t pads_k[2];
} Placement;

/* The whole batch at the start of a lap: one pad of `gap` bytes at ring
 * offset `n_off` (to the ring's end), then the frames back to back from
 * `lap_start` (placed[k] each; pl->end after the last). */
static inline void place_at_lap(Placement *pl, uint64_t *placed, const uint64_t *needs, size_t count,
                                uint64_t n_off, uint64_t gap, uint64_t lap_start) {
    pl->npads = 1;
    pl->pads_off[0] = n_off;
    pl->pads_gap[0] = gap;
    pl->pads_k[0] = 0;
    uint64_t p = lap_start;
    for (size_t k = 0; k < count; k++) {
        placed[k] = p;
        p += needs[k];
    }
    pl->end = p;
}

/* ---- copying a payload into or out of the ring (copy.c) ----
 * memcpy, except for a copy of ENG_COPY_APART_MIN bytes to under ENG_COPY_APART_MAX
 * whose destination is 1 to 63 bytes past its source modulo 4096, which
 * x86-64's rep movsb (glibc's memcpy for such sizes) runs 16 to 33 times
 * slower on some CPUs (an AMD EPYC VM): copy.c's loop does those. */
#if defined(__x86_64__) && defined(__SSE2__)
#define ENG_COPY_APART 1
#define ENG_COPY_APART_MIN 2048u         /* below glibc's rep movsb threshold */
#define ENG_COPY_APART_MAX (1u << 20)    /* slow up to 256 KiB, not from 512 KiB (measured); a margin */
void eng_copy_apart(void *dst, const void *src, size_t n);
#else
#define ENG_COPY_APART 0
#endif
static inline void eng_copy(void *dst, const void *src, size_t n) {
#if ENG_COPY_APART
    if (n - ENG_COPY_APART_MIN < ENG_COPY_APART_MAX - ENG_COPY_APART_MIN &&
        ((((uintptr_t)dst - (uintptr_t)src) & 4095) - 1) < 63) {
        eng_copy_apart(dst, src, n);
        return;
    }
#endif
    memcpy(dst, src, n);
}

/* ---- small helpers ---- */
static inline void read_header(eng_ring *r, uint64_t off, shmq_frame_header *h) {
    memcpy(h, r->ring + off, SHMQ_FRAME_BYTES);
}

/* The header at or after ring position *pos, unchecked: a tail shorter than
 * a header is skipped (*pos moves on to the ring's start).  Returns the
 * header's ring offset. */
static inline uint64_t read_header_at(eng_ring *r, uint64_t *pos, shmq_frame_header *h) {
    uint64_t ring = r->ring_bytes, off = *pos % ring;
    if (ring - off < SHMQ_FRAME_BYTES) {
        *pos += ring - off;
        off = 0;
    }
    read_header(r, off, h);
    return off;
}

/* The one check of a decoded frame header: its lengths keep it inside the ring. */
static inline int header_sane(const shmq_frame_header *h, uint64_t off, uint64_t ring) {
    return (uint64_t)h->stored >= SHMQ_FRAME_BYTES + (uint64_t)h->length && h->stored % SHMQ_ALIGN == 0 &&
           off + h->stored <= ring;
}

static inline void wlock_release(eng_ring *r) {
    st_rlx(&r->ctl[SHMQ_W_LOCK_HOLDER], 0);
    sem_post(r->wsem); /* a release operation: the holder word and all writes are visible first */
}

/* The 32-bit futex word of a doorbell: the low half of control word `word`
 * (little-endian: x86-64 and aarch64 Linux, the supported platforms). */
static inline _Atomic uint32_t *bell_word(eng_ring *r, int word) { return (_Atomic uint32_t *)&r->ctl[word]; }

static inline uint64_t *cur_slot(eng_cursor *c) { return c->ring->slots + c->slot * SHMQ_SLOT_WORDS; }

/* The fault-injection hook at `point`: 0, or SHMQ_ECALLBACK. */
static inline int crash_point(eng_ring *r, const char *point) {
    const eng_hooks *h = r->hooks;
    return h && h->crash && h->crash(h->crash_ctx, point) ? SHMQ_ECALLBACK : 0;
}
static inline int crash_armed(eng_ring *r) { return r->hooks && r->hooks->crash; }

/* A blocking section of a handle: busy (a close meanwhile is deferred) and the caller's lock dropped. */
static inline void *ring_block(eng_ring *r) {
    atomic_fetch_add_explicit(&r->busy, 1, memory_order_acq_rel);
    return hooks_unlock(r->hooks);
}
void ring_finish(eng_ring *r);
static inline void ring_unblock(eng_ring *r, void *saved) {
    hooks_relock(r->hooks, saved);
    atomic_fetch_sub_explicit(&r->busy, 1, memory_order_acq_rel);
}
static inline int ring_closing(eng_ring *r) { return atomic_load_explicit(&r->closing, memory_order_acquire); }

/* ---- crc.c ---- */
uint32_t eng_crc(uint32_t crc, const unsigned char *p, size_t n);

/* ---- sem.c: named semaphores ---- */
enum { ENG_SEM_OPEN = 0, ENG_SEM_CREATE = 1, ENG_SEM_EXISTING = 2 };
sem_t *eng_sem_open(const char *name, unsigned initial, unsigned mode, long owner, long group, int how, int *err);
int eng_sem_check(const char *name, long owner, unsigned mode, long group);
int eng_sem_unlink(const char *name);

/* ---- lock.c: semaphore locks and their recovery ---- */
int eng_sem_lock(sem_t *s, double wait_s, const eng_hooks *hooks, eng_ring *busy, uint64_t *word,
                 uint64_t holder);
uint64_t eng_holder_word(void);
uint64_t eng_process_start(int pid);
int eng_process_alive(int pid, uint64_t start, int check_start);
int eng_ofd_lock(int fd, uint64_t byte, int exclusive, int wait);
int eng_ofd_unlock(int fd, uint64_t byte);
int eng_ofd_locked_by_other(int fd, uint64_t byte);
#define ENG_HANDLE_LOCK_WAIT_S 5.0 /* the C API's wait for the handle lock (shmq._lock.HANDLE_LOCK_WAIT_S) */
int eng_hold_handle_lock(int fd, double wait_s, const eng_hooks *hooks);
typedef struct {
    sem_t *sem;
    uint64_t *holder, *token, *breaks; /* shared words; breaks may be NULL */
    int fd;
    uint64_t recovery_byte;
    double recovery_timeout;
    double *unknown_since, *unknown_last; /* the looks of this lock's waits (per handle) */
    uint64_t me;                          /* the holder word recorded when broken */
    int (*on_recover)(void *ctx, uint32_t dead_pid); /* repair, holding the lock: 0 or < 0 */
    void *ctx;
    pthread_mutex_t *mu;     /* orders this process's threads, which share the descriptor (or NULL) */
    const eng_hooks *hooks;  /* the wait for the recovery byte drops the caller's lock */
} eng_lock_ref;
int eng_lock_recover(const eng_lock_ref *l);
void eng_writer_lock_ref(eng_ring *r, eng_lock_ref *l);
void eng_group_lock_ref(eng_cursor *c, eng_lock_ref *l);

/* ---- wait.c ---- */
int ring_closed_meanwhile(eng_ring *r, int held, sem_t *s);
void ring_bell(eng_ring *r, sem_t *waiters);
void ring_space(eng_ring *r);
int room_state(eng_ring *r, int publish);
void room_unwant(eng_ring *r);
int wait_caught_up(eng_ring *r, uint64_t start, uint64_t lag, uint64_t lap_share);
int wait_floor(eng_ring *r, uint64_t start, uint64_t budget_ns, uint64_t stall_ns);
/* The hot region (write.c): a fixed ring's first HOT_BYTES, and how far into
 * its zone a growable ring waits for its consumers to wrap early (zone.c). */
#define HOT_BYTES ((uint64_t)8 << 20)
#define HOT_RING_MAX ((uint64_t)64 << 20) /* read.c's KEEP_WHOLE: readers keep their pages */
/* Consumers this close are waited for: HOT_LAG bytes, or HOT_LAG_BATCHES of
 * the writer's batches, at most the hot region.  A consumer of 1 MiB frames
 * keeping up is at times 3 or more frames behind when the writer reaches the
 * region's end (1-3 times in a run of 2,000): with only two batches waited
 * for, each such time would send the writer on a whole cold lap (56 MiB of
 * fresh or evicted pages), a quarter of the run's speed. */
#define HOT_LAG ((uint64_t)64 << 10)
#define HOT_LAG_BATCHES 8
int hot_wait(eng_ring *r, uint64_t start, uint64_t floor, uint64_t total, uint64_t cap);
int eng_spin_for_frame(eng_cursor *c, uint64_t deadline);
/* The same spin for `limit` ns (the caller's rule, e.g. a zero-copy reader's,
 * whose reads do not set last_len), the caller's lock dropped past
 * CAUGHT_UP_SPIN_NS.  1 if a frame is there now. */
int eng_spin(eng_cursor *c, uint64_t limit, uint64_t deadline);
/* How long a caught-up reader whose last frame was `last_len` bytes spins
 * before it parks, in ns (the rule above eng_spin_for_frame). */
uint64_t eng_spin_ns(uint64_t last_len);
/* A take for eng_park: 1 got something, 0 nothing, < 0 an error. */
typedef int (*eng_take_fn)(void *ctx);
int eng_park(eng_cursor *c, eng_take_fn take, void *ctx, uint64_t deadline);
int eng_bell_wait(eng_ring *r, int space, uint32_t seen, double timeout);
uint32_t eng_bell_seen(eng_ring *r, int space);

/* ---- write.c ---- */
uint64_t slot_hwm(eng_ring *r);
int slot_floor(eng_ring *r, int word, uint64_t *out);
/* The position a blocked writer's room follows: the slowest named cursor,
 * or FIRST_POS when there is none (a block ring then keeps every frame:
 * make_room), so that only a consumer that appears and reads moves it. */
static inline uint64_t room_floor(eng_ring *r) {
    uint64_t f;
    return slot_floor(r, SHMQ_S_POS, &f) ? f : ld_rlx(&r->ctl[SHMQ_W_FIRST_POS]);
}
uint64_t pin_floor(eng_ring *r);
void take_full_marker(eng_ring *r);
/* What the calling thread's last write that found no room needs (a room
 * position / seq of the slowest cursor that makes it fit) and wants (one
 * that makes a burst fit); 0: none.  Taken under the writer lock with the
 * full marker (take_room_need), read by the same thread's room_state. */
typedef struct {
    uint64_t need_pos, need_seq, want_pos, want_seq;
} eng_room;
extern _Thread_local eng_room eng_room_of_thread;
void take_room_need(eng_ring *r, uint64_t need_pos, uint64_t floor_pos, uint64_t need_seq, uint64_t floor_seq,
                    uint64_t backlog);
void eng_full_marker(uint64_t *floor, uint64_t *pin);
void room_marker(eng_ring *r, uint64_t *floor, uint64_t *pin);
int make_room(eng_ring *r, uint64_t limit, uint64_t next_seq, uint64_t batch_pos);
int place_batch(eng_ring *r, size_t count, const uint64_t *needs, uint64_t total, int64_t max_backlog,
                uint64_t *placed, Placement *pl);
void write_pads(eng_ring *r, const Placement *pl, uint64_t ts);
void commit_batch(eng_ring *r, uint64_t next_seq, uint64_t end, uint64_t count, uint64_t nbytes, uint64_t ts);
void unplace(eng_ring *r, uint64_t seq0, uint64_t start);
int64_t write_locked(eng_ring *r, eng_item *items, size_t count, uint64_t *needs, uint64_t total, int codec,
                     int64_t max_backlog, uint64_t *placed, const eng_wopts *o);
void populate_ahead(eng_ring *r, uint64_t pos, uint64_t len);
void eng_item_crc(eng_item *it);
int64_t eng_write(eng_ring *r, eng_item *items, size_t count, int codec, int64_t max_backlog, double lock_wait,
                  int patient, const eng_wopts *o);
int eng_sync_ring(eng_ring *r, uint64_t a, uint64_t b);
int eng_sync_header(eng_ring *r);

/* ---- zone.c ---- */
int trim_due(eng_ring *r);
int zone_place(eng_ring *r, uint64_t start, size_t count, const uint64_t *needs, uint64_t total, uint64_t *placed,
               Placement *pl, uint64_t next_seq);
int zone_alloc(eng_ring *r, uint64_t a, uint64_t b);
int zone_punch(eng_ring *r, uint64_t a, uint64_t b);
int trim_locked(eng_ring *r);

/* ---- reserve.c (write.c) ---- */
int reserve_locked(eng_ring *r, uint64_t nbytes, eng_resv *rv);
int commit_reserved(eng_ring *r, const eng_resv *rv);
int writer_reentry_slow(eng_ring *r, const char *what);
/* 0, or SHMQ_ESTATE if this thread holds the writer lock already, through an
 * open reservation or a callout of this handle: `what` (a put, a reserve)
 * would wait for itself.  Inline: the common case is two relaxed loads. */
static inline int writer_reentry(eng_ring *r, const char *what) {
    if (!atomic_load_explicit(&r->resv_thread, memory_order_relaxed) &&
        !atomic_load_explicit(&r->callout_thread, memory_order_relaxed))
        return 0;
    return writer_reentry_slow(r, what);
}
int eng_reserve(eng_ring *r, uint64_t nbytes, int codec, double lock_wait, eng_resv *rv);
int64_t eng_resv_commit(eng_resv *rv);
void eng_resv_abandon(eng_resv *rv);

/* ---- read.c ---- */
int first_cursor(eng_ring *r, uint64_t *oseq, uint64_t *opos);
int resync(eng_ring *r, uint64_t *seq, uint64_t *pos, const shmq_frame_header *h, uint64_t off, uint64_t *lost);
void release_behind(eng_ring *r, uint64_t *released, uint64_t pos);
void flush_locked(eng_cursor *c);
/* A named reader's commit: its cursor to its slot (position first: see resync). */
static inline void named_commit(eng_cursor *c) {
    uint64_t *s = cur_slot(c);
    st_rel(&s[SHMQ_S_POS], c->pos);
    st_rel(&s[SHMQ_S_SEQ], c->seq);
}
int eng_cursor_init(eng_cursor *c, eng_ring *r, int kind, int64_t slot, uint64_t seq, uint64_t pos, int autocommit,
                    int verify, const char *gsem);
void eng_cursor_close(eng_cursor *c);
void eng_cursor_finish(eng_cursor *c);
int eng_cursor_check(eng_cursor *c);
int group_lock(eng_cursor *c, double wait, uint64_t *word, uint64_t holder);
void group_unlock(eng_cursor *c, uint64_t *word);
int eng_cursor_available(eng_cursor *c);
int eng_cursor_commit(eng_cursor *c);
int eng_cursor_flush(eng_cursor *c, double wait);
int eng_locate(eng_ring *r, uint64_t want, uint64_t hseq, uint64_t hpos, uint64_t *out);

/* ---- inspect.c: what the engine, fsck, repair and dump share ---- */
typedef struct {
    uint64_t seq, pos, stored, length, ts, crc, flags, codec; /* pos: past the short-tail skip */
    int sane;                                                 /* header_sane: inside the ring */
} eng_hit;
void eng_header_at(const char *ring, uint64_t ring_bytes, uint64_t pos, eng_hit *out);
int eng_control_problems(const uint64_t *ctl, uint64_t ring_bytes, char *msg, size_t cap);
int eng_repair_control(uint64_t *ctl, const char *ring, uint64_t ring_bytes, int drop_unreadable,
                               char *log, size_t cap);
int eng_first_cursor(uint64_t *ctl, const char *ring, uint64_t ring_bytes, uint64_t *oseq, uint64_t *opos);

/* ---- ring.c ---- */
int eng_ring_init(eng_ring *r, const eng_ring_spec *s);
void eng_ring_release(eng_ring *r);
int eng_latest(eng_ring *r, double wait, uint64_t *seq, uint64_t *pos);
int eng_trim(eng_ring *r, double wait);

/* ---- slots.c ---- */
int eng_slot_find(eng_ring *r, const char *name, size_t len);
int eng_slot_attach(eng_ring *r, const char *name, int kind, int latest);
int eng_slot_hold(eng_ring *r, int64_t i, int exclusive);
void eng_slot_let_go(eng_ring *r, int64_t i);
int eng_reclaim_pins(eng_ring *r, uint64_t limit, int64_t mine);

/* ---- spool.c: files ---- */
void eng_sem_prefix(const struct stat *st, char out[16]);
void eng_sem_name(const char *prefix, const char *which, char *out, size_t cap);
int eng_resolve_path(const char *path, char *out, size_t cap, int create_dir);
int eng_open_file(const char *path, struct stat *st);
int eng_geometry_check(const shmq_geometry *g, uint64_t size, const char *where);
void eng_unlink_semaphores(const char *prefix, uint64_t slots, long owner);
int eng_create_file(const char *path, uint64_t ring_bytes, uint64_t start_bytes, int policy, unsigned mode,
                    unsigned slots, unsigned leases, int checksum);
int eng_destroy_file(const char *path);

#endif
