/*
 * examples/c/producer.c: a C producer on a shmq spool that Python reads.
 *
 *   ./producer SPOOL COUNT [SIZE]
 *
 * Opens SPOOL (a path, or a bare name in /dev/shm/shmq-<uid>/), creating it
 * (64 MiB, block policy: writers wait for the slowest named reader) if it
 * does not exist, and puts COUNT frames of SIZE bytes (default 100), in
 * batches of up to 64.  Frame i starts with "i=<i>;" so a reader can check
 * it got every frame once, in order.  Any Python process reads them:
 *
 *   with shmq.Spool.open(SPOOL) as sp, sp.reader("python") as r:
 *       for f in r: print(f.seq, f.data[:16])
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "shmq.h"

#define BATCH 64

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: %s SPOOL COUNT [SIZE]\n", argv[0]);
        return 2;
    }
    long long count = atoll(argv[2]);
    size_t size = argc > 3 ? (size_t)atol(argv[3]) : 100;
    if (size < 24) size = 24;
    shmq_spool *sp;
    shmq_create_options opts = {.capacity = 64 << 20, .on_full = SHMQ_POLICY_BLOCK, .leases = -1, .exist_ok = 1};
    int rc = shmq_create(argv[1], &opts, &sp);
    if (rc < 0) {
        fprintf(stderr, "producer: %s: %s (%s)\n", argv[1], shmq_strerror(rc), shmq_errmsg());
        return 1;
    }
    char *bufs = calloc(BATCH, size);
    shmq_iovec frames[BATCH];
    long long i = 0;
    int64_t first = -1;
    while (i < count) {
        int n = count - i < BATCH ? (int)(count - i) : BATCH;
        for (int k = 0; k < n; k++) {
            char *b = bufs + (size_t)k * size;
            memset(b, '.', size);
            int h = snprintf(b, size, "i=%lld;", i + k);
            b[h] = '.'; /* (snprintf's NUL) */
            frames[k] = (shmq_iovec){b, size};
        }
        int64_t seq = shmq_put_many(sp, frames, (size_t)n, SHMQ_CODEC_RAW, SHMQ_FOREVER);
        if (seq < 0) {
            fprintf(stderr, "producer: put: %s (%s)\n", shmq_strerror((int)seq), shmq_errmsg());
            shmq_close(sp);
            return 1;
        }
        if (first < 0) first = seq;
        i += n;
    }
    printf("producer: put %lld frames of %zu bytes, seqs %lld..%lld\n", count, size, (long long)first,
           (long long)(first + count - 1));
    free(bufs);
    shmq_close(sp);
    return 0;
}
