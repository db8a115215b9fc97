/*
 * shmq/engine/inspect.c: what the engine, fsck (shmq/verify.py), repair
 * (shmq/repair.py) and the dump tools share, written once: decoding a frame
 * header at a ring position, the oldest frame as a consistent pair, the
 * checks of the control words, and the re-derivation of the control words
 * after a writer died (docs/format.md, "Locks and recovery").
 *
 * They take the words and the ring as plain pointers (the Python binding
 * exposes them over a mapping, read-only but for the repair), read only
 * inside the ring whatever the bytes say, and never block.
 */
#include "engine.h"

/* The header at/after ring position `pos` (the short-tail skip followed:
 * out->pos is then past it), unchecked but for out->sane: its lengths keep
 * it inside the ring. */
void eng_header_at(const char *ring, uint64_t ring_bytes, uint64_t pos, eng_hit *out) {
    uint64_t off = pos % ring_bytes;
    if (ring_bytes - off < SHMQ_FRAME_BYTES) {
        pos += ring_bytes - off;
        off = 0;
    }
    shmq_frame_header h;
    memcpy(&h, ring + off, SHMQ_FRAME_BYTES);
    out->seq = h.seq;
    out->pos = pos;
    out->stored = h.stored;
    out->length = h.length;
    out->ts = h.ts;
    out->crc = h.crc;
    out->flags = h.flags;
    out->codec = h.codec;
    out->sane = header_sane(&h, off, ring_bytes);
}

/* A consistent (seq, pos) of the oldest frame, read lock-free: an evicting
 * writer stores FIRST_POS then FIRST_SEQ, so a FIRST_SEQ read first may lag;
 * the header at FIRST_POS names the frame.  0, or -1 (no consistent pair in
 * 10000 looks, or a counter out of range: corrupt). */
int eng_first_cursor(uint64_t *ctl, const char *ring, uint64_t ring_bytes, uint64_t *oseq, uint64_t *opos) {
    for (int i = 0; i < 10000; i++) {
        uint64_t seq = ld_acq(&ctl[SHMQ_W_FIRST_SEQ]); /* seq before pos: the writer stores pos first */
        uint64_t pos = ld_acq(&ctl[SHMQ_W_FIRST_POS]);
        uint64_t nxt = ld_acq(&ctl[SHMQ_W_NEXT_SEQ]);
        if (pos >= SHMQ_MAX_COUNTER || nxt >= SHMQ_MAX_COUNTER || seq >= SHMQ_MAX_COUNTER) break; /* would wrap */
        if (seq >= nxt) {
            *oseq = seq;
            *opos = pos;
            return 0;
        }
        uint64_t off = pos % ring_bytes;
        if (ring_bytes - off < SHMQ_FRAME_BYTES) off = 0;
        shmq_frame_header h;
        memcpy(&h, ring + off, SHMQ_FRAME_BYTES);
        atomic_thread_fence(memory_order_acquire);
        if (header_sane(&h, off, ring_bytes) && seq <= h.seq && h.seq < nxt && ld_rlx(&ctl[SHMQ_W_FIRST_POS]) == pos) {
            *oseq = h.seq;
            *opos = pos;
            return 0;
        }
    }
    return -1;
}

#define ADD(...)                                                                                  \
    do {                                                                                          \
        if (n < cap) n += (size_t)snprintf(msg + n, cap - n, "%s", found ? "\n" : "");            \
        if (n < cap) n += (size_t)snprintf(msg + n, cap - n, __VA_ARGS__);                        \
        found++;                                                                                  \
    } while (0)

/* Control words no writer could have left (bit rot, foreign writes), read
 * lock-free while writers may run: the number of problems, each a line of
 * `msg`.  FIRST_* are read before NEXT_* (both only grow and FIRST_SEQ <=
 * NEXT_SEQ at every instant, so this order never sees a live writer's words
 * out of order); the span check uses a NEXT_POS read before FIRST_POS
 * (which can only underestimate it: a writer that evicts and writes between
 * two loads would otherwise look like a ring spanning more than its size).
 * A caller re-reads a few times before it believes a problem (a writer
 * between two stores).  Finer consistency is fsck's walk. */
int eng_control_problems(const uint64_t *ctl_, uint64_t ring, char *msg, size_t cap) {
    uint64_t *ctl = (uint64_t *)ctl_;
    uint64_t npos_before = ld_acq(&ctl[SHMQ_W_NEXT_POS]);
    uint64_t fseq = ld_acq(&ctl[SHMQ_W_FIRST_SEQ]), fpos = ld_acq(&ctl[SHMQ_W_FIRST_POS]);
    uint64_t nseq = ld_acq(&ctl[SHMQ_W_NEXT_SEQ]), npos = ld_acq(&ctl[SHMQ_W_NEXT_POS]);
    size_t n = 0;
    int found = 0;
    if (cap) msg[0] = 0;
    const char *names[4] = {"NEXT_SEQ", "NEXT_POS", "FIRST_SEQ", "FIRST_POS"};
    uint64_t values[4] = {nseq, npos, fseq, fpos};
    for (int i = 0; i < 4; i++)
        if (values[i] >= SHMQ_MAX_COUNTER) ADD("control word %s = %llu is out of range", names[i], (unsigned long long)values[i]);
    if (found) return found;
    if (fseq > nseq) ADD("control words: FIRST_SEQ %llu > NEXT_SEQ %llu", (unsigned long long)fseq, (unsigned long long)nseq);
    uint64_t used = npos > fpos ? npos - fpos : 0;
    if (fpos > npos && fseq != nseq) {
        ADD("control words: FIRST_POS %llu > NEXT_POS %llu", (unsigned long long)fpos, (unsigned long long)npos);
    } else if (fpos > npos && fpos - npos > ring) {
        ADD("control words: positions %llu..%llu are more than the ring's %llu bytes apart",
            (unsigned long long)npos, (unsigned long long)fpos, (unsigned long long)ring);
    } else if (npos_before > fpos && npos_before - fpos > ring) {
        ADD("control words: positions %llu..%llu span %llu bytes, more than the ring's %llu",
            (unsigned long long)fpos, (unsigned long long)npos_before, (unsigned long long)(npos_before - fpos),
            (unsigned long long)ring);
    } else if (fseq <= nseq && nseq - fseq > used / SHMQ_FRAME_BYTES + 1) {
        ADD("control words: %llu frames cannot fit in %llu bytes", (unsigned long long)(nseq - fseq),
            (unsigned long long)used);
    }
    return found;
}

/* Re-derive the control words after a writer died holding the lock (the
 * lock is held by the caller).  A writer stores, in order: FIRST_POS,
 * FIRST_SEQ (eviction), frame bytes, NEXT_SEQ (the commit), NEXT_POS.
 * Killed anywhere in that sequence, at most FIRST_SEQ lags its position's
 * header and NEXT_POS lags the committed frames; both are re-derived from
 * the frame headers, walking the ring once (O(frames resident)).
 *
 * An unreadable ring is dropped whole when `drop_unreadable` (the engine's
 * recovery: readers count the frames lost) and left alone otherwise (fsck
 * --repair never drops frames).  Returns the number of words changed, or -1
 * when the ring was unreadable; `log` gets one line per action. */
int eng_repair_control(uint64_t *ctl, const char *ring, uint64_t ring_bytes, int drop_unreadable, char *msg,
                       size_t cap) {
    size_t n = 0;
    int found = 0, changed = 0;
    if (cap) msg[0] = 0;
    uint64_t nseq = ld_rlx(&ctl[SHMQ_W_NEXT_SEQ]), fseq = ld_rlx(&ctl[SHMQ_W_FIRST_SEQ]);
    uint64_t fpos = ld_rlx(&ctl[SHMQ_W_FIRST_POS]), npos = ld_rlx(&ctl[SHMQ_W_NEXT_POS]);
    if (fseq >= nseq) { /* empty: nothing committed since any eviction */
        if (fpos != npos) {
            ADD("reset the empty ring's head from position %llu to NEXT_POS %llu", (unsigned long long)fpos,
                (unsigned long long)npos);
            st_rlx(&ctl[SHMQ_W_FIRST_POS], npos);
            changed++;
        }
        if (fseq != nseq) {
            st_rlx(&ctl[SHMQ_W_FIRST_SEQ], nseq);
            changed++;
        }
        return changed;
    }
    eng_hit hit;
    uint64_t pos = fpos, end = 0;
    int walked = 0;
    if (fpos < SHMQ_MAX_COUNTER) {
        eng_header_at(ring, ring_bytes, pos, &hit);
        if (hit.sane && fseq <= hit.seq && hit.seq < nseq) {
            if (fseq != hit.seq) {
                ADD("FIRST_SEQ %llu -> %llu (a writer died while evicting)", (unsigned long long)fseq,
                    (unsigned long long)hit.seq);
                st_rlx(&ctl[SHMQ_W_FIRST_SEQ], hit.seq);
                changed++;
            }
            /* walk to the end of frame NEXT_SEQ - 1, at most one ring */
            uint64_t seq = hit.seq, limit = pos + ring_bytes;
            walked = 1;
            while (seq < nseq) {
                eng_header_at(ring, ring_bytes, pos, &hit);
                if (!hit.sane || hit.seq != seq || hit.pos + hit.stored > limit) {
                    walked = 0;
                    break;
                }
                pos = hit.pos + hit.stored;
                if (!(hit.flags & SHMQ_FLAG_PAD)) seq++;
            }
            end = pos;
        }
    }
    if (!walked) {
        if (!drop_unreadable) {
            ADD("left the control words alone: the frame headers from the oldest frame on are unreadable");
            return -1;
        }
        uint64_t top = npos > fpos ? npos : fpos;
        ADD("ring unreadable after writer death: dropped its contents (readers count them lost)");
        st_rlx(&ctl[SHMQ_W_NEXT_POS], top);
        st_rlx(&ctl[SHMQ_W_FIRST_POS], top);
        st_rlx(&ctl[SHMQ_W_FIRST_SEQ], nseq);
        return -1;
    }
    if (npos != end) { /* it died between NEXT_SEQ and NEXT_POS */
        ADD("NEXT_POS %llu -> %llu (re-derived from the frame headers)", (unsigned long long)npos,
            (unsigned long long)end);
        st_rlx(&ctl[SHMQ_W_NEXT_POS], end);
        changed++;
    }
    return changed;
}
