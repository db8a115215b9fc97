/*
 * shmq/engine/take.h: the reader's hot path, inline -- one lock-free read
 * loop (read_loop) and the takes built on it: a private cursor's (anonymous,
 * named) and a group's under its lock, with their statistics and commits.
 *
 * Inline so that each caller instantiates them with its own sink (where a
 * taken frame goes: a C buffer in api.c, a Python object in the binding):
 * the sink's functions are then direct calls, not one indirect call each
 * per frame.
 *
 * Barrier pairs: the acquire load of NEXT_SEQ pairs with the writer's
 * release store (write.c's commit_batch): every byte of a frame below it is
 * visible.  After copying a frame, an acquire fence then FIRST_POS: if the
 * writer's eviction (its FIRST_POS store and release fence, write.c's
 * publish_first) passed the frame, the copy may be torn and is dropped
 * (seqlock).  Named commits store the position before the seq (release
 * both): resync() re-derives a seq whose store a kill cut off.
 */
#ifndef SHMQ_TAKE_H
#define SHMQ_TAKE_H

#include "engine.h"

/* Where a take puts each frame: copy(ctx, src, h) copies its payload out and
 * returns the copy (read back for a CRC check), NULL (failed:
 * SHMQ_ECALLBACK) or ENG_COPY_STOP (no room for it: the take stops before
 * it); drop(ctx) discards a copy the writer overwrote meanwhile; taken(ctx, h)
 * once a copy passed the seqlock check (0, or -1: stop with SHMQ_ECALLBACK). */
#define ENG_COPY_STOP ((const char *)1)
typedef const char *(*copy_fn)(void *ctx, const char *src, const shmq_frame_header *h);
typedef void (*drop_fn)(void *ctx);
typedef int (*taken_fn)(void *ctx, const shmq_frame_header *h);
typedef struct {
    copy_fn copy;
    drop_fn drop;
    taken_fn taken;
    void *ctx;
} Sink;

/* The read loop: the frame at cursor (seq, pos), lock-free.  copy(ctx, src,
 * h) copies the payload out (returns the copy's bytes, or NULL: an
 * exception); drop(ctx) discards a copy the writer overwrote meanwhile (the
 * seqlock check after the copy).  1: a frame was copied, *hout is its
 * header, the cursor is past it; 0: caught up (the cursor may have moved
 * past pads and overwritten frames, counted in *lost; or the sink stopped
 * before this frame: copy returned ENG_COPY_STOP); < 0: an error
 * (SHMQ_ECORRUPT, or SHMQ_ECALLBACK: the copy failed; the cursor is unchanged). */
ALWAYS_INLINE int read_loop(eng_ring *r, uint64_t *seqp, uint64_t *posp, int verify, uint64_t *lost, shmq_frame_header *hout,
                          uint64_t *known, copy_fn copy, drop_fn drop, void *ctx) {
    uint64_t *c = r->ctl, ring = r->ring_bytes;
    uint64_t seq = *seqp, pos = *posp;
    int pads = 0;
    /* Positions and seqs never get near 2**62: larger ones come from a corrupt
     * or hostile cursor, and would wrap. */
    if (seq >= SHMQ_MAX_COUNTER || pos >= SHMQ_MAX_COUNTER) {
        return eng_fail(SHMQ_ECORRUPT, "%s: reader cursor out of range (seq %llu, position %llu); reset it "
                        "with 'shmq readers seek'", r->path, (unsigned long long)seq, (unsigned long long)pos);
    }
    for (long spins = 0;; spins++) {
        if (spins > 1000000) { /* resyncs and pads always make progress on a sane ring */
            return eng_fail(SHMQ_ECORRUPT, "%s: cannot read at seq %llu (the ring does not converge); "
                            SHMQ_RING_ADVICE, r->path, (unsigned long long)seq);
        }
        /* `known`: a NEXT_SEQ this reader loaded (acquire) before, so every
         * frame below it is committed and its bytes visible.  Loading the
         * word only past it spares a reader that is behind one transfer per
         * frame of the control line the writer stores to on every put. */
        if (!known || seq >= *known) {
            uint64_t next = ld_acq(&c[SHMQ_W_NEXT_SEQ]);
            if (known) *known = next;
            if (seq >= next) {
                *seqp = seq;
                *posp = pos;
                return 0;
            }
        }
        shmq_frame_header h;
        uint64_t off = read_header_at(r, &pos, &h);
        if (h.seq != seq || !header_sane(&h, off, ring)) {
            atomic_thread_fence(memory_order_acquire);
            int rs = resync(r, &seq, &pos, &h, off, lost);
            if (rs < 0) return rs;
            continue;
        }
        if (h.flags & SHMQ_FLAG_PAD) {
            atomic_thread_fence(memory_order_acquire);
            if (ld_rlx(&c[SHMQ_W_FIRST_POS]) > pos) { /* the pad itself was overwritten */
                int rs = resync(r, &seq, &pos, &h, off, lost);
            if (rs < 0) return rs;
            } else {
                if (++pads > 2 || off == 0) { /* a pad never starts the ring, never repeats */
                    return eng_fail(SHMQ_ECORRUPT, "%s: corrupt padding at seq %llu (ring offset %llu); "
                                    SHMQ_RING_ADVICE, r->path, (unsigned long long)seq, (unsigned long long)off);
                }
                pos += h.stored;
            }
            continue;
        }
        const char *copied = copy(ctx, r->ring + off + SHMQ_FRAME_BYTES, &h);
        if (copied == ENG_COPY_STOP) { /* the sink has no room for this frame: stop before it */
            *seqp = seq;
            *posp = pos;
            return 0;
        }
        if (!copied) return SHMQ_ECALLBACK;
        atomic_thread_fence(memory_order_acquire); /* the copy happens before the re-check */
        if (ld_rlx(&c[SHMQ_W_FIRST_POS]) > pos) {          /* overwritten while we copied */
            drop(ctx);
            int rs = resync(r, &seq, &pos, &h, off, lost);
            if (rs < 0) return rs;
            continue;
        }
        if (verify && (h.flags & SHMQ_FLAG_CRC) && eng_crc(0, (const unsigned char *)copied, h.length) != h.crc) {
            drop(ctx);
            return eng_fail(SHMQ_ECORRUPT, "%s: frame %llu fails its CRC check (memory corruption?); "
                            SHMQ_RING_ADVICE, r->path, (unsigned long long)seq);
        }
        *seqp = seq + 1;
        *posp = pos + h.stored;
        *hout = h;
        return 1;
    }
}

/* The put-to-get delay needs a clock read (a vDSO clock_gettime, ~20 ns on
 * this VM: 3-5% of a Queue.get of a small dict).  A take of several frames
 * reads it once for all of them; a single get reads it on one get in
 * DELAY_SAMPLE_EVERY, chosen at random (xorshift) so that no periodic
 * pattern of the producer lines up with the samples.  Statistics divide the
 * delay sum by the measured count (SHMQ_S_DELAY_COUNT), not by the gets. */
#define DELAY_SAMPLE_EVERY 8
static inline uint64_t delay_clock(eng_cursor *c, long max) {
    if (max == 1) {
        uint64_t x = c->rng;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        c->rng = x;
        if (x & (DELAY_SAMPLE_EVERY - 1)) return 0; /* not measured this time */
    }
    return now_ns();
}

/* Count one frame taken; `now` 0: its delay is not measured (delay_clock). */
static inline void account(eng_cursor *c, const shmq_frame_header *h, uint64_t now) {
    uint64_t seq = h->seq, ts = h->ts;
    if (!c->n) {
        uint64_t nxt = ld_rlx(&c->ring->ctl[SHMQ_W_NEXT_SEQ]);
        c->lag_peak = nxt > seq ? nxt - seq : 0;
    }
    c->n++;
    c->bytes += h->length;
    if (!now) return;
    c->dcount++;
    if (now > ts) { /* clocks can step backwards; never count a negative delay */
        uint64_t dl = now - ts;
        c->dsum += dl;
        if (dl > c->dmax) c->dmax = dl;
    }
}

/* The take loop over cursor (seq, pos): up to max frames through the read
 * loop into sink k, each counted in the reader's statistics when `count`
 * (named readers and groups; account).  The frames taken, or an error;
 * *lost gets the frames skipped. */
ALWAYS_INLINE long take_loop(eng_cursor *c, uint64_t *seq, uint64_t *pos, long max, int count,
                                   uint64_t *lost, const Sink *k) {
    uint64_t now = 0;
    int clocked = 0;
    long got = 0;
    while (got < max) {
        shmq_frame_header h = {0}; /* (read_loop fills it whenever it returns 1) */
        int rc = read_loop(c->ring, seq, pos, c->verify, lost, &h, &c->known, k->copy, k->drop, k->ctx);
        if (rc < 0) return rc;
        if (!rc) break;
        if (count) {
            if (!clocked) {
                now = delay_clock(c, max);
                clocked = 1;
            }
            account(c, &h, now);
        }
        got++;
        st_rlx(&c->last_len, h.length); /* read by eng_spin_for_frame without the cursor lock */
        if (k->taken(k->ctx, &h) < 0) return SHMQ_ECALLBACK;
    }
    return got;
}

/* Up to max frames from a private cursor (anonymous / named) into sink k:
 * the take, the loss count, page release, a named reader's auto-commit,
 * statistics flush and space doorbell.  The frames taken, or an error.
 * The caller holds the cursor's lock (eng_cursor_lock). */
ALWAYS_INLINE long private_take_in(eng_cursor *c, long max, const Sink *k) {
    eng_ring *r = c->ring;
    uint64_t lost = 0;
    long got = take_loop(c, &c->seq, &c->pos, max, c->kind == K_NAMED, &lost, k);
    if (got < 0) return got;
    if (lost) {
        c->lost += lost;
        c->lost_pending += lost;
    }
    if (got || lost) release_behind(r, &c->released, c->pos);
    if (c->kind == K_NAMED && (got || lost)) {
        if (c->autocommit) named_commit(c);
        if (c->n >= STATS_FLUSH_FRAMES || (lost && !got)) flush_locked(c);
        if (c->autocommit && r->policy != 0) ring_space(r);
    }
    return got;
}

/* Up to max frames from a group's shared cursor (its slot's SHMQ_S_SEQ / SHMQ_S_POS)
 * into sink k, the group lock held by the caller: the take, then the cursor
 * stored back (position first, see resync), lost frames and statistics.
 * *pos_out: the cursor's position after (for release_behind, outside the
 * lock).  The frames taken, or an error (nothing stored). */
ALWAYS_INLINE long group_take_in(eng_cursor *c, long max, const Sink *k, uint64_t *pos_out,
                                       uint64_t *lost_out) {
    uint64_t *s = cur_slot(c);
    uint64_t seq = ld_rlx(&s[SHMQ_S_SEQ]), pos = ld_rlx(&s[SHMQ_S_POS]), lost = 0;
    long got = take_loop(c, &seq, &pos, max, 1, &lost, k);
    *pos_out = pos;
    *lost_out = lost;
    if (got < 0) return got;
    if (got || lost) {
        st_rel(&s[SHMQ_S_POS], pos); /* position first: see resync */
        st_rel(&s[SHMQ_S_SEQ], seq);
        if (lost) st_rlx(&s[SHMQ_S_LOST], ld_rlx(&s[SHMQ_S_LOST]) + lost);
        if (c->n >= STATS_FLUSH_FRAMES) flush_locked(c);
    }
    return got;
}

#endif
