/*
 * shmq/engine/write.c: the writer -- placement, eviction and commit, one of
 * each, shared by every write path: put, put_many (with its options) and
 * reserve (docs/format.md, "The engine").  There is no other.
 *
 * Everything between taking the writer lock and releasing it is here
 * (place_batch, make_room, write_pads, write_locked, commit_batch); the
 * handle's writer-side state (rate word, room marker, pre-fault window) is
 * guarded by that lock.  A caller's callouts (a fill that writes a payload
 * in place, before_commit) run under it too, the handle marked busy.
 *
 * Barrier pairs: the release store of NEXT_SEQ (commit_batch) pairs with
 * the readers' acquire load of it (take.h); the FIRST_POS store and release
 * fence of publish_first pair with the readers' acquire fence and FIRST_POS
 * re-check after their copy.
 */
#include "engine.h"

uint64_t slot_hwm(eng_ring *r) {
    uint64_t h = ld_rlx(&r->ctl[SHMQ_W_SLOT_HWM]);
    return h < r->slot_count ? h : r->slot_count; /* clamped: a corrupt word must not index past the table */
}

/* Minimum of slot word `word` over named readers and groups; returns 0 and
 * leaves *out alone when there are none. */
int slot_floor(eng_ring *r, int word, uint64_t *out) {
    int found = 0;
    uint64_t h = slot_hwm(r), m = 0;
    for (uint64_t i = 0; i < h; i++) {
        uint64_t *s = r->slots + i * SHMQ_SLOT_WORDS;
        uint64_t st = ld_rlx(&s[SHMQ_S_STATE]);
        if (st == SHMQ_SLOT_READER || st == SHMQ_SLOT_GROUP) {
            uint64_t v = ld_acq(&s[word]);
            if (!found || v < m) m = v;
            found = 1;
        }
    }
    if (found) *out = m;
    return found;
}

uint64_t pin_floor(eng_ring *r) {
    uint64_t h = slot_hwm(r), m = UINT64_MAX;
    for (uint64_t i = 0; i < h; i++) {
        uint64_t *s = r->slots + i * SHMQ_SLOT_WORDS;
        if (ld_rlx(&s[SHMQ_S_STATE]) == SHMQ_SLOT_PIN) {
            uint64_t v = ld_acq(&s[SHMQ_S_POS]);
            if (v < m) m = v;
        }
    }
    return m;
}

/* The room marker now (each word one atomic load): the slowest named
 * cursor (or FIRST_POS) and the oldest pin.  A writer that found no room
 * waits until it differs from the one taken under the lock then. */
void room_marker(eng_ring *r, uint64_t *floor, uint64_t *pin) {
    *floor = room_floor(r);
    *pin = pin_floor(r);
}

/* The room marker a write that found no room took under the lock, the
 * calling thread's (its waiter compares the marker now with it): per thread,
 * not per handle, since threads sharing a handle wait for room each on their
 * own. */
static _Thread_local uint64_t full_floor, full_pin;
_Thread_local eng_room eng_room_of_thread;

void take_full_marker(eng_ring *r) {
    room_marker(r, &full_floor, &full_pin);
    eng_room_of_thread = (eng_room){0, 0, 0, 0}; /* none: a pin, or not known (take_room_need) */
}

/* What a write that found no room needs (writer lock held, after
 * take_full_marker): the slowest cursor at `need_pos` (bytes: block policy)
 * or its seq at `need_seq` (items: a queue's maxsize `backlog`), and what a
 * burst needs, the "want": a meaningful amount of room past the cursor's
 * `floor_pos` / `floor_seq` now, an eighth of the ring (at most
 * ROOM_BURST_MAX bytes) or of the backlog, never past everything written.
 * A blocked writer asks consumers to ring it once the want is there
 * (wait.c, room_state), not for every frame they free. */
#define ROOM_BURST_MAX (64u << 10)
void take_room_need(eng_ring *r, uint64_t need_pos, uint64_t floor_pos, uint64_t need_seq, uint64_t floor_seq,
                    uint64_t backlog) {
    eng_room *m = &eng_room_of_thread;
    m->need_pos = need_pos;
    m->need_seq = need_seq;
    if (need_pos) {
        uint64_t burst = r->ring_bytes / 8 < ROOM_BURST_MAX ? r->ring_bytes / 8 : ROOM_BURST_MAX;
        uint64_t want = floor_pos + burst, top = ld_rlx(&r->ctl[SHMQ_W_NEXT_POS]);
        if (want > top) want = top;
        m->want_pos = want > need_pos ? want : need_pos;
    }
    if (need_seq) {
        uint64_t want = floor_seq + backlog / 8, top = ld_rlx(&r->ctl[SHMQ_W_NEXT_SEQ]);
        if (want > top) want = top;
        m->want_seq = want > need_seq ? want : need_seq;
    }
}

void eng_full_marker(uint64_t *floor, uint64_t *pin) {
    *floor = full_floor;
    *pin = full_pin;
}

static void record_high_water(eng_ring *r) {
    uint64_t *c = r->ctl;
    uint64_t frames = ld_rlx(&c[SHMQ_W_NEXT_SEQ]) - ld_rlx(&c[SHMQ_W_FIRST_SEQ]);
    uint64_t used = ld_rlx(&c[SHMQ_W_NEXT_POS]) - ld_rlx(&c[SHMQ_W_FIRST_POS]);
    if (frames > ld_rlx(&c[SHMQ_W_HIGH_FRAMES])) st_rlx(&c[SHMQ_W_HIGH_FRAMES], frames);
    if (used > ld_rlx(&c[SHMQ_W_HIGH_BYTES])) st_rlx(&c[SHMQ_W_HIGH_BYTES], used);
}

/* Store the new oldest frame (writer lock held), both words before any byte
 * below `pos` is overwritten.  While frames stay resident, the position goes
 * first: a writer killed in between leaves FIRST_POS at a real frame, whose
 * header recovery re-reads the seq from.  When everything is evicted, `pos` is
 * where the next batch goes and holds no header of this lap yet (an older
 * lap's frame may sit there and look valid): the seq goes first, so a writer
 * killed in between leaves FIRST_SEQ = NEXT_SEQ, which recovery reads as an
 * empty ring.  0, or SHMQ_ECALLBACK if the fault-injection hook failed. */
static int publish_first(eng_ring *r, uint64_t seq, uint64_t pos, uint64_t next_seq) {
    uint64_t *c = r->ctl;
    if (seq >= next_seq) {
        st_rel(&c[SHMQ_W_FIRST_SEQ], seq);
        if (crash_point(r, "evicting")) return SHMQ_ECALLBACK;
        st_rlx(&c[SHMQ_W_FIRST_POS], pos);
        atomic_thread_fence(memory_order_release); /* before any overwritten byte, as below */
        return 0;
    }
    st_rlx(&c[SHMQ_W_FIRST_POS], pos); /* position first: readers re-derive seq from its header */
    atomic_thread_fence(memory_order_release); /* ... and see it before any overwritten byte */
    if (crash_point(r, "evicting")) return SHMQ_ECALLBACK;
    st_rel(&c[SHMQ_W_FIRST_SEQ], seq);
    return 0;
}

/* The slowest cursor `floor`, for making room (block/error policies): one
 * below FIRST_POS (`first`) is at it (what lies between is evicted already:
 * that reader resyncs and counts it lost; after an early wrap it is a PAD,
 * nothing); one at a PAD or a short tail (nothing to read before the next
 * lap) is at the next lap.  After an early wrap (hot_place, zone.c) the
 * consumers' cursors sit at its PAD: without this the writer would find
 * room only up to that offset in the next lap, a hot region's worth
 * instead of the ring. */
static uint64_t past_pad(eng_ring *r, uint64_t floor, uint64_t first, uint64_t next_pos) {
    uint64_t ring = r->ring_bytes;
    if (floor < first) return first;
    if (floor >= next_pos) return floor;
    uint64_t off = floor % ring;
    if (ring - off < SHMQ_FRAME_BYTES) return floor + (ring - off);
    shmq_frame_header h;
    read_header(r, off, &h);
    if ((h.flags & SHMQ_FLAG_PAD) && off && header_sane(&h, off, ring) && off + h.stored == ring)
        return floor + h.stored;
    return floor;
}

/* Move FIRST_* past everything below byte position `limit` (writer lock
 * held).  Returns 0 on success, SHMQ_EFULL / SHMQ_EPINNED, or an error
 * exception set.  Overwrite policy walks the evicted headers (a few loads
 * each); block/error jump in one step to the slowest named cursor. */
int make_room(eng_ring *r, uint64_t limit, uint64_t next_seq, uint64_t batch_pos) {
    uint64_t *c = r->ctl, ring = r->ring_bytes, floor = 0;
    /* The named cursors first (acquire loads), then the pins: a named reader
     * of a block/error ring pins the frame at its cursor without the writer
     * lock, while its published cursor still holds that frame, and only then
     * moves the cursor on (a release store; shmq/pins.py).  A writer that sees
     * the cursor moved therefore sees the pin. */
    int have_floor = r->policy != 0 && slot_floor(r, SHMQ_S_POS, &floor);
    uint64_t pin = pin_floor(r);
    if (pin < limit) { /* a zero-copy view reads that frame: Python waits for it (the room marker) */
        take_full_marker(r);
        return SHMQ_EPINNED;
    }
    uint64_t seq = ld_rlx(&c[SHMQ_W_FIRST_SEQ]), pos = ld_rlx(&c[SHMQ_W_FIRST_POS]), start_seq = seq;
    uint64_t next_pos = ld_rlx(&c[SHMQ_W_NEXT_POS]);
    record_high_water(r);
    if (r->policy != 0) {
        if (!have_floor) floor = pos; /* no consumers registered: keep everything */
        floor = past_pad(r, floor, pos, next_pos);
        /* The jump below goes past `limit`, up to the slowest cursor: never past a
         * pinned frame (a reader moves its cursor on before it releases its view).
         * A pin is the header position of a resident data frame, >= limit here. */
        if (pin < floor) floor = pin;
        if (floor < limit && floor < next_pos) {
            take_full_marker(r);
            take_room_need(r, limit, floor, 0, 0, 0);
            return SHMQ_EFULL; /* unconsumed frames in the way */
        }
        if (floor >= next_pos) {
            seq = next_seq; /* all consumed */
        } else if (floor > pos) {
            /* Jump to the slowest cursor: its header names its seq (a pad
             * carries the seq of the frame after it). */
            uint64_t off = floor % ring;
            if (ring - off < SHMQ_FRAME_BYTES) off = 0;
            shmq_frame_header h;
            read_header(r, off, &h);
            if (h.seq < seq || h.seq >= next_seq || !header_sane(&h, off, ring)) {
                return eng_fail(SHMQ_ECORRUPT, "%s: reader cursor at position %llu does not point at a frame "
                        "(header says seq %llu); " SHMQ_RING_ADVICE,
                                r->path, (unsigned long long)floor, (unsigned long long)h.seq);
            }
            seq = h.seq;
            pos = floor;
        }
        if (seq >= next_seq) pos = batch_pos;
        int rc = publish_first(r, seq, pos, next_seq);
        if (rc < 0) return rc;
        st_rlx(&c[SHMQ_W_EVICTED], ld_rlx(&c[SHMQ_W_EVICTED]) + (seq - start_seq));
        return 0;
    }
    uint64_t walk_start = pos;
    while (pos < limit && seq < next_seq) {
        uint64_t off = pos % ring;
        if (ring - off < SHMQ_FRAME_BYTES) {
            pos += ring - off;
            continue;
        }
        shmq_frame_header h;
        read_header(r, off, &h);
        /* A PAD fills the ring's tail exactly and never starts the ring, and no
         * walk of resident frames spans more than the ring: anything else is
         * corruption (and would otherwise spin on a self-repeating PAD). */
        if (h.seq != seq || !header_sane(&h, off, ring) ||
            ((h.flags & SHMQ_FLAG_PAD) && (off == 0 || off + h.stored != ring)) || pos + h.stored - walk_start > ring) {
            return eng_fail(SHMQ_ECORRUPT, "%s: ring is corrupt at seq %llu (offset %llu: header says seq %llu, %u bytes); "
                    SHMQ_RING_ADVICE,
                            r->path, (unsigned long long)seq, (unsigned long long)off, (unsigned long long)h.seq,
                            h.stored);
        }
        pos += h.stored;
        if (!(h.flags & SHMQ_FLAG_PAD)) seq++;
    }
    if (seq >= next_seq) pos = batch_pos; /* everything evicted: the ring restarts at this batch */
    int rc = publish_first(r, seq, pos, next_seq);
    if (rc < 0) return rc;
    st_rlx(&c[SHMQ_W_EVICTED], ld_rlx(&c[SHMQ_W_EVICTED]) + (seq - start_seq));
    return 0;
}

static inline void roll_rate(eng_ring *r, uint64_t ts) {
    uint64_t sec = ts / 1000000000ull;
    int b = SHMQ_W_RATE + (int)(sec % SHMQ_RATE_SECONDS) * SHMQ_RATE_WORDS;
    r->rate_word = b + 1;
    r->rate_until = (sec + 1) * 1000000000ull;
    if (ld_rlx(&r->ctl[b]) != sec) {
        st_rlx(&r->ctl[b], sec);
        st_rlx(&r->ctl[b + 1], 0);
        st_rlx(&r->ctl[b + 2], 0);
    }
}

/* The wait at a hot region's end (hot_place; a growable ring's zone past
 * HOT_BYTES, zone_place), `floor` < `start` the slowest consumer: wait, the
 * caller's lock dropped, for consumers within HOT_LAG bytes or
 * HOT_LAG_BATCHES batches of `total` bytes (at most `cap`) to consume
 * everything, as long as that takes at 2 GB/s (wait_floor).  1 if they did;
 * 0 if not (behind, or not in time: no wait again before the writer has
 * written another `cap` bytes, hot_retry); SHMQ_ECLOSED. */
int hot_wait(eng_ring *r, uint64_t start, uint64_t floor, uint64_t total, uint64_t cap) {
    uint64_t lag = start - floor;
    uint64_t near = HOT_LAG_BATCHES * total > HOT_LAG ? HOT_LAG_BATCHES * total : HOT_LAG;
    if (near > cap) near = cap;
    int w = lag > near ? 0 : wait_floor(r, start, 50000 + lag / 2, 50000 + total / 2);
    if (w == SHMQ_ECLOSED) return eng_fail(SHMQ_ECLOSED, "spool handle was closed by another thread");
    /* Behind, or not caught up in time (a consumer preempted for half a
     * millisecond does that): on into the ring for `cap` bytes, then try
     * again.  A whole lap of the ring instead makes a run of 2,000 x 1 MiB
     * frames take 40% longer (56 MiB of cold pages). */
    if (w != 1) r->hot_retry = start + cap;
    return w == 1;
}

/* ---- the hot region of a fixed ring ----
 *
 * A fixed ring written sequentially strides through all of its memory: on a
 * 64 MiB ring every lap is out of the caches by the time it comes round, so
 * a 1 MiB frame would be written and read at memory speed (iceoryx2's
 * loaned samples, a few chunks recycled, stay in cache: 3x as fast).  So while its
 * consumers keep up, a fixed block/error ring reuses its first HOT_BYTES
 * (or 2 batches, if larger): once the writer's next batch would end past
 * that and every named reader and group has consumed everything (waiting,
 * the caller's lock dropped, for consumers within HOT_LAG bytes or
 * HOT_LAG_BATCHES batches, at most the region, as long as that takes at
 * 2 GB/s: wait_floor; after a wait in vain the writer goes on into the
 * ring and tries again once it has written another region's worth), it pads
 * the rest of the ring (a PAD, as at any wrap) and starts the next lap at
 * offset 0, in lines the consumers read moments ago.  The consumers' cursors
 * then sit at that PAD, which make_room counts as consumed (past_pad): the
 * whole ring stays the backlog's if they stop there.  A consumer that is
 * behind holds the writer to the whole ring.  Consumed frames
 * past the hot region are evicted at the early wrap instead of a lap later
 * (block and error policies evict what named cursors consumed whenever they
 * make room anyway); overwrite rings, whose anonymous readers expect a lap
 * of history, and rings over HOT_RING_MAX (whose readers release the pages
 * behind them, read.c) stay sequential.  Growable rings have their own hot
 * zone (zone.c; past HOT_BYTES it waits with hot_wait too).  Writer lock
 * held (hot_retry is the lock's); only rewrites the placement (place_batch
 * evicts after it).  0, or SHMQ_ECLOSED if the handle was closed by another
 * thread during the wait. */
static int hot_place(eng_ring *r, uint64_t start, size_t count, const uint64_t *needs, uint64_t total,
                     uint64_t *placed, Placement *pl) {
    uint64_t ring = r->ring_bytes, n_off = start % ring, lap = start - n_off, gap = ring - n_off, floor;
    uint64_t zone = total * 2 > HOT_BYTES ? total * 2 : HOT_BYTES;
    if (r->policy == SHMQ_POLICY_OVERWRITE || ring > HOT_RING_MAX || zone > ring / 2 || n_off + total <= zone)
        return 0; /* overwrite, a large ring, or inside the hot region */
    if (gap < SHMQ_FRAME_BYTES || gap > 0xFFFFFFF8ull) return 0; /* a PAD header must fit, its u32 length too */
    if (start < r->hot_retry || !slot_floor(r, SHMQ_S_POS, &floor)) return 0; /* tried just now; or no consumer */
    if (floor < start) { /* consumers copying the last batches: wait for them (lock dropped) */
        int w = hot_wait(r, start, floor, total, zone);
        if (w != 1) return w; /* 0: on into the ring; or SHMQ_ECLOSED */
    }
    if (pin_floor(r) < lap + total) return 0; /* a zero-copy view still reads the lap's start */
    place_at_lap(pl, placed, needs, count, n_off, gap, lap + ring);
    return 0;
}

/* Where a batch of `count` frames of needs[] bytes (total: their sum) goes
 * (writer lock held): fills placed[] and *pl, evicts what is in the way and,
 * on a growable ring, allocates its pages (may wrap early).  0 (nothing
 * written yet: the caller writes the frames, write_pads, then
 * commit_batch), a status (SHMQ_EBACKLOG, SHMQ_EFULL, SHMQ_EPINNED, SHMQ_ENOSPACE:
 * nothing changed but the room marker), or an error.  The one placement of
 * put, put_many and reserve. */
int place_batch(eng_ring *r, size_t count, const uint64_t *needs, uint64_t total, int64_t max_backlog,
                uint64_t *placed, Placement *pl) {
    uint64_t *c = r->ctl, ring = r->ring_bytes;
    uint64_t seq0 = ld_rlx(&c[SHMQ_W_NEXT_SEQ]), start = ld_rlx(&c[SHMQ_W_NEXT_POS]);
    pl->seq0 = seq0;
    pl->start = start;
    /* Counters no writer reaches (SHMQ_MAX_COUNTER, 2**62), as the readers and
     * the open-time checks refuse them: a write returns its first seq as a
     * non-negative int64, and positions below 2**62 never wrap. */
    if (seq0 >= SHMQ_MAX_COUNTER - (uint64_t)count || start >= SHMQ_MAX_COUNTER)
        return eng_fail(SHMQ_ECORRUPT, "%s: control word NEXT_SEQ = %llu or NEXT_POS = %llu is out of range "
                        "(>= 2**62): the header is corrupt", r->path, (unsigned long long)seq0,
                        (unsigned long long)start);
    if (max_backlog >= 0) {
        uint64_t floor;
        if (slot_floor(r, SHMQ_S_SEQ, &floor) && seq0 - floor + (uint64_t)count > (uint64_t)max_backlog) {
            take_full_marker(r);
            take_room_need(r, 0, 0, seq0 + (uint64_t)count - (uint64_t)max_backlog, floor, (uint64_t)max_backlog);
            return SHMQ_EBACKLOG;
        }
    }
    /* Placement: a frame that does not fit before the ring's end is preceded
     * by padding to the end (a PAD header if 32+ bytes remain). */
    uint64_t pos = start;
    int restart = 0;
    pl->npads = 0;
    for (size_t k = 0; k < count; k++) {
        uint64_t off = pos % ring;
        if (ring - off < needs[k]) {
            if (pl->npads == 2) { restart = 1; break; } /* wraps more than once: start at the ring's start */
            if (ring - off >= SHMQ_FRAME_BYTES) {
                pl->pads_off[pl->npads] = off;
                pl->pads_gap[pl->npads] = ring - off;
                pl->pads_k[pl->npads] = k;
                pl->npads++;
            }
            pos += ring - off;
        }
        placed[k] = pos;
        pos += needs[k];
    }
    if (restart || pos - placed[0] > ring) {
        /* The batch would wrap onto itself: start it at the ring's start. */
        pos = start;
        uint64_t off = pos % ring;
        pl->npads = 0;
        if (off && ring - off >= SHMQ_FRAME_BYTES) {
            pl->pads_off[0] = off;
            pl->pads_gap[0] = ring - off;
            pl->pads_k[0] = 0;
            pl->npads = 1;
        }
        if (off) pos += ring - off;
        for (size_t k = 0; k < count; k++) {
            placed[k] = pos;
            pos += needs[k];
        }
    }
    pl->end = pos;
    if (r->segment) { /* a growable ring: its pages first (may wrap early) */
        int st = zone_place(r, start, count, needs, total, placed, pl, seq0);
        if (st != 0) return st;
    } else {
        int st = hot_place(r, start, count, needs, total, placed, pl);
        if (st != 0) return st;
    }
    if (pl->end - ld_rlx(&c[SHMQ_W_FIRST_POS]) > ring) return make_room(r, pl->end - ring, seq0, placed[0]);
    return 0;
}

/* The PAD headers of a placement (writer lock held, after place_batch). */
void write_pads(eng_ring *r, const Placement *pl, uint64_t ts) {
    for (int p = 0; p < pl->npads; p++) {
        shmq_frame_header h = {pl->seq0 + (uint64_t)pl->pads_k[p], (uint32_t)pl->pads_gap[p], 0, ts, 0, SHMQ_FLAG_PAD, 0, 0};
        memcpy(r->ring + pl->pads_off[p], &h, SHMQ_FRAME_BYTES);
    }
}

/* Publish frames written below `next_seq` / `end` (writer lock held): the
 * commit point, then the statistics, exact under the lock (puts are
 * NEXT_SEQ itself).  The one commit of put, put_many and reserve. */
void commit_batch(eng_ring *r, uint64_t next_seq, uint64_t end, uint64_t count, uint64_t nbytes, uint64_t ts) {
    uint64_t *c = r->ctl;
    st_rel(&c[SHMQ_W_NEXT_SEQ], next_seq); /* <- the commit point */
    st_rlx(&c[SHMQ_W_NEXT_POS], end);
    st_rlx(&c[SHMQ_W_PUT_BYTES], ld_rlx(&c[SHMQ_W_PUT_BYTES]) + nbytes);
    st_rlx(&c[SHMQ_W_LAST_PUT_NS], ts);
    if (ts >= r->rate_until) roll_rate(r, ts);
    st_rlx(&c[r->rate_word], ld_rlx(&c[r->rate_word]) + count);
}

/* A placed batch (or reservation) that will not be committed (writer lock
 * held): nothing of it is published, but place_batch may have evicted.
 * Eviction that left frames resident stays (FIRST_POS at a resident frame,
 * as after any eviction).  Eviction of everything stored FIRST_POS at the
 * batch's first frame, past NEXT_POS when a pad precedes it: an empty ring
 * is FIRST_POS == NEXT_POS (fsck checks it), and the next batch may be
 * placed elsewhere, so FIRST_POS goes back to NEXT_POS (`start`).  Readers
 * are unharmed: every evicted frame lies below `start`. */
void unplace(eng_ring *r, uint64_t seq0, uint64_t start) {
    uint64_t *c = r->ctl;
    if (ld_rlx(&c[SHMQ_W_FIRST_SEQ]) >= seq0 && ld_rlx(&c[SHMQ_W_FIRST_POS]) != start) st_rel(&c[SHMQ_W_FIRST_POS], start);
}

/* A callout of a write (a fill, before_commit) with the writer lock held:
 * the handle is busy (a close meanwhile is deferred) and the thread
 * recorded (a put or reserve from it fails instead of deadlocking).  0, or
 * SHMQ_ECALLBACK (it failed), or SHMQ_ECLOSED (the handle was closed in it). */
static int callout_begin(eng_ring *r) {
    atomic_fetch_add_explicit(&r->busy, 1, memory_order_acq_rel);
    atomic_store_explicit(&r->callout_thread, this_thread(), memory_order_relaxed);
    return 0;
}
static int callout_end(eng_ring *r, int rc) {
    atomic_store_explicit(&r->callout_thread, 0, memory_order_relaxed);
    atomic_fetch_sub_explicit(&r->busy, 1, memory_order_acq_rel);
    if (rc == 0 && ring_closing(r))
        return eng_fail(SHMQ_ECLOSED, "spool handle was closed inside a write's callout (fill or before_commit)");
    return rc ? SHMQ_ECALLBACK : 0;
}

/* Place, write and publish a batch (writer lock held).  Returns the first
 * seq, a status, or an error.  With options `o`: before_commit runs once the
 * batch is placed (evicted, pages allocated), before any byte is written; a
 * fill writes its payload in place, its crc computed after; imported
 * timestamps go in the headers (the statistics count the put at now); sync
 * msyncs the batch's pages before the commit.  A callout that fails aborts
 * the batch (unplace): nothing published. */
int64_t write_locked(eng_ring *r, eng_item *items, size_t count, uint64_t *needs, uint64_t total, int codec,
                     int64_t max_backlog, uint64_t *placed, const eng_wopts *o) {
    Placement pl;
    int st = place_batch(r, count, needs, total, max_backlog, placed, &pl);
    if (st != 0) return st;
    uint64_t ts = now_ns();
    if (o && o->before_commit) {
        callout_begin(r);
        st = callout_end(r, o->before_commit(o->ctx, pl.seq0, placed, count));
        if (st < 0) goto abort;
    }
    write_pads(r, &pl, ts);
    uint64_t nbytes = 0, seq = pl.seq0;
    uint16_t flags = r->checksum ? SHMQ_FLAG_CRC : 0;
    int hooked = count > 1 && crash_armed(r);
    char *ring = r->ring; /* locals: the copies below could alias *r for the compiler */
    const uint64_t ring_bytes = r->ring_bytes;
    for (size_t k = 0; k < count; k++) {
        uint64_t off = placed[k] % ring_bytes;
        shmq_frame_header h = {seq, (uint32_t)needs[k], (uint32_t)items[k].n, ts, items[k].crc, flags, (uint8_t)codec, 0};
        char *dst = ring + off + SHMQ_FRAME_BYTES;
        if (o) {
            if (o->timestamps) h.ts = o->timestamps[k];
            if (o->deferred && items[k].fill) {
                callout_begin(r);
                st = callout_end(r, items[k].fill(items[k].fill_ctx, dst, items[k].n));
                if (st < 0) goto abort;
                if (r->checksum) h.crc = eng_crc(0, (const unsigned char *)dst, (size_t)items[k].n);
                dst += items[k].n;
            }
        }
        memcpy(ring + off, &h, SHMQ_FRAME_BYTES);
        const eng_seg *sg = items[k].segs;
        for (int j = 0, ns = items[k].nsegs; j < ns; j++) {
            eng_copy(dst, sg[j].buf, sg[j].len);
            dst += sg[j].len;
        }
        uint64_t pad = needs[k] - SHMQ_FRAME_BYTES - items[k].n;
        if (pad) memset(dst, 0, (size_t)pad);
        seq++;
        nbytes += items[k].n;
        if (hooked && (st = crash_point(r, "frame-written")) < 0) goto abort;
    }
    if (o && o->sync && (st = eng_sync_ring(r, pl.start, pl.end)) < 0) goto abort; /* durable before published */
    if (hooked) { /* the harness kills between the commit point and NEXT_POS */
        st_rel(&r->ctl[SHMQ_W_NEXT_SEQ], seq); /* <- the commit point */
        if ((st = crash_point(r, "committed")) < 0) return st;
    }
    commit_batch(r, seq, pl.end, (uint64_t)count, nbytes, ts);
    return (int64_t)pl.seq0;
abort:
    unplace(r, pl.seq0, pl.start);
    return st;
}


/* Pre-fault the ring ahead of this process's writes, for its first lap.
 * A process that starts writing into an existing ring (a new producer, a
 * Spark task) otherwise takes a write fault per 4 KiB page for a whole lap,
 * and short-lived producers never leave that lap: on a wrapped 64 MiB ring,
 * 100 B frames, 4.4-4.8 -> 6.7-6.8 M frames/s with the pages populated.
 * MADV_POPULATE_WRITE (Linux 5.14) maps a chunk's pages in one call instead
 * of one fault each; on older kernels (EINVAL) it is not tried again.  Fixed
 * rings only: a growable ring's pages past its zone or in a trimmed hole must
 * not be allocated behind the writer's bookkeeping.  Failures cost nothing
 * but the faults the writes then take.  One thread of the handle does it at
 * a time (the window is the handle's); another skips it: a fault more. */
#define POPULATE_CHUNK (256u << 10)
static void populate_window(eng_ring *r, uint64_t pos, uint64_t len);
void populate_ahead(eng_ring *r, uint64_t pos, uint64_t len) {
    if (atomic_load_explicit(&r->pop_state, memory_order_relaxed) == 2 || r->segment) return;
    /* Mapped far enough ahead already (the common case): no lock taken.  A
     * racy look at the window's end: it only grows within a lap, and a stale
     * one only makes this put take the lock and look again. */
    if (atomic_load_explicit(&r->pop_state, memory_order_relaxed) == 1 &&
        pos + len + POPULATE_CHUNK / 2 <= atomic_load_explicit(&r->pop_pos, memory_order_relaxed))
        return;
    if (atomic_exchange_explicit(&r->pop_busy, 1, memory_order_acquire)) return;
    populate_window(r, pos, len);
    atomic_store_explicit(&r->pop_busy, 0, memory_order_release);
}

/* pop_busy held. */
static void populate_window(eng_ring *r, uint64_t pos, uint64_t len) {
    uint64_t ring = r->ring_bytes, page = 4096;
    int state = atomic_load_explicit(&r->pop_state, memory_order_relaxed);
    uint64_t at = atomic_load_explicit(&r->pop_pos, memory_order_relaxed);
    if (state == 0 || pos > at) { /* first write, or written past: restart at pos */
        if (state == 0) r->pop_start = pos & ~(page - 1);
        at = pos & ~(page - 1);
        state = 1;
    }
    uint64_t want = pos + len + POPULATE_CHUNK;
    while (at < want) {
        if (at - r->pop_start >= ring) { /* a whole lap is mapped in this process */
            state = 2;
            break;
        }
        uint64_t off = at % ring, n = POPULATE_CHUNK;
        if (n > ring - off) n = ring - off;
        if (madvise(r->ring + off, n, MADV_POPULATE_WRITE) != 0) {
            state = 2;
            break;
        }
        at += n;
    }
    atomic_store_explicit(&r->pop_pos, at, memory_order_relaxed);
    atomic_store_explicit(&r->pop_state, state, memory_order_relaxed);
}

/* Fetch the line at p for writing: exclusive, every other cache's copy
 * invalidated now rather than when the store comes.  __builtin_prefetch's
 * write hint is a plain PREFETCHT0 on x86-64 unless the build targets
 * PRFCHW, and a line fetched shared makes the store wait for the other
 * copies' invalidation anyway: on a full ring those are the reader's (it
 * read the line a lap ago).  While this VM's two vCPUs were far apart (a
 * line took about 200 ns from one to the other), 100 B frames through a
 * full 1 MiB ring moved about 3 M/s with the read prefetch and 7 with
 * PREFETCHW, as fast as while they were near.  CPUs without PRFCHW (CPUID
 * 0x80000001 ECX bit 8; some Intel ones before Broadwell) get the read
 * prefetch.  aarch64's builtin is already a write prefetch (PRFM
 * PSTL1KEEP). */
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
static int has_prefetchw(void) {
    static _Atomic int known; /* 0: not looked yet; 1: no; 2: yes (a race looks twice, harmlessly) */
    int k = atomic_load_explicit(&known, memory_order_relaxed);
    if (!k) {
        unsigned a, b, c = 0, d;
        k = __get_cpuid(0x80000001u, &a, &b, &c, &d) && (c & (1u << 8)) ? 2 : 1;
        atomic_store_explicit(&known, k, memory_order_relaxed);
    }
    return k == 2;
}
static inline void prefetch_for_write(const char *p, int w) {
    if (w) __asm__ volatile("prefetchw %0" ::"m"(*p));
    else __builtin_prefetch(p, 0, 3);
}
#else
static int has_prefetchw(void) { return 1; }
static inline void prefetch_for_write(const char *p, int w) {
    (void)w;
    __builtin_prefetch(p, 1, 3);
}
#endif

/* Ask for the lines the next puts will write, for writing, while this one
 * returns.  On a ring that has wrapped they were last touched a lap ago (out
 * of cache: on a 64 MiB ring every store missed to memory, 3.3 against 6.2 M
 * frames/s with the prefetch); on a fresh one the page fault that zeroed them
 * warmed them anyway.  Only into free space ([NEXT_POS, FIRST_POS + ring),
 * evicted frames): when the ring is full those lines are the ones a reader is
 * about to read, and taking them exclusive would make it refetch each one
 * (a 1 MiB full ring measured 4.1 M frames/s with it, 7.7 without).  The
 * window is as long as this write (`total`, the next one is likely alike),
 * at least 256 bytes and at most PREFETCH_MAX: with 256 bytes most lines
 * of a 1 KiB put were not prefetched (the 1 KiB full-ring loop in the VM's
 * slow phase, 200,000 frames: 79.5 ms with 256 bytes, 52.5 with the
 * write's length, 94.5 with the read prefetch; medians of 24-28
 * alternated runs; 37-38 ms each in the fast phase). */
#define PREFETCH_FROM 256
#define PREFETCH_MIN 256
#define PREFETCH_MAX 4096
static void prefetch_ahead(eng_ring *r, uint64_t next, uint64_t total) {
    uint64_t ring = r->ring_bytes, first = ld_rlx(&r->ctl[SHMQ_W_FIRST_POS]);
    uint64_t to = PREFETCH_FROM + (total < PREFETCH_MIN ? PREFETCH_MIN : total > PREFETCH_MAX ? PREFETCH_MAX : total);
    if (first + ring < next + to + 4096) return; /* little free space: a reader is near */
    uint64_t off = next % ring;
    int w = has_prefetchw();
    for (uint64_t k = PREFETCH_FROM; k < to && off + k < ring; k += 64)
        prefetch_for_write(r->ring + off + k, w);
}

/* Headroom before evicting (block policy, a blocking put: `patient`).  A
 * producer faster than its consumers keeps the ring full: each put then
 * evicts the one or two frames the reader has just committed and writes
 * into the lines right behind the one the reader is reading, so the two
 * processes take those lines, the oldest-frame words and the reader's slot
 * from each other about every 10 frames (without the wait below, the 1 MiB
 * wrapped benchmark row measured 88% of an unwrapped ring).  Waiting
 * (spinning) until consumers have freed ROOM_HEADROOM bytes (an eighth of a
 * small ring), at most ROOM_WAIT_NS, lets the writer then put a burst while
 * the reader reads elsewhere: +7-8% on that row in an interleaved A/B, fresh
 * rings unchanged.  Never longer than ROOM_WAIT_NS: a consumer that stops
 * leaves the room it freed usable. */
#define ROOM_HEADROOM (16u << 10)
#define ROOM_WAIT_NS 20000ull
static inline void wait_for_headroom(eng_ring *r, uint64_t total) {
    uint64_t ring = r->ring_bytes, nxt = ld_rlx(&r->ctl[SHMQ_W_NEXT_POS]), f;
    if (r->segment || nxt + total - ld_rlx(&r->ctl[SHMQ_W_FIRST_POS]) <= ring) return; /* room without evicting */
    uint64_t want = nxt + total + (ring / 8 < ROOM_HEADROOM ? ring / 8 : ROOM_HEADROOM), t0 = mono_ns();
    while (slot_floor(r, SHMQ_S_POS, &f) && f < nxt && f + ring < want && mono_ns() - t0 < ROOM_WAIT_NS)
        for (int k = 0; k < 64; k++) cpu_relax(); /* poll the consumers' slots sparingly: they store there */
}

/* The crc of an item's segments (spools with checksums), before the lock. */
void eng_item_crc(eng_item *it) {
    uint32_t crc = 0;
    for (int j = 0; j < it->nsegs; j++) crc = eng_crc(crc, it->segs[j].buf, it->segs[j].len);
    it->crc = crc;
}

/* writer_reentry's look at this thread, once some thread of the handle holds
 * the writer lock through a reservation or a callout. */
int writer_reentry_slow(eng_ring *r, const char *what) {
    unsigned long me = this_thread();
    if (atomic_load_explicit(&r->resv_thread, memory_order_relaxed) == me)
        return eng_fail(SHMQ_ESTATE, "%s inside an open reservation of the same spool in the same thread would "
                        "deadlock: commit or abandon it first (it holds the writer lock)", what);
    if (atomic_load_explicit(&r->callout_thread, memory_order_relaxed) == me)
        return eng_fail(SHMQ_ESTATE, "%s from a fill() or before_commit() of the same spool would deadlock "
                        "(they run under the writer lock)", what);
    return 0;
}

/* Write a batch: take the writer lock (up to lock_wait, the caller's lock
 * dropped while waiting), write_locked, release, ring the readers' doorbell.
 * `patient`: a blocking put (block policy) that may wait a moment for
 * headroom.  The first seq, a status (SHMQ_ELOCKED: the lock was not free
 * in time; SHMQ_EFULL, SHMQ_EBACKLOG, SHMQ_EPINNED: no room now;
 * SHMQ_ETOOLARGE; SHMQ_ENOSPACE), or an error (SHMQ_ESTATE: a put inside
 * this thread's own reservation or callout, which would deadlock). */
int64_t eng_write(eng_ring *r, eng_item *items, size_t count, int codec, int64_t max_backlog, double lock_wait,
                  int patient, const eng_wopts *o) {
    int st = writer_reentry(r, "put");
    if (st) return st;
    uint64_t stack_needs[64], stack_placed[64];
    uint64_t *needs = stack_needs, *placed = stack_placed;
    if (count > 64) {
        needs = malloc(sizeof(uint64_t) * 2 * count);
        if (!needs) return eng_fail(-ENOMEM, "out of memory");
        placed = needs + count;
    }
    int64_t res;
    uint64_t total = 0;
    for (size_t k = 0; k < count; k++) {
        if (items[k].n > r->max_payload) {
            res = SHMQ_ETOOLARGE;
            goto out;
        }
        needs[k] = SHMQ_FRAME_BYTES + ((items[k].n + 7) & ~(uint64_t)7);
        total += needs[k];
    }
    if (count == 0 || count > MAX_BATCH || total > r->ring_bytes ||
        (max_backlog >= 0 && (int64_t)count > max_backlog)) {
        res = SHMQ_ETOOLARGE;
        goto out;
    }
    if (patient && r->policy == SHMQ_POLICY_BLOCK) wait_for_headroom(r, total);
    int lk = eng_sem_lock(r->wsem, lock_wait, r->hooks, r, &r->ctl[SHMQ_W_LOCK_HOLDER], r->holder);
    if (lk != 0) {
        res = lk > 0 ? SHMQ_ELOCKED : lk;
        goto out;
    }
    res = write_locked(r, items, count, needs, total, codec, max_backlog, placed, o);
    wlock_release(r);
    if (res >= 0) {
        ring_bell(r, r->rsem);
        uint64_t next = ld_rlx(&r->ctl[SHMQ_W_NEXT_POS]);
        populate_ahead(r, next, total);
        prefetch_ahead(r, next, total);
        /* ... and the commit itself (another writer's since, at worst).  Failing,
         * the batch is published but not known durable: the error says so. */
        if (o && o->sync) {
            int s = eng_sync_header(r);
            if (s < 0) res = s;
        }
    }
    ring_finish(r);
out:
    if (needs != stack_needs) free(needs);
    return res;
}

/* msync ring positions [a, b) (a span of up to a lap; more: the whole ring),
 * the caller's lock dropped, close deferred.  0, or -errno. */
int eng_sync_ring(eng_ring *r, uint64_t a, uint64_t b) {
    uint64_t ring = r->ring_bytes, spans[2][2];
    int n = 0;
    if (b - a >= ring) {
        spans[n][0] = 0, spans[n++][1] = ring;
    } else {
        uint64_t lo = a % ring, hi = lo + (b - a);
        spans[n][0] = lo, spans[n++][1] = hi < ring ? hi : ring;
        if (hi > ring) spans[n][0] = 0, spans[n++][1] = hi - ring;
    }
    uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    int rc = 0, err = 0;
    void *saved = ring_block(r);
    for (int i = 0; i < n && rc == 0; i++) {
        uintptr_t lo = (uintptr_t)(r->ring + spans[i][0]) & ~(page - 1), hi = (uintptr_t)(r->ring + spans[i][1]);
        rc = msync((void *)lo, hi - lo, MS_SYNC);
        err = errno;
    }
    ring_unblock(r, saved);
    return rc != 0 ? eng_fail(-err, "%s: msync: %s", r->path, strerror(err)) : 0;
}

/* msync the header page (the commit) of a sync batch, after it. */
int eng_sync_header(eng_ring *r) {
    void *saved = ring_block(r);
    int rc = msync(r->base, SHMQ_HEADER_BYTES, MS_SYNC), err = errno;
    ring_unblock(r, saved);
    return rc != 0 ? eng_fail(-err, "%s: msync: %s", r->path, strerror(err)) : 0;
}
