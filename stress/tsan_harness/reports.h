/*
 * What happened at each ThreadSanitizer report, recorded by the harness itself
 * (see stress/tsan.py, "Classifying reports", and docs/guarantees.md).
 *
 * TSan calls __tsan_on_report() (a weak hook of its runtime) for every report
 * it prints; the hook reads the report through TSan's own query functions
 * (__tsan_get_report_data / _mop / _thread: kind, each access's thread,
 * address, size, read or write, atomic or not) - never the printed text or
 * the symbolized stacks, which differ between compilers.  It maps each
 * access to the harness thread that made it (by OS thread id, registered by
 * every thread before the start barrier) and its address to an offset in
 * the spool file, and, for an access by a reader, to the reader's COPY
 * ATTEMPT covering that address: the frame (header and payload bytes) the
 * reader's sink was copying or had last copied there.  What the reader then
 * did with that copy - discarded it as overwritten (the seqlock re-check
 * failed: "dropped") or returned it ("accepted") - is known only later, so
 * after the joins rep_print() writes one line per report with the copy's
 * final outcome.  stress/tsan.py parses those lines; their format is part of
 * the harness's interface:
 *
 *   tsan-report N kind=K cur=I first=F access=I:ROLE:IDX:rw:atomic:OFF:SIZE access=... copy=ID:STATE:OUTCOME:LO:HI:SEQ
 *
 *   K        TSan's report type ("data-race", "lock-order-inversion", ...)
 *   cur      the index of the access made by the reporting thread (the later one)
 *   first    the spool's FIRST_SEQ control word (the oldest frame not evicted) as
 *            the reporting thread saw it at the report.  A writer evicts under
 *            the writer lock before it overwrites a byte, so when the writer's
 *            store fired the report, every frame below F was evicted before it.
 *   ROLE     writer | named | group | anon | main | other; IDX its index in the role
 *   rw       r or w; atomic 1 for an atomic access
 *   OFF      offset in the spool file (-1: outside the mapping); SIZE in bytes
 *   copy     the reader's copy attempt holding that read (ID 0: none found),
 *            STATE when the report fired (copying | copied | dropped |
 *            accepted), OUTCOME at the end (dropped | accepted | open), and
 *            the file offsets [LO, HI) of the frame's header and payload, and
 *            the frame's seq (from the header the sink copied it under).
 *
 * Engine-independent but for the index of FIRST_SEQ among the control words at
 * the mapping's start (rep_init): the harness's sink calls rep_copy_begin() before it
 * copies a frame out of the ring, rep_copy_dropped() when the engine
 * discards the copy and rep_copy_accepted() when the frame is returned.
 * Everything shared with the hook is an atomic (relaxed: it adds no
 * happens-before that could hide a race) or written before the barrier.
 */
#ifndef SHMQ_TSAN_REPORTS_H
#define SHMQ_TSAN_REPORTS_H

#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>

/* TSan's report query interface (compiler-rt's tsan_interface.h; in GCC's libtsan too). */
void *__tsan_get_current_report(void);
int __tsan_get_report_data(void *report, const char **description, int *count, int *stack_count, int *mop_count,
                           int *loc_count, int *mutex_count, int *thread_count, int *unique_tid_count,
                           void **sleep_trace, unsigned long trace_size);
int __tsan_get_report_mop(void *report, unsigned long idx, int *tid, void **addr, int *size, int *write,
                          int *atomic, void **trace, unsigned long trace_size);
int __tsan_get_report_thread(void *report, unsigned long idx, int *tid, uint64_t *os_id, int *running,
                             const char **name, int *parent_tid, void **trace, unsigned long trace_size);

enum { REP_OTHER, REP_WRITER, REP_NAMED, REP_GROUP, REP_ANON, REP_MAIN, REP_ROLES };
static const char *const rep_role_name[REP_ROLES] = {"other", "writer", "named", "group", "anon", "main"};
enum { CP_NONE, CP_COPYING, CP_COPIED, CP_DROPPED, CP_ACCEPTED };
static const char *const rep_state_name[] = {"none", "copying", "copied", "dropped", "accepted"};

/* The hook runs inside TSan's runtime, which holds its own locks (the thread
 * registry, the report mutex) while it calls it.  An instrumented hook (a
 * function entry, an atomic, an intercepted libc call) may need a lock that
 * another thread holds while it waits for one of those: a deadlock, seen as
 * a harness that hung for ever (GCC 16's libtsan: the reporting thread in
 * TracePartAlloc from the hook's function entry, two exiting threads in
 * ThreadFinish waiting for the registry).  So the hook and everything it
 * calls are compiled without instrumentation, and call no libc function
 * TSan intercepts. */
#if defined(__clang__)
#define REP_HOOK __attribute__((disable_sanitizer_instrumentation, noinline))
#else
#define REP_HOOK __attribute__((no_sanitize_thread, noinline))
#endif

#define REP_THREADS 64
#define REP_EVENTS 4096  /* reports recorded (TSan prints each racing pair of stacks once) */

/* One copy attempt: the file offsets [lo, hi) of the frame's header and payload,
 * its seq and its state (CP_*).  A reader's attempts are numbered 1, 2, ... */
typedef struct { _Atomic uint64_t lo, hi, seq; _Atomic uint8_t state; } rep_copy;
typedef struct {
    uint64_t os_id;          /* written before the barrier, read-only afterwards */
    int role, index;
    _Atomic uint64_t copies; /* attempts so far: the last one's number */
    rep_copy *log;           /* attempt k at log[k], k < cap (later ones are not logged) */
    uint64_t cap;
} rep_thread;

typedef struct {
    int nmops, cur;
    char kind[32];
    struct { int role, index, write, atomic, size; int64_t off; } mop[2];
    int reader_th;        /* the rep_threads index of the reader whose copy holds the read, or -1 */
    uint64_t copy_id, lo, hi, seq;
    int state_at_report;
    uint64_t first_seq;   /* FIRST_SEQ as the reporting thread saw it */
} rep_event;

static rep_thread rep_threads[REP_THREADS];
static int rep_nthreads;
static rep_event rep_events[REP_EVENTS];
static _Atomic int rep_nevents, rep_overflow;
static const char *rep_base;
static uint64_t rep_map_len;
static int rep_first_word; /* FIRST_SEQ's index among the control words at the mapping's start */
static __thread int rep_me = -1; /* this thread's index in rep_threads */

REP_HOOK static uint64_t rep_gettid(void) { return (uint64_t)syscall(SYS_gettid); }

/* Once, before any thread starts: the spool's mapping (from file offset 0) and
 * the index of the FIRST_SEQ control word among the 8-byte words it starts with. */
static void rep_init(const char *base, uint64_t len, int first_seq_word) {
    rep_base = base;
    rep_map_len = len;
    rep_first_word = first_seq_word;
}

/* Each thread, before the start barrier: its role.  `max_copies`: an upper bound
 * on the copy attempts it will make (0 for a thread that reads no frames). */
static void rep_register(int slot, int role, int index, uint64_t max_copies) {
    rep_thread *t = &rep_threads[slot];
    t->os_id = rep_gettid();
    t->role = role;
    t->index = index;
    t->cap = max_copies + 1;
    t->log = max_copies ? calloc(max_copies + 1, sizeof(rep_copy)) : NULL;
    rep_me = slot;
}
/* Main, before creating the threads: how many slots are used. */
static void rep_threads_used(int n) { rep_nthreads = n; }

REP_HOOK static int64_t rep_offset(const void *p) {
    const char *c = p;
    return rep_base && c >= rep_base && c < rep_base + rep_map_len ? (int64_t)(c - rep_base) : -1;
}

/* The sink is about to copy frame `seq`, whose header starts at `frame` and whose payload ends at `end`. */
static void rep_copy_begin(const void *frame, const void *end, uint64_t seq) {
    if (rep_me < 0 || !rep_threads[rep_me].log) return;
    rep_thread *t = &rep_threads[rep_me];
    uint64_t id = atomic_load_explicit(&t->copies, memory_order_relaxed) + 1;
    if (id < t->cap) {
        rep_copy *c = &t->log[id];
        atomic_store_explicit(&c->lo, (uint64_t)rep_offset(frame), memory_order_relaxed);
        atomic_store_explicit(&c->hi, (uint64_t)rep_offset(end), memory_order_relaxed);
        atomic_store_explicit(&c->seq, seq, memory_order_relaxed);
        atomic_store_explicit(&c->state, CP_COPYING, memory_order_relaxed);
    }
    atomic_store_explicit(&t->copies, id, memory_order_relaxed); /* after the fields: the hook sees them */
}
static void rep_copy_state(int state) {
    if (rep_me < 0 || !rep_threads[rep_me].log) return;
    rep_thread *t = &rep_threads[rep_me];
    uint64_t id = atomic_load_explicit(&t->copies, memory_order_relaxed);
    if (id && id < t->cap) atomic_store_explicit(&t->log[id].state, (uint8_t)state, memory_order_relaxed);
}
static void rep_copy_done(void) { rep_copy_state(CP_COPIED); }
static void rep_copy_dropped(void) { rep_copy_state(CP_DROPPED); }
static void rep_copy_accepted(void) { rep_copy_state(CP_ACCEPTED); }

REP_HOOK static int rep_thread_of(uint64_t os_id) {
    for (int i = 0; i < rep_nthreads; i++)
        if (rep_threads[i].os_id == os_id) return i;
    return -1;
}

/* The reader's latest copy attempt whose frame covers file offset `off` (0: none). */
REP_HOOK static uint64_t rep_find_copy(rep_thread *t, int64_t off, uint64_t *lo, uint64_t *hi, uint64_t *seq,
                                       int *state) {
    uint64_t last = atomic_load_explicit(&t->copies, memory_order_relaxed);
    if (last >= t->cap) return 0; /* past the log: unknown */
    for (uint64_t id = last; id > 0 && off >= 0; id--) {
        rep_copy *c = &t->log[id];
        uint64_t l = atomic_load_explicit(&c->lo, memory_order_relaxed);
        uint64_t h = atomic_load_explicit(&c->hi, memory_order_relaxed);
        if ((uint64_t)off >= l && (uint64_t)off < h) {
            *lo = l, *hi = h, *seq = atomic_load_explicit(&c->seq, memory_order_relaxed);
            *state = atomic_load_explicit(&c->state, memory_order_relaxed);
            return id;
        }
    }
    return 0;
}

/* `src` into `dst` (n bytes with its NUL), without libc: snprintf is intercepted. */
REP_HOOK static void rep_copy_str(char *dst, const char *src, size_t n) {
    size_t i = 0;
    for (; src && src[i] && i + 1 < n; i++) dst[i] = src[i];
    dst[i] = 0;
}

/* TSan's hook, called in the reporting thread for every report it prints (REP_HOOK). */
REP_HOOK void __tsan_on_report(void *report) {
    int slot = atomic_fetch_add_explicit(&rep_nevents, 1, memory_order_relaxed);
    if (slot >= REP_EVENTS) {
        atomic_store_explicit(&rep_overflow, 1, memory_order_relaxed);
        return;
    }
    rep_event *e = &rep_events[slot];
    const char *desc = "?";
    int count, stacks, mops = 0, locs, mutexes, threads = 0, utids;
    void *sleep_trace[1];
    __tsan_get_report_data(report, &desc, &count, &stacks, &mops, &locs, &mutexes, &threads, &utids, sleep_trace, 1);
    rep_copy_str(e->kind, desc ? desc : "?", sizeof e->kind);
    e->nmops = mops > 2 ? 2 : mops;
    e->cur = 0; /* TSan lists the reporting thread's access first */
    e->reader_th = -1;
    /* The reporting thread's view: its own eviction, if it is the writer whose store fired the report. */
    e->first_seq = rep_base ? __atomic_load_n((const uint64_t *)rep_base + rep_first_word, __ATOMIC_RELAXED) : 0;
    uint64_t me = rep_gettid();
    for (int i = 0; i < e->nmops; i++) {
        int tid = -1, size = 0, write = 0, atomic = 0;
        void *addr = NULL, *trace[1];
        __tsan_get_report_mop(report, (unsigned long)i, &tid, &addr, &size, &write, &atomic, trace, 1);
        uint64_t os_id = 0;
        for (int k = 0; k < threads; k++) {
            int ttid = -1, running = 0, parent = -1;
            uint64_t oid = 0;
            const char *name = NULL;
            __tsan_get_report_thread(report, (unsigned long)k, &ttid, &oid, &running, &name, &parent, trace, 1);
            if (ttid == tid) os_id = oid;
        }
        if (tid == 0) os_id = (uint64_t)syscall(SYS_getpid); /* the main thread is T0 */
        int th = rep_thread_of(os_id);
        e->mop[i].role = th >= 0 ? rep_threads[th].role : (tid == 0 ? REP_MAIN : REP_OTHER);
        e->mop[i].index = th >= 0 ? rep_threads[th].index : -1;
        e->mop[i].write = write;
        e->mop[i].atomic = atomic;
        e->mop[i].size = size;
        e->mop[i].off = rep_offset(addr);
        if (os_id == me) e->cur = i;
        if (!write && th >= 0 && rep_threads[th].log && e->reader_th < 0) {
            e->reader_th = th;
            e->lo = e->hi = e->seq = 0;
            e->state_at_report = CP_NONE;
            e->copy_id = rep_find_copy(&rep_threads[th], e->mop[i].off, &e->lo, &e->hi, &e->seq, &e->state_at_report);
        }
    }
}

static void rep_print(FILE *out) {
    int n = atomic_load_explicit(&rep_nevents, memory_order_relaxed);
    if (n > REP_EVENTS) n = REP_EVENTS;
    for (int i = 0; i < n; i++) {
        rep_event *e = &rep_events[i];
        fprintf(out, "tsan-report %d kind=%s cur=%d first=%llu", i, e->kind, e->cur, (unsigned long long)e->first_seq);
        for (int k = 0; k < e->nmops; k++)
            fprintf(out, " access=%d:%s:%d:%c:%d:%lld:%d", k, rep_role_name[e->mop[k].role], e->mop[k].index,
                    e->mop[k].write ? 'w' : 'r', e->mop[k].atomic, (long long)e->mop[k].off, e->mop[k].size);
        if (e->reader_th >= 0) {
            rep_thread *t = &rep_threads[e->reader_th];
            int fin = e->copy_id ? t->log[e->copy_id].state : CP_NONE;
            fprintf(out, " copy=%llu:%s:%s:%llu:%llu:%llu", (unsigned long long)e->copy_id,
                    rep_state_name[e->state_at_report], fin == CP_DROPPED ? "dropped" : fin == CP_ACCEPTED ? "accepted" : "open",
                    (unsigned long long)e->lo, (unsigned long long)e->hi, (unsigned long long)e->seq);
        }
        fputc('\n', out);
    }
    if (atomic_load_explicit(&rep_overflow, memory_order_relaxed))
        fprintf(out, "tsan-report-overflow more than %d reports; the rest were not recorded\n", REP_EVENTS);
}

#endif
