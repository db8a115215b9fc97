/*
 * examples/c/consumer.c: a C consumer of a shmq spool that Python writes.
 *
 *   ./consumer SPOOL NAME COUNT [--group] [--timeout S]
 *
 * Attaches the durable named reader NAME (with --group: a member of group
 * NAME, sharing the stream with the group's other members, Python or C) and
 * reads COUNT frames, waiting up to S seconds (default 10) for each on the
 * spool's doorbell, the one Python's readers wait on.  Prints how many it
 * got, the frames lost to an overwrite (exact), and whether frames that
 * start with "i=<i>;" (examples/c/producer.c, or a Python writer doing the
 * same) came in order.  Python writes them with, for example:
 *
 *   with shmq.Spool.open(SPOOL) as sp:
 *       for i in range(COUNT): sp.put(f"i={i};".encode())
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "shmq.h"

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: %s SPOOL NAME COUNT [--group] [--timeout S]\n", argv[0]);
        return 2;
    }
    long long count = atoll(argv[3]);
    int flags = 0;
    double timeout = 10;
    for (int a = 4; a < argc; a++) {
        if (!strcmp(argv[a], "--group")) flags |= SHMQ_READER_GROUP;
        else if (!strcmp(argv[a], "--timeout") && a + 1 < argc) timeout = atof(argv[++a]);
    }
    shmq_spool *sp;
    shmq_reader *r;
    int rc = shmq_open(argv[1], 0, &sp);
    if (rc == 0 && (rc = shmq_reader_open(sp, argv[2], flags, &r)) < 0) shmq_close(sp);
    if (rc < 0) {
        fprintf(stderr, "consumer: %s: %s (%s)\n", argv[1], shmq_strerror(rc), shmq_errmsg());
        return 1;
    }
    static char buf[1 << 20];
    shmq_frame f;
    long long got = 0, last = -1;
    int ordered = 1;
    while (got < count) {
        rc = shmq_get(r, buf, sizeof buf, &f, timeout);
        if (rc < 0) break;
        long long i;
        if (f.len > 2 && sscanf((const char *)f.data, "i=%lld;", &i) == 1) {
            if (i <= last) ordered = 0;
            last = i;
        }
        got++;
    }
    printf("consumer: got %lld frames, lost %llu, %s%s%s\n", got, (unsigned long long)shmq_reader_lost(r),
           ordered ? "in order" : "OUT OF ORDER", rc < 0 ? "; stopped: " : "", rc < 0 ? shmq_strerror(rc) : "");
    shmq_reader_close(r);
    shmq_close(sp);
    return rc < 0 && rc != SHMQ_EEMPTY ? 1 : 0;
}
