/*
 * tests/capi_driver.c: the C side of tests/test_capi.py -- small programs
 * over shmq.h, one per subcommand, that print what they did on stdout (one
 * line, key=value) for the Python side to check.
 *
 *   driver slowread SPOOL TOTAL PAUSE_US  anonymous reader from seq 0, pausing PAUSE_US
 *                                          between frames: got, lost, the lost
 *                                          frames' count from the payload gaps
 *   driver holdlock SPOOL                 take the writer lock (a reservation) and say
 *                                          "held", then wait to be SIGKILLed
 *   driver open SPOOL                     shmq_open: its code and message
 *   driver put SPOOL COUNT TIMEOUT        put COUNT frames "i=<i>;", report the seqs
 *   driver group SPOOL NAME TOTAL         a member of group NAME: take until the group's
 *                                          position reaches TOTAL; print every seq taken
 *   driver errors DIR                     the failure codes: a missing spool, a foreign
 *                                          file, a name too long, a frame too large, an empty read, a
 *                                          buffer too small, a policy "error" spool full,
 *                                          a second reservation, a put inside one
 *   driver sync SPOOL ON                  shmq_set_sync(ON), then a put, a put_many of two
 *                                          and a committed reservation ("s0" .. "s3")
 *   driver blocked SPOOL TIMEOUT           one put of 100 B with TIMEOUT (a full block spool):
 *                                          its code, the wall and CPU milliseconds it took
 *   driver threads SPOOL WRITERS READERS PER
 *                                          WRITERS threads put PER frames each, READERS
 *                                          threads share one named reader: no loss, no
 *                                          duplicate, each writer's frames in order
 */
#define _GNU_SOURCE /* usleep, pause */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "shmq.h"

static int fail(const char *what, int rc) {
    printf("error=%s code=%d %s: %s\n", what, rc, shmq_strerror(rc), shmq_errmsg());
    fflush(stdout);
    return 1;
}

static shmq_spool *open_or_die(const char *path) {
    shmq_spool *sp;
    int rc = shmq_open(path, 0.2, &sp);
    if (rc < 0) exit(fail("open", rc));
    return sp;
}

/* The index a frame "i=<i>;..." carries, or -1. */
static long long index_of(const shmq_frame *f) {
    long long i;
    char tmp[32];
    size_t n = f->len < sizeof tmp - 1 ? f->len : sizeof tmp - 1;
    memcpy(tmp, f->data, n);
    tmp[n] = 0;
    return sscanf(tmp, "i=%lld;", &i) == 1 ? i : -1;
}

static int slowread(const char *path, long long total, long pause_us) {
    shmq_spool *sp = open_or_die(path);
    shmq_reader *r;
    int rc = shmq_reader_open(sp, NULL, 0, &r);
    if (rc < 0) return fail("reader", rc);
    printf("ready\n");
    fflush(stdout);
    static char buf[65536];
    shmq_frame f;
    long long got = 0, last = -1, gaps = 0, bad = 0;
    while (last < total - 1) {
        rc = shmq_get(r, buf, sizeof buf, &f, 10.0);
        if (rc < 0) return fail("get", rc);
        long long i = index_of(&f);
        if (i <= last || (long long)f.seq != i) bad++;
        gaps += i - last - 1;
        last = i;
        got++;
        if (pause_us) usleep((unsigned)pause_us);
    }
    printf("got=%lld lost=%llu gaps=%lld bad=%lld\n", got, (unsigned long long)shmq_reader_lost(r), gaps, bad);
    shmq_reader_close(r);
    shmq_close(sp);
    return 0;
}

static int holdlock(const char *path) {
    shmq_spool *sp = open_or_die(path);
    shmq_reservation rv;
    int rc = shmq_reserve(sp, 64, SHMQ_CODEC_RAW, 5.0, &rv);
    if (rc < 0) return fail("reserve", rc);
    memset(rv.data, 'x', 64);
    printf("held pid=%d\n", (int)getpid());
    fflush(stdout);
    for (;;) pause(); /* until SIGKILLed: the lock stays held */
}

static int open_only(const char *path) {
    shmq_spool *sp;
    int rc = shmq_open(path, 0, &sp);
    printf("code=%d msg=%s\n", rc, rc < 0 ? shmq_errmsg() : "");
    if (rc == 0) shmq_close(sp);
    return 0;
}

static int put(const char *path, long long count, double timeout) {
    shmq_spool *sp = open_or_die(path);
    int64_t first = -1, seq = -1;
    for (long long i = 0; i < count; i++) {
        char msg[32];
        int n = snprintf(msg, sizeof msg, "i=%lld;", i);
        seq = shmq_put(sp, msg, (size_t)n, SHMQ_CODEC_RAW, timeout);
        if (seq < 0) return fail("put", (int)seq);
        if (first < 0) first = seq;
    }
    printf("first=%lld last=%lld\n", (long long)first, (long long)seq);
    shmq_close(sp);
    return 0;
}

static int sync_writes(const char *path, int on) {
    shmq_spool *sp = open_or_die(path);
    int rc = shmq_set_sync(sp, on);
    if (rc < 0) return fail("set_sync", rc);
    int64_t seq = shmq_put(sp, "s0", 2, SHMQ_CODEC_RAW, SHMQ_FOREVER);
    if (seq < 0) return fail("put", (int)seq);
    shmq_iovec two[2] = {{"s1", 2}, {"s2", 2}};
    if ((seq = shmq_put_many(sp, two, 2, SHMQ_CODEC_RAW, SHMQ_FOREVER)) < 0) return fail("put_many", (int)seq);
    shmq_reservation rv;
    if ((rc = shmq_reserve(sp, 2, SHMQ_CODEC_RAW, SHMQ_FOREVER, &rv)) < 0) return fail("reserve", rc);
    memcpy(rv.data, "s3", 2);
    if ((seq = shmq_commit(&rv)) < 0) return fail("commit", (int)seq);
    printf("last=%lld\n", (long long)seq);
    shmq_close(sp);
    return 0;
}

static int group(const char *path, const char *name, unsigned long long total) {
    shmq_spool *sp = open_or_die(path);
    shmq_reader *r;
    int rc = shmq_reader_open(sp, name, SHMQ_READER_GROUP, &r);
    if (rc < 0) return fail("reader", rc);
    printf("ready\n");
    fflush(stdout);
    static char buf[65536];
    shmq_frame fs[8];
    printf("seqs=");
    for (;;) {
        int n = shmq_take(r, buf, sizeof buf, fs, 1 + (size_t)(rand() % 8), 0.05);
        if (n == SHMQ_EEMPTY) {
            if (shmq_reader_position(r) >= total) break;
            continue;
        }
        if (n < 0) return fail("take", n);
        for (int k = 0; k < n; k++) printf("%llu,", (unsigned long long)fs[k].seq);
    }
    printf("\n");
    shmq_reader_close(r);
    shmq_close(sp);
    return 0;
}

/* ---- many threads on one handle ---- */
static shmq_spool *tsp;
static shmq_reader *tr;
static long long per, total_frames;
static int nwriters;
static unsigned char *seen; /* per (writer, i): times taken */
static long long *order_errors;
static _Atomic long long taken_total;

static void *twriter(void *arg) {
    long w = (long)arg;
    for (long long i = 0; i < per; i++) {
        long long tag[2] = {w, i};
        int64_t rc = shmq_put(tsp, tag, sizeof tag, SHMQ_CODEC_RAW, SHMQ_FOREVER);
        if (rc < 0) {
            fail("put", (int)rc);
            exit(1);
        }
    }
    return NULL;
}

static void *treader(void *arg) {
    long me = (long)arg;
    long long *last = calloc((size_t)nwriters, sizeof *last);
    for (int w = 0; w < nwriters; w++) last[w] = -1;
    char buf[4096];
    shmq_frame fs[16];
    while (taken_total < total_frames) {
        int n = shmq_take(tr, buf, sizeof buf, fs, 16, 0.05);
        if (n == SHMQ_EEMPTY) continue;
        if (n < 0) {
            fail("take", n);
            exit(1);
        }
        for (int k = 0; k < n; k++) {
            long long tag[2];
            memcpy(tag, fs[k].data, sizeof tag);
            if (tag[0] < 0 || tag[0] >= nwriters || tag[1] < 0 || tag[1] >= per) {
                order_errors[me]++;
                continue;
            }
            __atomic_fetch_add(&seen[tag[0] * per + tag[1]], 1, __ATOMIC_RELAXED);
            if (tag[1] <= last[tag[0]]) order_errors[me]++; /* a writer's frames in its order, per reader thread */
            last[tag[0]] = tag[1];
        }
        taken_total += n;
    }
    free(last);
    return NULL;
}

static int threads(const char *path, int writers, int readers, long long nper) {
    tsp = open_or_die(path);
    int rc = shmq_reader_open(tsp, "threads", 0, &tr);
    if (rc < 0) return fail("reader", rc);
    nwriters = writers;
    per = nper;
    total_frames = writers * nper;
    seen = calloc((size_t)total_frames, 1);
    order_errors = calloc((size_t)readers, sizeof *order_errors);
    pthread_t th[64];
    int t = 0;
    for (long w = 0; w < writers; w++) pthread_create(&th[t++], NULL, twriter, (void *)w);
    for (long k = 0; k < readers; k++) pthread_create(&th[t++], NULL, treader, (void *)k);
    for (int i = 0; i < t; i++) pthread_join(th[i], NULL);
    long long missing = 0, dup = 0, disorder = 0;
    for (long long f = 0; f < total_frames; f++) {
        if (!seen[f]) missing++;
        if (seen[f] > 1) dup++;
    }
    for (int k = 0; k < readers; k++) disorder += order_errors[k];
    printf("frames=%lld taken=%lld missing=%lld dup=%lld disorder=%lld lost=%llu\n", total_frames,
           (long long)taken_total, missing, dup, disorder, (unsigned long long)shmq_reader_lost(tr));
    shmq_reader_close(tr);
    shmq_close(tsp);
    return 0;
}

/* "name=code" for each failure the C API reports (the test compares them). */
static int errors(const char *dir) {
    char path[512], foreign[512];
    snprintf(path, sizeof path, "%s/errors.spool", dir);
    snprintf(foreign, sizeof foreign, "%s/foreign", dir);
    shmq_spool *sp;
    printf("missing=%d ", shmq_open(path, 0, &sp));
    FILE *f = fopen(foreign, "w");
    for (int i = 0; i < 8192; i++) fputc('z', f);
    fclose(f);
    printf("foreign=%d ", shmq_open(foreign, 0, &sp));
    shmq_create_options o = {.capacity = 4096, .on_full = SHMQ_POLICY_ERROR, .leases = -1};
    int rc = shmq_create(path, &o, &sp);
    if (rc < 0) return fail("create", rc);
    printf("exists=%d ", shmq_create(path, &o, &(shmq_spool *){0}));
    char longname[600]; /* 233 bytes: its temporary name would pass NAME_MAX (255) */
    snprintf(longname, sizeof longname, "%s/%0233d", dir, 0);
    printf("longname=%d ", shmq_create(longname, &o, &(shmq_spool *){0}));
    static char big[8192], buf[256];
    printf("toolarge=%d ", (int)shmq_put(sp, big, sizeof big, 0, 0));
    shmq_reader *r;
    rc = shmq_reader_open(sp, "errs", 0, &r);
    if (rc < 0) return fail("reader", rc);
    printf("busy=%d ", shmq_reader_open(sp, "errs", 0, &(shmq_reader *){0}));
    printf("kind=%d ", shmq_reader_open(sp, "errs", SHMQ_READER_GROUP, &(shmq_reader *){0}));
    shmq_frame fr;
    printf("empty=%d ", shmq_get(r, buf, sizeof buf, &fr, 0.01));
    shmq_put(sp, big, 100, 0, 0);
    rc = shmq_get(r, buf, 10, &fr, 0);
    printf("size=%d need=%zu ", rc, fr.len);
    printf("after=%d ", shmq_get(r, buf, sizeof buf, &fr, 0) == 0 && fr.len == 100 ? 0 : -1);
    long long n = 0;
    while (shmq_put(sp, big, 100, 0, 0) >= 0) n++; /* the named reader holds the ring: policy error */
    printf("full=%d ", (int)shmq_put(sp, big, 100, 0, 0));
    shmq_reservation rv, rv2;
    rc = shmq_reserve(sp, 0, 0, 0, &rv); /* full too: nothing reserved */
    printf("reservefull=%d ", rc);
    shmq_reader_close(r); /* the named reader stays in the table: it holds the ring */
    shmq_close(sp);
    shmq_destroy(path);
    o.on_full = SHMQ_POLICY_OVERWRITE;
    if ((rc = shmq_create(path, &o, &sp)) < 0) return fail("create", rc);
    rc = shmq_reserve(sp, 8, 0, 0, &rv);
    printf("reserve=%d ", rc);
    printf("second=%d ", shmq_reserve(sp, 8, 0, 0, &rv2)); /* this thread holds the lock: refused */
    printf("inside=%d ", (int)shmq_put(sp, "x", 1, 0, 0));
    memcpy(rv.data, "reserved", 8);
    printf("commit=%d ", (int)shmq_commit(&rv));
    printf("again=%d ", (int)shmq_commit(&rv));
    printf("nothing=%d ", shmq_abandon(&rv)); /* committed: a no-op */
    shmq_reader *anon;
    shmq_frame fr2;
    rc = shmq_reader_open(sp, NULL, 0, &anon);
    printf("read=%d\n", rc == 0 && shmq_get(anon, buf, sizeof buf, &fr2, 0) == 0 && fr2.len == 8 &&
                            !memcmp(fr2.data, "reserved", 8) ? 0 : -1);
    shmq_reader_close(anon);
    shmq_close(sp);
    printf("destroy=%d ", shmq_destroy(path));
    printf("gone=%d\n", shmq_destroy(path));
    return 0;
}

static double ms_of(clockid_t clock) {
    struct timespec ts;
    clock_gettime(clock, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

/* A put that waits for room until its timeout: what it returned, and how much
 * CPU the wait burnt (a waiter sleeps; one that loops shows its wall time). */
static int blocked(const char *path, double timeout) {
    shmq_spool *sp = open_or_die(path);
    static char msg[100];
    double wall = ms_of(CLOCK_MONOTONIC), cpu = ms_of(CLOCK_PROCESS_CPUTIME_ID);
    int64_t rc = shmq_put(sp, msg, sizeof msg, SHMQ_CODEC_RAW, timeout);
    printf("code=%lld wall_ms=%.1f cpu_ms=%.1f\n", (long long)rc, ms_of(CLOCK_MONOTONIC) - wall,
           ms_of(CLOCK_PROCESS_CPUTIME_ID) - cpu);
    shmq_close(sp);
    return 0;
}

int main(int argc, char **argv) {
    if (argc < 3) return 2;
    const char *cmd = argv[1], *path = argv[2];
    if (!strcmp(cmd, "slowread") && argc == 5) return slowread(path, atoll(argv[3]), atol(argv[4]));
    if (!strcmp(cmd, "holdlock") && argc == 3) return holdlock(path);
    if (!strcmp(cmd, "open") && argc == 3) return open_only(path);
    if (!strcmp(cmd, "put") && argc == 5) return put(path, atoll(argv[3]), atof(argv[4]));
    if (!strcmp(cmd, "group") && argc == 5) return group(path, argv[3], strtoull(argv[4], NULL, 10));
    if (!strcmp(cmd, "errors") && argc == 3) return errors(path);
    if (!strcmp(cmd, "sync") && argc == 4) return sync_writes(path, atoi(argv[3]));
    if (!strcmp(cmd, "blocked") && argc == 4) return blocked(path, atof(argv[3]));
    if (!strcmp(cmd, "threads") && argc == 6) return threads(path, atoi(argv[3]), atoi(argv[4]), atoll(argv[5]));
    fprintf(stderr, "usage: see tests/capi_driver.c\n");
    return 2;
}
