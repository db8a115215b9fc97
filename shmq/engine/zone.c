/*
 * shmq/core/zone.c: growable rings -- the hot zone's pages (allocate on the
 * way up, wrap early, punch what nothing resident uses, trim).
 *
 * Called by the writer (write.c's place_batch) and trim (ring.c) with the
 * writer lock held.  fallocate runs as a blocking section (the caller's
 * lock dropped, the handle busy: a close meanwhile is deferred).
 */
#include "engine.h"

#define WRAP_SLACK_SEGS 4 /* segments kept above an early wrap's point (see zone_place) */

/* A growable ring whose zone spans more than TRIM_DUE_SEGS segments: a reader
 * that stays idle gives the consumed ones back (Spool.trim_due / trim_idle). */
#define TRIM_DUE_SEGS 4
int trim_due(eng_ring *r) {
    uint64_t seg = ld_rlx(&r->ctl[SHMQ_W_SEGMENT]);
    return seg && ld_rlx(&r->ctl[SHMQ_W_ALLOC]) > TRIM_DUE_SEGS * seg;
}

/* ---- growable rings: the hot zone ----
 *
 * A growable ring (SHMQ_W_SEGMENT != 0) is a sparse file.  The writer allocates
 * (fallocate) each segment of ring offsets before it writes in it, and pages
 * go back (PUNCH_HOLE) only where nothing resident lives:
 *  - the writer wraps early, back to offset 0, once it is past SHMQ_W_ALLOC_MIN and
 *    every named reader and group has consumed everything: no older frame can
 *    then be in its way on the next lap (so it never blocks before the
 *    ceiling), the pages above the wrap point go, and the next laps reuse the
 *    same pages, already mapped everywhere: the hot zone;
 *  - while consumers lag, it keeps climbing into fresh segments, up to the
 *    ring's end (the ceiling);
 *  - Spool.trim() (and a reader about to wait) punches all but the writer's
 *    current segment and the start allocation once nothing is resident.
 * Offsets below SHMQ_W_ALLOC and outside [SHMQ_W_HOLE_LO, SHMQ_W_HOLE_HI) have pages: SHMQ_W_ALLOC
 * is raised after allocating and lowered (or the hole widened) before
 * punching.  A full filesystem gives SHMQ_ENOSPACE before anything is evicted
 * or written, and records nothing: never SIGBUS. */

static int zone_syscall(eng_ring *r, uint64_t a, uint64_t b, int punch) {
    int rc, err = 0;
    int mode = punch ? FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE : 0;
    void *saved = ring_block(r); /* a close() meanwhile is deferred: our fd and mapping stay valid */
    rc = fallocate(r->fd, mode, (off_t)(r->ring_offset + a), (off_t)(b - a));
    if (rc < 0) err = errno;
    /* Map the pages into our page table in one call (the writer is about to
     * touch them): one fault per page would cost more than the copy. */
    else if (!punch) (void)madvise(r->ring + a, (size_t)(b - a), MADV_POPULATE_WRITE);
    ring_unblock(r, saved);
    if (ring_closing(r)) return ECANCELED;
    return rc < 0 ? err : 0;
}


static int zone_status(eng_ring *r, int err) {
    if (!err || err == EOPNOTSUPP) return 0; /* no fallocate here: pages come on first touch */
    if (err == ECANCELED) return eng_fail(SHMQ_ECLOSED, "spool handle was closed by another thread");
    if (err == ENOSPC || err == EFBIG || err == EDQUOT) return SHMQ_ENOSPACE;
    return eng_fail(-err, "%s: %s", r->path, strerror(err));
}

/* Allocate the segments holding ring offsets [a, b) (writer lock held). */
int zone_alloc(eng_ring *r, uint64_t a, uint64_t b) {
    uint64_t seg = r->segment, ring = r->ring_bytes, *c = r->ctl;
    a = a / seg * seg;
    b = (b + seg - 1) / seg * seg;
    if (b > ring) b = ring;
    uint64_t z = ld_rlx(&c[SHMQ_W_ALLOC]), hl0 = ld_rlx(&c[SHMQ_W_HOLE_LO]), hh0 = ld_rlx(&c[SHMQ_W_HOLE_HI]);
    /* [a, ALLOC) has pages unless the hole cuts into it: start at ALLOC then (a
     * batch entering the next segment would otherwise fallocate and populate its
     * current one again, doubling what each growth costs). */
    if (a < z && !(hl0 < hh0 && a < hh0 && b > hl0)) a = z;
    if (a >= b) return 0;
    if (crash_point(r, "allocating")) return SHMQ_ECALLBACK;
    int st = zone_status(r, zone_syscall(r, a, b, 0));
    if (st) return st; /* (nothing recorded: a retry allocates again) */
    /* Recorded once the pages exist: a writer killed in between leaves pages above
     * SHMQ_W_ALLOC, which the next trim (it punches to the ring's end) gives back. */
    if (b > z) {
        st_rlx(&c[SHMQ_W_ALLOC], b);
        st_rlx(&c[SHMQ_W_GROWTHS], ld_rlx(&c[SHMQ_W_GROWTHS]) + (b - z + seg - 1) / seg);
    }
    uint64_t hl = ld_rlx(&c[SHMQ_W_HOLE_LO]), hh = ld_rlx(&c[SHMQ_W_HOLE_HI]); /* the hole shrinks: after */
    if (a <= hl && b > hl) st_rlx(&c[SHMQ_W_HOLE_LO], b < hh ? b : hh);
    else if (a < hh && b >= hh) st_rlx(&c[SHMQ_W_HOLE_HI], a > hl ? a : hl);
    return 0;
}

/* Punch out the whole segments within ring offsets [a, b), where nothing is
 * resident (writer lock held).  A lock-free reader still copying a frame
 * evicted there reads zeros (and fails its seqlock check) or faults one page
 * back in, released by the next punch. */
int zone_punch(eng_ring *r, uint64_t a, uint64_t b) {
    uint64_t seg = r->segment, ring = r->ring_bytes, *c = r->ctl;
    a = (a + seg - 1) / seg * seg;
    b = b >= ring ? ring : b / seg * seg;
    if (a >= b) return 0;
    uint64_t z = ld_rlx(&c[SHMQ_W_ALLOC]);
    if (b >= z) {
        if (a < z) st_rlx(&c[SHMQ_W_ALLOC], a);
    } else { /* a hole below the zone's top (trim): the hole words cover it first */
        uint64_t hl = ld_rlx(&c[SHMQ_W_HOLE_LO]), hh = ld_rlx(&c[SHMQ_W_HOLE_HI]);
        if (hl >= hh) hl = a, hh = b;
        st_rlx(&c[SHMQ_W_HOLE_LO], a < hl ? a : hl);
        st_rlx(&c[SHMQ_W_HOLE_HI], b > hh ? b : hh);
    }
    if (crash_point(r, "releasing")) return SHMQ_ECALLBACK;
    int st = zone_status(r, zone_syscall(r, a, b, 1));
    return st == SHMQ_ENOSPACE ? 0 : st;
}

/* A growable ring, after the normal placement of a batch starting at `start`
 * (writer lock held): wrap early if everything is consumed, then allocate the
 * segments the batch enters.  May rewrite the placement.  0, SHMQ_ENOSPACE or
 * an error; nothing is evicted unless it returns 0. */
int zone_place(eng_ring *r, uint64_t start, size_t count, const uint64_t *needs, uint64_t total, uint64_t *placed,
               Placement *pl, uint64_t next_seq) {
    uint64_t ring = r->ring_bytes, seg = r->segment, n_off = start % ring, lap = start - n_off;
    uint64_t top = n_off, low = 0; /* offsets touched: [n_off, top) this lap, [0, low) the next */
    for (size_t k = 0; k < count; k++) {
        if (placed[k] < lap + ring) {
            if (placed[k] - lap + needs[k] > top) top = placed[k] - lap + needs[k];
        } else if (placed[k] - lap - ring + needs[k] > low) {
            low = placed[k] - lap - ring + needs[k];
        }
    }
    for (int p = 0; p < pl->npads; p++) {
        if (p == 0 && pl->pads_off[p] >= n_off) {
            if (pl->pads_off[p] + SHMQ_FRAME_BYTES > top) top = pl->pads_off[p] + SHMQ_FRAME_BYTES;
        } else if (pl->pads_off[p] + SHMQ_FRAME_BYTES > low) {
            low = pl->pads_off[p] + SHMQ_FRAME_BYTES;
        }
    }
    uint64_t *c = r->ctl, z = ld_rlx(&c[SHMQ_W_ALLOC]), hl = ld_rlx(&c[SHMQ_W_HOLE_LO]), hh = ld_rlx(&c[SHMQ_W_HOLE_HI]);
    /* Offsets below SHMQ_W_ALLOC and outside the hole have pages. */
    int need = top > z || low > z || (hl < hh && ((n_off < hh && top > hl) || (low && low > hl)));
    /* The early wrap is tried when the writer enters a new segment (a few loads per segment). */
    int entering = n_off % seg == 0 || (top - 1) / seg != n_off / seg || low;
    if (!r->lap_ns) r->lap_ns = mono_ns(); /* this handle's first lap starts with its first write */
    if (!need && !entering) return 0;
    uint64_t gap = ring - n_off;
    if (entering && r->policy != 0 && n_off && n_off >= ld_rlx(&c[SHMQ_W_ALLOC_MIN]) && total <= n_off &&
        gap >= SHMQ_FRAME_BYTES && gap <= 0xFFFFFFF8ull) {
        uint64_t floor = 0;
        int found = slot_floor(r, SHMQ_S_POS, &floor), caught = found && floor >= start;
        /* A writer that bounds its own lead (wrap_lag: a pool's byte window) wraps
         * with consumers behind: what they have not read stays resident between
         * the batch and the pad.  A zone at least that lead long keeps the next
         * lap off their frames while the bound holds; if it does not, a put meets
         * them and reports the ring full (that writer retries after replies). */
        int lagged = found && !caught && r->wrap_lag && start - floor <= r->wrap_lag && n_off >= r->wrap_lag &&
                     floor >= lap && floor - lap >= total;
        if (found && !caught && !lagged && need && start - floor <= 2 * seg) {
            if (crash_point(r, "catching-up")) return SHMQ_ECALLBACK;
            uint64_t now = mono_ns(), lap = now > r->lap_ns ? now - r->lap_ns : 0;
            int w = wait_caught_up(r, start, start - floor, lap / 16); /* cheaper than fresh pages */
            if (w == SHMQ_ECLOSED) return zone_status(r, ECANCELED);
            caught = w;
        } else if (found && !caught && !lagged && n_off + total > HOT_BYTES && start >= r->hot_retry) {
            /* Past a fixed ring's hot region, in pages the zone has: wait for
             * consumers a few batches behind as a fixed ring does (hot_wait),
             * rather than stride on through a grown zone's colder pages
             * (striding, a grown spool of 1 MiB frames runs at 45% of a
             * fixed one). */
            int w = hot_wait(r, start, floor, total, HOT_BYTES);
            if (w < 0) return w; /* SHMQ_ECLOSED */
            caught = w;
        }
        if (caught || lagged) { /* every consumer is caught up, or behind by a bounded lead */
            if (total > z || (hl < hh && total > hl)) { /* first: a full filesystem evicts nothing */
                int st = zone_alloc(r, 0, total);
                if (st) return st;
            }
            /* Evicts what is read: all (FIRST_POS = lap + ring), or up to the slowest cursor */
            int st = make_room(r, lap + total, next_seq, lap + ring);
            if (st < 0 && st != SHMQ_EFULL && st != SHMQ_EPINNED) return st; /* an error */
            if (st == 0) {
                r->lap_ns = mono_ns(); /* a new lap of the hot zone */
                place_at_lap(pl, placed, needs, count, n_off, gap, lap + ring);
                /* All above the pad is dead: give back what the zone holds there,
                 * but for WRAP_SLACK_SEGS segments above the wrap point: laps end at
                 * varying segments (wherever the consumers happened to be caught
                 * up), and punching right above each would make the next longer lap
                 * allocate fresh pages again.  Only up to ALLOC: a punch to the
                 * ring's end would walk gigabytes of holes each time. */
                return zone_punch(r, n_off + SHMQ_FRAME_BYTES + WRAP_SLACK_SEGS * seg, ld_rlx(&r->ctl[SHMQ_W_ALLOC]));
            } /* a pin holds a frame: no early wrap this time */
        }
    }
    if (!need) return 0;
    int st = top > n_off ? zone_alloc(r, n_off, top) : 0;
    if (st == 0 && low) st = zone_alloc(r, 0, low);
    return st;
}

/* Spool.trim with the writer lock held: a growable ring with nothing
 * resident (after evicting what every named reader and group consumed)
 * keeps only the writer's current segment and the start allocation (below
 * ALLOC_MIN).  0, or an error. */
int trim_locked(eng_ring *r) {
    uint64_t *c = r->ctl, seg = r->segment, ring = r->ring_bytes;
    uint64_t nseq = ld_rlx(&c[SHMQ_W_NEXT_SEQ]), npos = ld_rlx(&c[SHMQ_W_NEXT_POS]);
    int rc = 0;
    if (r->policy != 0) rc = make_room(r, ld_rlx(&c[SHMQ_W_FIRST_POS]), nseq, npos);
    if (rc < 0 && rc != SHMQ_EFULL && rc != SHMQ_EPINNED) return rc; /* an error */
    rc = 0;
    if (ld_rlx(&c[SHMQ_W_FIRST_SEQ]) >= nseq) { /* nothing resident */
        /* Keep the writer's current segment and the start allocation below
         * ALLOC_MIN: the writer wraps early into it next, and freeing it would
         * make every lap after a trim pay for fresh pages again. */
        uint64_t cur = npos % ring / seg * seg, keep = (ld_rlx(&c[SHMQ_W_ALLOC_MIN]) + seg - 1) / seg * seg;
        rc = zone_punch(r, cur + seg > keep ? cur + seg : keep, ring);
        if (rc == 0 && cur > keep) rc = zone_punch(r, keep, cur);
    }
    return rc < 0 && rc != SHMQ_ENOSPACE ? rc : 0;
}
