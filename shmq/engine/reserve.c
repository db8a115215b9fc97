/*
 * shmq/engine/reserve.c: reservations -- zero-copy writes.  eng_reserve
 * takes the writer lock and places one frame (write.c's place_batch, as a
 * put does); the caller writes the payload in place; eng_resv_commit
 * publishes it (write.c's commit_batch) and releases the lock;
 * eng_resv_abandon releases it with nothing published.
 *
 * A handle has at most one open reservation (it holds the writer lock);
 * the thread holding it is recorded, so that a put from it fails instead of
 * deadlocking.
 */
#include "engine.h"

/* Place one frame of `nbytes` (writer lock held): 0 and *rv's seq, off,
 * stored, end filled, or a status (nothing changed), or an error. */
int reserve_locked(eng_ring *r, uint64_t nbytes, eng_resv *rv) {
    uint64_t need = SHMQ_FRAME_BYTES + ((nbytes + 7) & ~(uint64_t)7), placed;
    Placement pl;
    int st = place_batch(r, 1, &need, need, -1, &placed, &pl);
    if (st != 0) return st;
    write_pads(r, &pl, now_ns());
    populate_ahead(r, placed, need); /* the caller writes the payload in place: no fault per page */
    /* A header that is not frame `seq` yet: nothing past NEXT_SEQ is read, and
     * recovery after a kill re-derives NEXT_POS from committed frames only. */
    memset(r->ring + placed % r->ring_bytes, 0, SHMQ_FRAME_BYTES);
    rv->seq = pl.seq0;
    rv->off = placed % r->ring_bytes;
    rv->nbytes = nbytes;
    rv->stored = need;
    rv->end = pl.end;
    rv->start = pl.start;
    return 0;
}

/* Publish a reserved frame whose payload is written (writer lock held;
 * the caller releases it): 0, or (rv->sync) the msync's error, nothing
 * published. */
int commit_reserved(eng_ring *r, const eng_resv *rv) {
    char *payload = r->ring + rv->off + SHMQ_FRAME_BYTES;
    uint64_t pad = rv->stored - SHMQ_FRAME_BYTES - rv->nbytes;
    if (pad) memset(payload + rv->nbytes, 0, (size_t)pad);
    uint64_t ts = now_ns();
    shmq_frame_header h = {rv->seq, (uint32_t)rv->stored, (uint32_t)rv->nbytes, ts, 0, 0, (uint8_t)rv->codec, 0};
    if (r->checksum) {
        h.crc = eng_crc(0, (const unsigned char *)payload, (size_t)rv->nbytes);
        h.flags = SHMQ_FLAG_CRC;
    }
    memcpy(r->ring + rv->off, &h, SHMQ_FRAME_BYTES);
    if (rv->sync) { /* durable before published, as a sync put */
        int st = eng_sync_ring(r, rv->start, rv->end);
        if (st < 0) return st;
    }
    commit_batch(r, rv->seq + 1, rv->end, 1, rv->nbytes, ts);
    return 0;
}

/* Take the writer lock (up to lock_wait) and place one frame of `nbytes`
 * for `rv`: 0 (rv open: the payload goes at r->ring + rv->off + 32), a
 * status (SHMQ_ELOCKED, SHMQ_EFULL, SHMQ_EPINNED, SHMQ_ETOOLARGE,
 * SHMQ_ENOSPACE: nothing held), or an error (SHMQ_ESTATE: this thread
 * already holds a reservation or runs a callout of this handle). */
int eng_reserve(eng_ring *r, uint64_t nbytes, int codec, double lock_wait, eng_resv *rv) {
    int st = writer_reentry(r, "reserve");
    if (st) return st;
    if (nbytes > r->max_payload) return SHMQ_ETOOLARGE;
    int lk = eng_sem_lock(r->wsem, lock_wait, r->hooks, r, &r->ctl[SHMQ_W_LOCK_HOLDER], r->holder);
    if (lk != 0) return lk > 0 ? SHMQ_ELOCKED : lk;
    rv->ring = r;
    rv->codec = codec;
    rv->open = 0;
    st = reserve_locked(r, nbytes, rv);
    if (st != 0) {
        wlock_release(r);
        ring_finish(r);
        return st;
    }
    rv->open = 1;
    r->resv = rv;
    atomic_store_explicit(&r->resv_thread, this_thread(), memory_order_relaxed);
    return 0;
}

static void resv_unlock(eng_resv *rv) {
    eng_ring *r = rv->ring;
    rv->open = 0;
    if (r->resv == rv) {
        r->resv = NULL;
        atomic_store_explicit(&r->resv_thread, 0, memory_order_relaxed);
    }
    if (r->base) wlock_release(r);
}

/* Publish the reserved frame and release the lock: its seq, or SHMQ_ESTATE
 * (not open) / SHMQ_ECLOSED (the handle is closed: nothing published), or
 * (rv->sync) an msync's error: of the frame, before the commit (abandoned:
 * nothing published), or of the header page after it (published, not known
 * durable). */
int64_t eng_resv_commit(eng_resv *rv) {
    if (!rv->open) return eng_fail(SHMQ_ESTATE, "the reservation is closed (committed or abandoned)");
    eng_ring *r = rv->ring;
    if (!r->base) {
        rv->open = 0;
        return eng_fail(SHMQ_ECLOSED, "spool handle is closed");
    }
    int st = commit_reserved(r, rv);
    if (st < 0) {
        eng_resv_abandon(rv);
        return st;
    }
    resv_unlock(rv);
    ring_bell(r, r->rsem);
    /* ... and the commit itself.  Failing, the frame is published but not
     * known durable: the error says so, as a sync put's does. */
    if (rv->sync && (st = eng_sync_header(r)) < 0) return st;
    return (int64_t)rv->seq;
}

/* Release the lock with nothing published (a no-op when not open): the
 * space is reused by the next write. */
void eng_resv_abandon(eng_resv *rv) {
    if (!rv->open) return;
    if (rv->ring->base) unplace(rv->ring, rv->seq, rv->start);
    resv_unlock(rv);
}
