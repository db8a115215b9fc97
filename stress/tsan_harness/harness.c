/*
 * ThreadSanitizer harness for shmq's engine, driven through its public API,
 * shmq.h (see stress/tsan.py and docs/guarantees.md, "ThreadSanitizer").
 *
 * Writers, named readers, group members and anonymous readers run as
 * threads of this one process on ONE spool handle (shmq_open once: one
 * mapping, which TSan watches address by address), as the C API allows:
 * the only synchronization between them is the engine's own (C11 atomics
 * and fences on the mapping, the writer and group semaphores, a private
 * cursor's lock, the handle's atomics).  No interpreter, no stand-in: this
 * program links the engine's sources and nothing else.  The harness adds
 * no synchronization while they run: the plans are fixed before the threads
 * start, every thread reads only its own data, and the results are checked
 * after the joins.
 *
 * Every frame carries (writer, counter, length) and a payload derived from
 * them; the spool stores CRCs and the readers verify them (SHMQ_VERIFY).
 * Checked after the run: each named reader got every frame exactly once in
 * seq order, no loss (block policy), each writer's frames in its order,
 * intact; the group members together got every frame exactly once;
 * anonymous readers of an overwrite run counted exactly what they lost.
 *
 * Each thread registers its role before the start barrier, and the engine,
 * built with -DSHMQ_TRACE_COPIES, reports every copy its C sink makes out of
 * the ring (and whether it was dropped or returned) to the eng_trace_copy_*
 * functions below: reports.h records, at each TSan report, who made the
 * racing accesses and what became of the copy, for stress/tsan.py's
 * classifier (printed as tsan-report lines after the joins).
 *
 * usage: harness SPOOL KEY=VALUE...   (stress/tsan.py builds and runs it)
 *   writers=N named=N group=N anon=N ops=N seed=N waiters=0|1
 * waiters=1: readers that find nothing wait on the doorbell (a blocking get
 * with a short timeout) instead of yielding, so writers ring it.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <sys/stat.h>
#include <sys/sysmacros.h>

#include "reports.h"
#include "shmq.h"

#define MAX_THREADS 16
#define MAX_PAYLOAD 3000
#define TAG_BYTES 16

static shmq_spool *sp;
static int n_writers = 2, n_named = 0, n_group = 0, n_anon = 0, ops = 2000, waiters = 0, growable = 0;
static unsigned seed = 1;
static uint64_t start_seq; /* NEXT_SEQ before the run */
static uint64_t total_frames;
static shmq_reader *named_r[MAX_THREADS], *group_r[MAX_THREADS], *anon_r[MAX_THREADS];

/* ---- each writer's plan, fixed before the threads start ---- */
enum { OP_PUT, OP_RESERVE, OP_ABANDON };
typedef struct { int op, count, patient; uint32_t len[8]; } op_plan;
static op_plan *plans[MAX_THREADS];
static uint32_t frames_of[MAX_THREADS];

static uint64_t rng_next(uint64_t *s) {
    uint64_t x = *s;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return *s = x;
}

static void make_plans(void) {
    for (int w = 0; w < n_writers; w++) {
        uint64_t s = (uint64_t)seed * 0x9E3779B97F4A7C15ull + (uint64_t)w + 1;
        plans[w] = calloc((size_t)ops, sizeof(op_plan));
        for (int i = 0; i < ops; i++) {
            op_plan *p = &plans[w][i];
            uint64_t x = rng_next(&s);
            p->op = x % 10 < 6 ? OP_PUT : x % 10 < 9 ? OP_RESERVE : OP_ABANDON;
            p->count = p->op == OP_PUT ? 1 + (int)(rng_next(&s) % 8) : 1;
            p->patient = (int)(rng_next(&s) & 1);
            for (int k = 0; k < p->count; k++) {
                uint64_t y = rng_next(&s);
                /* mostly small frames, some large ones: padding at the ring's end, big copies */
                p->len[k] = TAG_BYTES + (uint32_t)(y % 16 == 0 ? y % (MAX_PAYLOAD - TAG_BYTES) : y % 200);
            }
            if (p->op != OP_ABANDON) frames_of[w] += (uint32_t)p->count;
        }
        total_frames += frames_of[w];
    }
}

/* Payload of writer w's n-th frame: a tag, then bytes derived from it. */
static void fill(char *buf, uint32_t w, uint32_t n, uint32_t len) {
    memcpy(buf, &w, 4);
    memcpy(buf + 4, &n, 4);
    memcpy(buf + 8, &len, 4);
    uint32_t x = w * 2654435761u ^ n * 40503u ^ len;
    memcpy(buf + 12, &x, 4);
    for (uint32_t i = TAG_BYTES; i < len; i++) buf[i] = (char)(x + i * 7 + (i >> 8));
}
/* 0 if buf is an intact frame; its writer and number through *w, *n. */
static int check(const char *buf, size_t len, uint32_t *w, uint32_t *n) {
    if (len < TAG_BYTES) return -1;
    uint32_t l, x;
    memcpy(w, buf, 4);
    memcpy(n, buf + 4, 4);
    memcpy(&l, buf + 8, 4);
    memcpy(&x, buf + 12, 4);
    if (l != len || *w >= (uint32_t)n_writers || *n >= frames_of[*w]) return -1;
    if (x != (*w * 2654435761u ^ *n * 40503u ^ l)) return -1;
    for (uint32_t i = TAG_BYTES; i < len; i++)
        if (buf[i] != (char)(x + i * 7 + (i >> 8))) return -1;
    return 0;
}

/* ---- results, read by main after the joins ---- */
typedef struct {
    char error[600];
    uint64_t got, lost, retries;
    uint8_t *seen; /* group members: per global frame id, how many times taken */
} result;
static result results[3 * MAX_THREADS];
static uint32_t frame_base[MAX_THREADS]; /* global frame id = frame_base[w] + n */

static pthread_barrier_t go;

/* The C API sink's copies (engine.h, SHMQ_TRACE_COPIES), logged for the
 * calling reader thread (reports.h). */
void eng_trace_copy_begin(const void *frame, const void *end, uint64_t seq);
void eng_trace_copy_done(void);
void eng_trace_copy_dropped(void);
void eng_trace_copy_accepted(void);
void eng_trace_copy_begin(const void *frame, const void *end, uint64_t seq) { rep_copy_begin(frame, end, seq); }
void eng_trace_copy_done(void) { rep_copy_done(); }
void eng_trace_copy_dropped(void) { rep_copy_dropped(); }
void eng_trace_copy_accepted(void) { rep_copy_accepted(); }

/* Where this process mapped the spool at `path` (shmq.h hands out no
 * addresses; reports.h turns addresses into file offsets): the mapping of
 * that file's offset 0 in /proc/self/maps.  0, or -1. */
static int spool_mapping(const char *path, const char **base, uint64_t *len) {
    struct stat st;
    if (stat(path, &st) != 0) return -1;
    FILE *f = fopen("/proc/self/maps", "re");
    if (!f) return -1;
    char line[4096];
    int found = -1;
    while (found < 0 && fgets(line, sizeof line, f)) {
        unsigned long long lo, hi, off, ino;
        unsigned maj, mnr;
        if (sscanf(line, "%llx-%llx %*s %llx %x:%x %llu", &lo, &hi, &off, &maj, &mnr, &ino) == 6 && off == 0 &&
            ino == (unsigned long long)st.st_ino && maj == major(st.st_dev) && mnr == minor(st.st_dev)) {
            *base = (const char *)(uintptr_t)lo;
            *len = hi - lo;
            found = 0;
        }
    }
    fclose(f);
    return found;
}

/* A bound on one reader's copy attempts: each returns a frame or is dropped
 * because the frame was overwritten, which loses at least that frame. */
static uint64_t max_copies(void) { return 2 * total_frames + 64; }

#define FAIL(res, ...) do { snprintf((res)->error, sizeof (res)->error, __VA_ARGS__); return NULL; } while (0)

/* A read: the next frame, or SHMQ_EEMPTY (after a short wait on the doorbell with waiters). */
static int next(shmq_reader *r, char *buf, size_t cap, shmq_frame *f) {
    int rc = shmq_get(r, buf, cap, f, waiters ? 0.002 : 0);
    if (rc == SHMQ_EEMPTY && !waiters) sched_yield();
    return rc;
}

static void *writer_main(void *arg) {
    int w = (int)(intptr_t)arg;
    result *res = &results[w];
    char *bufs[8];
    for (int k = 0; k < 8; k++) bufs[k] = malloc(MAX_PAYLOAD);
    uint32_t n = 0;
    rep_register(w, REP_WRITER, w, 0);
    pthread_barrier_wait(&go);
    for (int i = 0; i < ops; i++) {
        op_plan *p = &plans[w][i];
        double timeout = p->patient ? SHMQ_FOREVER : 0; /* patient: wait on the space doorbell */
        for (;;) {
            int64_t st;
            if (p->op == OP_PUT) {
                shmq_iovec iov[8];
                for (int k = 0; k < p->count; k++) {
                    fill(bufs[k], (uint32_t)w, n + (uint32_t)k, p->len[k]);
                    iov[k] = (shmq_iovec){bufs[k], p->len[k]};
                }
                st = shmq_put_many(sp, iov, (size_t)p->count, SHMQ_CODEC_RAW, timeout);
            } else {
                shmq_reservation rv;
                st = shmq_reserve(sp, p->len[0], SHMQ_CODEC_RAW, timeout, &rv);
                if (st == 0) {
                    if (p->op == OP_ABANDON) {
                        fill(rv.data, 0, 0, p->len[0]); /* written, never published */
                        st = shmq_abandon(&rv);
                    } else {
                        fill(rv.data, (uint32_t)w, n, p->len[0]); /* in place: zero-copy */
                        st = shmq_commit(&rv);
                    }
                }
            }
            if (st == SHMQ_EFULL) { /* block policy, consumers behind, not patient: again */
                res->retries++;
                sched_yield();
                continue;
            }
            if (st < 0) FAIL(res, "writer %d op %d: %s (%s)", w, i, shmq_strerror((int)st), shmq_errmsg());
            break;
        }
        if (p->op != OP_ABANDON) n += (uint32_t)p->count;
    }
    res->got = n;
    for (int k = 0; k < 8; k++) free(bufs[k]);
    return NULL;
}

/* A named reader: every frame, once, in seq order, each writer's in its order. */
static void *named_main(void *arg) {
    int i = (int)(intptr_t)arg;
    result *res = &results[MAX_THREADS + i];
    shmq_reader *r = named_r[i];
    char *buf = malloc(MAX_PAYLOAD + 8);
    uint32_t next_n[MAX_THREADS] = {0};
    uint64_t expect = start_seq, idle = 0;
    shmq_frame f;
    rep_register(n_writers + i, REP_NAMED, i, max_copies());
    pthread_barrier_wait(&go);
    while (res->got < total_frames) {
        int rc = next(r, buf, MAX_PAYLOAD + 8, &f);
        if (rc == SHMQ_EEMPTY) {
            if (growable && ++idle % 64 == 0 && (rc = shmq_trim(sp, 0)) < 0 && rc != SHMQ_ELOCKED)
                FAIL(res, "named reader %d: trim: %s", i, shmq_errmsg());
            continue;
        }
        if (rc < 0) FAIL(res, "named reader %d: %s (%s)", i, shmq_strerror(rc), shmq_errmsg());
        uint32_t w, n;
        if (f.seq != expect) FAIL(res, "named reader %d: seq %llu, expected %llu (lost %llu)", i,
                                  (unsigned long long)f.seq, (unsigned long long)expect,
                                  (unsigned long long)shmq_reader_lost(r));
        if (check(f.data, f.len, &w, &n) < 0) FAIL(res, "named reader %d: frame %llu is corrupt (%zu bytes)", i,
                                                   (unsigned long long)f.seq, f.len);
        if (n != next_n[w]) FAIL(res, "named reader %d: seq %llu is writer %u's frame %u, expected %u", i,
                                 (unsigned long long)f.seq, w, n, next_n[w]);
        next_n[w]++;
        expect++;
        res->got++;
    }
    res->lost = shmq_reader_lost(r);
    free(buf);
    return NULL;
}

/* A group member: frames in increasing seq order; all members together take each once. */
static void *group_main(void *arg) {
    int i = (int)(intptr_t)arg;
    result *res = &results[2 * MAX_THREADS + i];
    shmq_reader *r = group_r[i];
    char *buf = malloc(MAX_PAYLOAD + 8);
    res->seen = calloc(total_frames ? total_frames : 1, 1);
    uint64_t last = 0, idle = 0;
    int any = 0;
    shmq_frame f;
    rep_register(n_writers + n_named + i, REP_GROUP, i, max_copies());
    pthread_barrier_wait(&go);
    for (;;) {
        int rc = next(r, buf, MAX_PAYLOAD + 8, &f);
        if (rc == SHMQ_EEMPTY) {
            if (shmq_reader_position(r) >= start_seq + total_frames) break; /* the others took the rest */
            if (growable && ++idle % 64 == 0 && (rc = shmq_trim(sp, 0)) < 0 && rc != SHMQ_ELOCKED)
                FAIL(res, "group member %d: trim: %s", i, shmq_errmsg());
            continue;
        }
        if (rc < 0) FAIL(res, "group member %d: %s (%s)", i, shmq_strerror(rc), shmq_errmsg());
        uint32_t w, n;
        if (any && f.seq <= last) FAIL(res, "group member %d: seq %llu after %llu", i, (unsigned long long)f.seq,
                                       (unsigned long long)last);
        if (check(f.data, f.len, &w, &n) < 0) FAIL(res, "group member %d: frame %llu is corrupt", i,
                                                   (unsigned long long)f.seq);
        res->seen[frame_base[w] + n]++;
        last = f.seq;
        any = 1;
        res->got++;
    }
    res->lost = shmq_reader_lost(r);
    free(buf);
    return NULL;
}

/* An anonymous reader (overwrite runs): frames intact and in seq order; loss allowed, counted. */
static void *anon_main(void *arg) {
    int i = (int)(intptr_t)arg;
    result *res = &results[MAX_THREADS + n_named + i];
    shmq_reader *r = anon_r[i];
    char *buf = malloc(MAX_PAYLOAD + 8);
    uint64_t last = 0, end = start_seq + total_frames;
    int any = 0;
    shmq_frame f;
    rep_register(n_writers + n_named + n_group + i, REP_ANON, i, max_copies());
    pthread_barrier_wait(&go);
    for (;;) {
        int rc = next(r, buf, MAX_PAYLOAD + 8, &f);
        if (rc == SHMQ_EEMPTY) {
            if (shmq_reader_position(r) >= end) break;
            continue;
        }
        if (rc < 0) FAIL(res, "anonymous reader %d: %s (%s)", i, shmq_strerror(rc), shmq_errmsg());
        uint32_t w, n;
        if (any && f.seq <= last) FAIL(res, "anonymous reader %d: seq %llu after %llu", i,
                                       (unsigned long long)f.seq, (unsigned long long)last);
        if (check(f.data, f.len, &w, &n) < 0) FAIL(res, "anonymous reader %d: frame %llu is corrupt", i,
                                                   (unsigned long long)f.seq);
        last = f.seq;
        any = 1;
        res->got++;
        if (f.seq + 1 >= end) break;
        if (i % 2) /* every other anonymous reader lags: it is lapped, loses frames, resyncs */
            for (int k = 0; k < 8; k++) sched_yield();
    }
    res->lost = shmq_reader_lost(r);
    if (res->got + res->lost != total_frames)
        FAIL(res, "anonymous reader %d: got %llu + lost %llu != %llu frames written", i,
             (unsigned long long)res->got, (unsigned long long)res->lost, (unsigned long long)total_frames);
    free(buf);
    return NULL;
}

static int open_reader(const char *name, int flags, shmq_reader **out) {
    int rc = shmq_reader_open(sp, name, flags | SHMQ_START_LATEST | SHMQ_VERIFY, out);
    if (rc < 0) fprintf(stderr, "FAIL reader %s: %s (%s)\n", name ? name : "(anonymous)", shmq_strerror(rc),
                        shmq_errmsg());
    return rc;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s SPOOL KEY=VALUE...\n", argv[0]);
        return 2;
    }
    for (int i = 2; i < argc; i++) {
        char *k = argv[i], *v = strchr(k, '=');
        if (!v) return 2;
        *v++ = 0;
        long x = strtol(v, NULL, 0);
        if (!strcmp(k, "writers")) n_writers = (int)x;
        else if (!strcmp(k, "named")) n_named = (int)x;
        else if (!strcmp(k, "group")) n_group = (int)x;
        else if (!strcmp(k, "anon")) n_anon = (int)x;
        else if (!strcmp(k, "ops")) ops = (int)x;
        else if (!strcmp(k, "seed")) seed = (unsigned)x;
        else if (!strcmp(k, "waiters")) waiters = (int)x;
        else {
            fprintf(stderr, "unknown key %s\n", k);
            return 2;
        }
    }
    if (n_writers < 1 || n_writers > MAX_THREADS || n_group > MAX_THREADS || n_named + n_anon > MAX_THREADS)
        return 2;
    /* A long recovery timeout: every holder here is alive, and TSan slows them down. */
    int rc = shmq_open(argv[1], 60.0, &sp);
    if (rc < 0) {
        fprintf(stderr, "FAIL open %s: %s (%s)\n", argv[1], shmq_strerror(rc), shmq_errmsg());
        return 3;
    }
    shmq_stats st;
    shmq_stats_get(sp, &st);
    start_seq = st.next_seq;
    growable = st.growable;
    /* Readers attach before the writers start: none has a frame before its cursor. */
    char name[32];
    for (int i = 0; i < n_named; i++) {
        snprintf(name, sizeof name, "tsan-named-%d", i);
        if (open_reader(name, 0, &named_r[i]) < 0) return 3;
    }
    for (int i = 0; i < n_group; i++)
        if (open_reader("tsan-group", SHMQ_READER_GROUP, &group_r[i]) < 0) return 3;
    for (int i = 0; i < n_anon; i++)
        if (open_reader(NULL, 0, &anon_r[i]) < 0) return 3;
    const char *base;
    uint64_t map_len;
    if (spool_mapping(argv[1], &base, &map_len) < 0) {
        fprintf(stderr, "FAIL cannot find the spool's mapping in /proc/self/maps\n");
        return 3;
    }
    rep_init(base, map_len, SHMQ_W_FIRST_SEQ);
    make_plans();
    for (int w = 1; w < n_writers; w++) frame_base[w] = frame_base[w - 1] + frames_of[w - 1];

    int nthreads = n_writers + n_named + n_group + n_anon;
    pthread_t th[4 * MAX_THREADS];
    pthread_barrier_init(&go, NULL, (unsigned)nthreads);
    rep_threads_used(nthreads);
    int t = 0;
    for (int w = 0; w < n_writers; w++) pthread_create(&th[t++], NULL, writer_main, (void *)(intptr_t)w);
    for (int i = 0; i < n_named; i++) pthread_create(&th[t++], NULL, named_main, (void *)(intptr_t)i);
    for (int i = 0; i < n_group; i++) pthread_create(&th[t++], NULL, group_main, (void *)(intptr_t)i);
    for (int i = 0; i < n_anon; i++) pthread_create(&th[t++], NULL, anon_main, (void *)(intptr_t)i);
    for (int i = 0; i < t; i++) pthread_join(th[i], NULL);

    /* ---- invariants ---- */
    int bad = 0;
    for (int i = 0; i < 3 * MAX_THREADS; i++)
        if (results[i].error[0]) {
            fprintf(stderr, "FAIL %s\n", results[i].error);
            bad = 1;
        }
    for (int w = 0; w < n_writers && !bad; w++)
        if (results[w].got != frames_of[w]) {
            fprintf(stderr, "FAIL writer %d committed %llu frames, planned %u\n", w,
                    (unsigned long long)results[w].got, frames_of[w]);
            bad = 1;
        }
    for (int i = 0; i < n_named && !bad; i++)
        if (results[MAX_THREADS + i].got != total_frames || results[MAX_THREADS + i].lost) {
            fprintf(stderr, "FAIL named reader %d got %llu of %llu frames, lost %llu\n", i,
                    (unsigned long long)results[MAX_THREADS + i].got, (unsigned long long)total_frames,
                    (unsigned long long)results[MAX_THREADS + i].lost);
            bad = 1;
        }
    if (n_group && !bad) {
        uint64_t sum = 0, dup = 0, missing = 0;
        for (uint64_t f = 0; f < total_frames; f++) {
            unsigned k = 0;
            for (int i = 0; i < n_group; i++) k += results[2 * MAX_THREADS + i].seen[f];
            if (k == 0) missing++;
            if (k > 1) dup++;
        }
        for (int i = 0; i < n_group; i++) sum += results[2 * MAX_THREADS + i].got;
        if (dup || missing || sum != total_frames) {
            fprintf(stderr, "FAIL group: %llu frames taken of %llu, %llu duplicated, %llu missing\n",
                    (unsigned long long)sum, (unsigned long long)total_frames, (unsigned long long)dup,
                    (unsigned long long)missing);
            bad = 1;
        }
    }
    uint64_t retries = 0, anon_got = 0, anon_lost = 0;
    for (int w = 0; w < n_writers; w++) retries += results[w].retries;
    for (int i = 0; i < n_anon; i++) {
        anon_got += results[MAX_THREADS + n_named + i].got;
        anon_lost += results[MAX_THREADS + n_named + i].lost;
    }
    shmq_stats_get(sp, &st);
    if (!bad && st.next_seq - start_seq != total_frames) {
        fprintf(stderr, "FAIL the spool's NEXT_SEQ moved by %llu, %llu frames were committed\n",
                (unsigned long long)(st.next_seq - start_seq), (unsigned long long)total_frames);
        bad = 1;
    }
    for (int i = 0; i < n_named; i++) shmq_reader_close(named_r[i]);
    for (int i = 0; i < n_group; i++) shmq_reader_close(group_r[i]);
    for (int i = 0; i < n_anon; i++) shmq_reader_close(anon_r[i]);
    rep_print(stdout); /* what happened at each TSan report (reports.h) */
    printf("harness: %d writers, %d named, %d group members, %d anonymous%s; %llu frames, %.1f laps of the ring, "
           "%llu evicted, %llu segment growths, %llu full-ring retries, anonymous got %llu lost %llu; "
           "invariants %s\n",
           n_writers, n_named, n_group, n_anon, waiters ? ", doorbell waiters" : "", (unsigned long long)total_frames,
           (double)st.put_bytes / (double)st.capacity, (unsigned long long)st.evicted,
           (unsigned long long)st.growths, (unsigned long long)retries, (unsigned long long)anon_got,
           (unsigned long long)anon_lost, bad ? "FAILED" : "ok");
    shmq_close(sp);
    return bad ? 1 : 0;
}
