/*
 * stress/bench_cproducer.c: the C producer of stress/bench.py's "C producer"
 * rows (bench_contenders.SpoolCProducer): it opens the spool, waits for a
 * line on stdin, COUNT (the start of the timed run: its exec and open are
 * not timed), then puts COUNT frames of SIZE bytes through shmq.h, one
 * shmq_put each (or shmq_put_many batches of BATCH), and exits.  A Python
 * named reader (the row's consumer) reads them.
 *
 *   bench_cproducer SPOOL SIZE [BATCH]     (then COUNT on stdin)
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "shmq.h"

int main(int argc, char **argv) {
    if (argc < 3) return 2;
    size_t size = (size_t)atol(argv[2]);
    int batch = argc > 3 ? atoi(argv[3]) : 1;
    if (batch < 1 || batch > 1024) return 2;
    shmq_spool *sp;
    int rc = shmq_open(argv[1], 0, &sp);
    if (rc < 0) {
        fprintf(stderr, "bench_cproducer: %s: %s\n", shmq_strerror(rc), shmq_errmsg());
        return 1;
    }
    char *buf = malloc(size ? size : 1);
    memset(buf, 'x', size);
    shmq_iovec iov[1024];
    for (int k = 0; k < batch; k++) iov[k] = (shmq_iovec){buf, size};
    long long count;
    if (scanf("%lld", &count) != 1) return 1; /* the timed run starts */
    for (long long i = 0; i < count; i += batch) {
        int64_t seq = batch == 1 ? shmq_put(sp, buf, size, SHMQ_CODEC_RAW, SHMQ_FOREVER)
                                 : shmq_put_many(sp, iov, (size_t)batch, SHMQ_CODEC_RAW, SHMQ_FOREVER);
        if (seq < 0) {
            fprintf(stderr, "bench_cproducer: put: %s (%s)\n", shmq_strerror((int)seq), shmq_errmsg());
            return 1;
        }
    }
    free(buf);
    shmq_close(sp);
    return 0;
}
