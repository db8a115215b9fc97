/*
 * ThreadSanitizer harness for shmq's compiled core (see stress/tsan.py and
 * docs/guarantees.md, "ThreadSanitizer").
 *
 * Writers, named readers and group members run as threads of this one
 * process over ONE shared mapping of a spool created by shmq beforehand,
 * each thread with its own core handle (as each process has its own), none
 * holding the GIL: the only synchronization between them is the core's own
 * (C11 atomics and fences on the mapping, the writer and group semaphores).
 * The harness adds none while they run: the plans are fixed before the
 * threads start, every thread reads only relaxed words or its own data, and
 * the results are checked after the joins.
 *
 * Every frame carries (writer, counter, length) and a payload derived from
 * them; the spool stores CRCs and the readers verify them.  Checked after
 * the run: each named reader got every frame exactly once in seq order, no
 * loss (block policy), each writer's frames in its order, intact; the group
 * members together got every frame exactly once.
 *
 * usage: harness SPOOL KEY=VALUE...   (stress/tsan.py builds and runs it)
 */
#include "core_adapter.h"

#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define MAX_THREADS 16
#define MAX_PAYLOAD 3000
#define TAG_BYTES 16

typedef struct { int kind; int64_t slot; uint64_t seq, pos; } reader_spec;

static hx_geo geo;
static char *base;
static int spool_fd;
static const char *group_sem;
static int n_writers = 2, n_named = 0, n_group = 0, n_anon = 0, ops = 2000, waiters = 0;
static unsigned seed = 1;
static reader_spec named_spec[MAX_THREADS], group_spec;
static uint64_t start_seq; /* NEXT_SEQ before the run */
static uint64_t total_frames;

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

/* A bound on one reader's copy attempts: each returns a frame or is dropped
 * because the frame was overwritten, which loses at least that frame. */
static uint64_t max_copies(void) { return 2 * total_frames + 64; }

#define FAIL(res, ...) do { snprintf((res)->error, sizeof (res)->error, __VA_ARGS__); return NULL; } while (0)

static void *writer_main(void *arg) {
    int w = (int)(intptr_t)arg;
    result *res = &results[w];
    hx_ring *r = hx_ring_open(&geo, base, spool_fd);
    char *bufs[8];
    for (int k = 0; k < 8; k++) bufs[k] = malloc(MAX_PAYLOAD);
    uint32_t n = 0;
    rep_register(w, REP_WRITER, w, 0);
    pthread_barrier_wait(&go);
    for (int i = 0; i < ops; i++) {
        op_plan *p = &plans[w][i];
        for (;;) {
            int64_t st;
            if (p->op == OP_PUT) {
                size_t lens[8];
                for (int k = 0; k < p->count; k++) {
                    fill(bufs[k], (uint32_t)w, n + (uint32_t)k, p->len[k]);
                    lens[k] = p->len[k];
                }
                st = hx_put(r, (void *const *)bufs, lens, p->count, p->patient);
            } else {
                hx_resv *rv = NULL;
                st = hx_reserve(r, p->len[0], &rv);
                if (st == 0) {
                    if (p->op == OP_ABANDON) {
                        fill(hx_resv_buf(rv), 0, 0, p->len[0]); /* written, never published */
                        st = hx_resv_abandon(rv);
                    } else {
                        fill(hx_resv_buf(rv), (uint32_t)w, n, p->len[0]); /* in place: zero-copy */
                        st = hx_resv_commit(rv);
                    }
                }
            }
            if (st == HX_NO_ROOM) { /* block policy, consumers behind: Python would wait on the doorbell */
                res->retries++;
                sched_yield();
                continue;
            }
            if (st < 0 || hx_error()) FAIL(res, "writer %d op %d: status %lld %s", w, i, (long long)st,
                                           hx_error() ? hx_error() : "");
            break;
        }
        if (p->op != OP_ABANDON) n += (uint32_t)p->count;
    }
    res->got = n;
    return NULL;
}

/* A named reader: every frame, once, in seq order, each writer's in its order. */
static void *named_main(void *arg) {
    int i = (int)(intptr_t)arg;
    result *res = &results[MAX_THREADS + i];
    hx_ring *r = hx_ring_open(&geo, base, spool_fd);
    reader_spec *sp = &named_spec[i];
    hx_cursor *c = hx_cursor_open(r, sp->kind, sp->slot, sp->seq, sp->pos, 1, 1, NULL);
    char *buf = malloc(MAX_PAYLOAD + 8);
    uint32_t next_n[MAX_THREADS] = {0};
    uint64_t expect = start_seq, idle = 0;
    rep_register(n_writers + i, REP_NAMED, i, max_copies());
    pthread_barrier_wait(&go);
    while (res->got < total_frames) {
        uint64_t seq;
        size_t len;
        int rc = hx_take(c, &seq, buf, MAX_PAYLOAD + 8, &len);
        if (rc < 0) FAIL(res, "named reader %d: %s", i, hx_error());
        if (rc == 0) {
            if (++idle % 64 == 0 && hx_trim(r) < 0) FAIL(res, "named reader %d: trim: %s", i, hx_error());
            sched_yield();
            continue;
        }
        uint32_t w, n;
        if (seq != expect) FAIL(res, "named reader %d: seq %llu, expected %llu (lost %llu)", i,
                                (unsigned long long)seq, (unsigned long long)expect,
                                (unsigned long long)hx_cursor_lost(c));
        if (check(buf, len, &w, &n) < 0) FAIL(res, "named reader %d: frame %llu is corrupt (%zu bytes)", i,
                                               (unsigned long long)seq, len);
        if (n != next_n[w]) FAIL(res, "named reader %d: seq %llu is writer %u's frame %u, expected %u", i,
                                 (unsigned long long)seq, w, n, next_n[w]);
        next_n[w]++;
        expect++;
        res->got++;
    }
    hx_flush(c);
    res->lost = hx_cursor_lost(c);
    return NULL;
}

/* A group member: frames in increasing seq order; all members together take each once. */
static void *group_main(void *arg) {
    int i = (int)(intptr_t)arg;
    result *res = &results[2 * MAX_THREADS + i];
    hx_ring *r = hx_ring_open(&geo, base, spool_fd);
    hx_cursor *c = hx_cursor_open(r, HX_GROUP, group_spec.slot, 0, 0, 0, 1, group_sem);
    char *buf = malloc(MAX_PAYLOAD + 8);
    res->seen = calloc(total_frames ? total_frames : 1, 1);
    uint64_t last = 0, idle = 0;
    int any = 0;
    rep_register(n_writers + n_named + i, REP_GROUP, i, max_copies());
    pthread_barrier_wait(&go);
    for (;;) {
        uint64_t seq;
        size_t len;
        int rc = hx_take(c, &seq, buf, MAX_PAYLOAD + 8, &len);
        if (rc < 0) FAIL(res, "group member %d: %s", i, hx_error());
        if (rc == 0) {
            if (hx_group_seq(c) >= start_seq + total_frames) break; /* the others took the rest */
            if (++idle % 64 == 0 && hx_trim(r) < 0) FAIL(res, "group member %d: trim: %s", i, hx_error());
            sched_yield();
            continue;
        }
        uint32_t w, n;
        if (any && seq <= last) FAIL(res, "group member %d: seq %llu after %llu", i, (unsigned long long)seq,
                                     (unsigned long long)last);
        if (check(buf, len, &w, &n) < 0) FAIL(res, "group member %d: frame %llu is corrupt", i,
                                               (unsigned long long)seq);
        res->seen[frame_base[w] + n]++;
        last = seq;
        any = 1;
        res->got++;
    }
    res->lost = hx_cursor_lost(c);
    return NULL;
}

/* An anonymous reader (overwrite runs): frames intact and in seq order; loss allowed. */
static void *anon_main(void *arg) {
    int i = (int)(intptr_t)arg;
    result *res = &results[MAX_THREADS + n_named + i];
    hx_ring *r = hx_ring_open(&geo, base, spool_fd);
    hx_cursor *c = hx_cursor_open(r, HX_ANON, -1, start_seq, named_spec[MAX_THREADS - 1].pos, 0, 1, NULL);
    char *buf = malloc(MAX_PAYLOAD + 8);
    uint64_t last = 0, end = start_seq + total_frames;
    int any = 0;
    rep_register(n_writers + n_named + n_group + i, REP_ANON, i, max_copies());
    pthread_barrier_wait(&go);
    for (;;) {
        uint64_t seq;
        size_t len;
        int rc = hx_take(c, &seq, buf, MAX_PAYLOAD + 8, &len);
        if (rc < 0) FAIL(res, "anonymous reader %d: %s", i, hx_error());
        if (rc == 0) {
            if (hx_cursor_seq(c) >= end) break;
            sched_yield();
            continue;
        }
        uint32_t w, n;
        if (any && seq <= last) FAIL(res, "anonymous reader %d: seq %llu after %llu", i,
                                     (unsigned long long)seq, (unsigned long long)last);
        if (check(buf, len, &w, &n) < 0) FAIL(res, "anonymous reader %d: frame %llu is corrupt", i,
                                               (unsigned long long)seq);
        last = seq;
        any = 1;
        res->got++;
        if (seq + 1 >= end) break;
        if (i % 2) /* every other anonymous reader lags: it is lapped, loses frames, resyncs */
            for (int k = 0; k < 8; k++) sched_yield();
    }
    res->lost = hx_cursor_lost(c);
    if (res->got + res->lost != total_frames)
        FAIL(res, "anonymous reader %d: got %llu + lost %llu != %llu frames written", i,
             (unsigned long long)res->got, (unsigned long long)res->lost, (unsigned long long)total_frames);
    return NULL;
}

static uint64_t num(const char *v) { return strtoull(v, NULL, 0); }

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s SPOOL KEY=VALUE...\n", argv[0]);
        return 2;
    }
    int n_named_given = 0;
    for (int i = 2; i < argc; i++) {
        char *k = argv[i], *v = strchr(k, '=');
        if (!v) return 2;
        *v++ = 0;
        if (!strcmp(k, "ring_offset")) geo.ring_offset = num(v);
        else if (!strcmp(k, "ring_bytes")) geo.ring_bytes = num(v);
        else if (!strcmp(k, "slot_offset")) geo.slot_offset = num(v);
        else if (!strcmp(k, "slot_count")) geo.slot_count = num(v);
        else if (!strcmp(k, "policy")) geo.policy = (int)num(v);
        else if (!strcmp(k, "checksum")) geo.checksum = (int)num(v);
        else if (!strcmp(k, "wsem")) geo.wsem = v;
        else if (!strcmp(k, "rsem")) geo.rsem = v;
        else if (!strcmp(k, "fsem")) geo.fsem = v;
        else if (!strcmp(k, "gsem")) group_sem = v;
        else if (!strcmp(k, "writers")) n_writers = (int)num(v);
        else if (!strcmp(k, "ops")) ops = (int)num(v);
        else if (!strcmp(k, "seed")) seed = (unsigned)num(v);
        else if (!strcmp(k, "anon")) n_anon = (int)num(v);
        else if (!strcmp(k, "waiters")) waiters = (int)num(v);
        else if (!strcmp(k, "group")) { /* slot:members */
            group_spec.slot = (int64_t)num(v);
            n_group = (int)num(strchr(v, ':') + 1);
        } else if (!strcmp(k, "named")) { /* slot:seq:pos */
            reader_spec *s = &named_spec[n_named_given++];
            s->kind = HX_NAMED;
            s->slot = (int64_t)strtoll(v, &v, 0);
            s->seq = strtoull(v + 1, &v, 0);
            s->pos = strtoull(v + 1, &v, 0);
        } else if (!strcmp(k, "start")) { /* seq:pos, where anonymous readers start */
            start_seq = strtoull(v, &v, 0);
            named_spec[MAX_THREADS - 1].pos = strtoull(v + 1, NULL, 0);
        } else {
            fprintf(stderr, "unknown key %s\n", k);
            return 2;
        }
    }
    n_named = n_named_given;
    if (n_writers < 1 || n_writers > MAX_THREADS || n_group > MAX_THREADS || n_named + n_anon > MAX_THREADS)
        return 2;
    spool_fd = open(argv[1], O_RDWR | O_CLOEXEC | O_NOFOLLOW);
    struct stat st;
    if (spool_fd < 0 || fstat(spool_fd, &st) < 0) {
        perror(argv[1]);
        return 3;
    }
    base = mmap(NULL, (size_t)st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, spool_fd, 0);
    if (base == MAP_FAILED) {
        perror("mmap");
        return 3;
    }
    hx_init();
    rep_init(base, (uint64_t)st.st_size);
    if (waiters) hx_register_waiters(&geo);
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
    hx_totals tot = hx_ring_totals(base);
    if (!bad && tot.next_seq - start_seq != total_frames) {
        fprintf(stderr, "FAIL the spool's NEXT_SEQ moved by %llu, %llu frames were committed\n",
                (unsigned long long)(tot.next_seq - start_seq), (unsigned long long)total_frames);
        bad = 1;
    }
    rep_print(stdout); /* what happened at each TSan report (reports.h) */
    printf("harness: %d writers, %d named, %d group members, %d anonymous%s; %llu frames, %.1f laps of the ring, "
           "%llu evicted, %llu segment growths, %llu full-ring retries, anonymous got %llu lost %llu; "
           "invariants %s\n",
           n_writers, n_named, n_group, n_anon, waiters ? ", doorbell waiters" : "", (unsigned long long)total_frames,
           (double)tot.next_pos / (double)geo.ring_bytes, (unsigned long long)tot.evicted,
           (unsigned long long)tot.growths, (unsigned long long)retries, (unsigned long long)anon_got,
           (unsigned long long)anon_lost, bad ? "FAILED" : "ok");
    return bad ? 1 : 0;
}
