/*
 * shmq/core/write.c: the writer -- placement, eviction and commit, one of
 * each, shared by every write path: put, put_many (with its options) and
 * reserve (docs/format.md, "The compiled core").  There is no other.
 *
 * Everything between taking the writer lock and releasing it is plain C
 * over the Ring (place_batch, make_room, write_pads, write_locked,
 * commit_batch): no Python object is touched on a sane ring, so a pthread
 * harness (stress/tsan.py) can call them under the lock without the GIL.
 * The exceptions, which need the GIL: a corrupt ring (SpoolFormatError),
 * the fault-injection hook, a growable ring's page allocation (zone.c
 * releases the GIL around fallocate), and what put_many's options ask for
 * (options.c: a Deferred's fill, before_commit, msync), reached only when
 * a caller passes them.  ring_write, load_item and release_items are the
 * entry points' side (buffers, the lock wait).
 *
 * Barrier pairs: the release store of NEXT_SEQ (commit_batch) pairs with
 * the readers' acquire load of it (read.c); the FIRST_POS store and release
 * fence of publish_first pair with the readers' acquire fence and FIRST_POS
 * re-check after their copy.
 */
#include "core.h"

uint64_t slot_hwm(Ring *r) {
    uint64_t h = ld_rlx(&r->ctl[W_SLOT_HWM]);
    return h < r->slot_count ? h : r->slot_count; /* clamped: a corrupt word must not index past the table */
}

/* Minimum of slot word `word` over named readers and groups; returns 0 and
 * leaves *out alone when there are none. */
int slot_floor(Ring *r, int word, uint64_t *out) {
    int found = 0;
    uint64_t h = slot_hwm(r), m = 0;
    for (uint64_t i = 0; i < h; i++) {
        uint64_t *s = r->slots + i * SLOT_WORDS;
        uint64_t st = ld_rlx(&s[S_STATE]);
        if (st == SLOT_READER || st == SLOT_GROUP) {
            uint64_t v = ld_acq(&s[word]);
            if (!found || v < m) m = v;
            found = 1;
        }
    }
    if (found) *out = m;
    return found;
}

uint64_t pin_floor(Ring *r) {
    uint64_t h = slot_hwm(r), m = UINT64_MAX;
    for (uint64_t i = 0; i < h; i++) {
        uint64_t *s = r->slots + i * SLOT_WORDS;
        if (ld_rlx(&s[S_STATE]) == SLOT_PIN) {
            uint64_t v = ld_acq(&s[S_POS]);
            if (v < m) m = v;
        }
    }
    return m;
}

void take_full_marker(Ring *r) {
    uint64_t f;
    if (!slot_floor(r, S_POS, &f)) f = ld_rlx(&r->ctl[W_FIRST_POS]);
    r->full_floor = f;
    r->full_pin = pin_floor(r);
}

static void record_high_water(Ring *r) {
    uint64_t *c = r->ctl;
    uint64_t frames = ld_rlx(&c[W_NEXT_SEQ]) - ld_rlx(&c[W_FIRST_SEQ]);
    uint64_t used = ld_rlx(&c[W_NEXT_POS]) - ld_rlx(&c[W_FIRST_POS]);
    if (frames > ld_rlx(&c[W_HIGH_FRAMES])) st_rlx(&c[W_HIGH_FRAMES], frames);
    if (used > ld_rlx(&c[W_HIGH_BYTES])) st_rlx(&c[W_HIGH_BYTES], used);
}

/* Store the new oldest frame (writer lock held), both words before any byte
 * below `pos` is overwritten.  While frames stay resident, the position goes
 * first: a writer killed in between leaves FIRST_POS at a real frame, whose
 * header recovery re-reads the seq from.  When everything is evicted, `pos` is
 * where the next batch goes and holds no header of this lap yet (an older
 * lap's frame may sit there and look valid): the seq goes first, so a writer
 * killed in between leaves FIRST_SEQ = NEXT_SEQ, which recovery reads as an
 * empty ring.  0, or ST_PYERR if the fault-injection hook raised. */
static int publish_first(Ring *r, uint64_t seq, uint64_t pos, uint64_t next_seq) {
    uint64_t *c = r->ctl;
    if (seq >= next_seq) {
        st_rel(&c[W_FIRST_SEQ], seq);
        if (crash_point(r, "evicting") < 0) return ST_PYERR;
        st_rlx(&c[W_FIRST_POS], pos);
        atomic_thread_fence(memory_order_release); /* before any overwritten byte, as below */
        return 0;
    }
    st_rlx(&c[W_FIRST_POS], pos); /* position first: readers re-derive seq from its header */
    atomic_thread_fence(memory_order_release); /* ... and see it before any overwritten byte */
    if (crash_point(r, "evicting") < 0) return ST_PYERR;
    st_rel(&c[W_FIRST_SEQ], seq);
    return 0;
}

/* Move FIRST_* past everything below byte position `limit` (writer lock
 * held).  Returns 0 on success, ST_NO_ROOM / ST_SLOW, or ST_PYERR with an
 * exception set.  Overwrite policy walks the evicted headers (a few loads
 * each); block/error jump in one step to the slowest named cursor. */
int make_room(Ring *r, uint64_t limit, uint64_t next_seq, uint64_t batch_pos) {
    uint64_t *c = r->ctl, ring = r->ring_bytes;
    uint64_t pin = pin_floor(r);
    if (pin < limit) { /* a zero-copy view reads that frame: Python waits for it (the room marker) */
        take_full_marker(r);
        return ST_SLOW;
    }
    uint64_t seq = ld_rlx(&c[W_FIRST_SEQ]), pos = ld_rlx(&c[W_FIRST_POS]), start_seq = seq;
    uint64_t next_pos = ld_rlx(&c[W_NEXT_POS]);
    record_high_water(r);
    if (r->policy != 0) {
        uint64_t floor;
        if (!slot_floor(r, S_POS, &floor)) floor = pos; /* no consumers registered: keep everything */
        /* The jump below goes past `limit`, up to the slowest cursor: never past a
         * pinned frame (a reader moves its cursor on before it releases its view).
         * A pin is the header position of a resident data frame, >= limit here. */
        if (pin < floor) floor = pin;
        if (floor < limit && floor < next_pos) {
            take_full_marker(r);
            return ST_NO_ROOM; /* unconsumed frames in the way */
        }
        if (floor >= next_pos) {
            seq = next_seq; /* all consumed */
        } else if (floor > pos) {
            /* Jump to the slowest cursor: its header names its seq (a pad
             * carries the seq of the frame after it). */
            uint64_t off = floor % ring;
            if (ring - off < FRAME_BYTES) off = 0;
            FrameHeader h;
            read_header(r, off, &h);
            if (h.seq < seq || h.seq >= next_seq || !header_sane(&h, off, ring)) {
                corrupt(r, "reader cursor at position %llu does not point at a frame "
                        "(header says seq %llu); " RING_ADVICE,
                        (unsigned long long)floor, (unsigned long long)h.seq);
                return ST_PYERR;
            }
            seq = h.seq;
            pos = floor;
        }
        if (seq >= next_seq) pos = batch_pos;
        if (publish_first(r, seq, pos, next_seq) < 0) return ST_PYERR;
        st_rlx(&c[W_EVICTED], ld_rlx(&c[W_EVICTED]) + (seq - start_seq));
        return 0;
    }
    uint64_t walk_start = pos;
    while (pos < limit && seq < next_seq) {
        uint64_t off = pos % ring;
        if (ring - off < FRAME_BYTES) {
            pos += ring - off;
            continue;
        }
        FrameHeader h;
        read_header(r, off, &h);
        /* A PAD fills the ring's tail exactly and never starts the ring, and no
         * walk of resident frames spans more than the ring: anything else is
         * corruption (and would otherwise spin on a self-repeating PAD). */
        if (h.seq != seq || !header_sane(&h, off, ring) ||
            ((h.flags & FLAG_PAD) && (off == 0 || off + h.stored != ring)) || pos + h.stored - walk_start > ring) {
            corrupt(r, "ring is corrupt at seq %llu (offset %llu: header says seq %llu, %u bytes); "
                    RING_ADVICE,
                    (unsigned long long)seq, (unsigned long long)off, (unsigned long long)h.seq, h.stored);
            return ST_PYERR;
        }
        pos += h.stored;
        if (!(h.flags & FLAG_PAD)) seq++;
    }
    if (seq >= next_seq) pos = batch_pos; /* everything evicted: the ring restarts at this batch */
    if (publish_first(r, seq, pos, next_seq) < 0) return ST_PYERR;
    st_rlx(&c[W_EVICTED], ld_rlx(&c[W_EVICTED]) + (seq - start_seq));
    return 0;
}

static inline void roll_rate(Ring *r, uint64_t ts) {
    uint64_t sec = ts / 1000000000ull;
    int b = W_RATE + (int)(sec % RATE_SECONDS) * RATE_WORDS;
    r->rate_word = b + 1;
    r->rate_until = (sec + 1) * 1000000000ull;
    if (ld_rlx(&r->ctl[b]) != sec) {
        st_rlx(&r->ctl[b], sec);
        st_rlx(&r->ctl[b + 1], 0);
        st_rlx(&r->ctl[b + 2], 0);
    }
}


static int get_segment(PyObject *o, Py_buffer *v) {
    if (PyUnicode_Check(o)) {
        PyErr_SetString(PyExc_TypeError, "frames are bytes-like objects, not str: encode it first (e.g. s.encode())");
        return -1;
    }
    if (PyObject_GetBuffer(o, v, PyBUF_C_CONTIGUOUS) == 0) return 0;
    if (PyErr_ExceptionMatches(PyExc_BufferError) || PyErr_ExceptionMatches(PyExc_ValueError)) {
        Py_buffer probe;
        PyErr_Clear();
        if (PyObject_GetBuffer(o, &probe, PyBUF_STRIDES) == 0) {
            PyBuffer_Release(&probe);
            PyErr_SetString(PyExc_ValueError, "frame buffer must be C-contiguous");
            return -1;
        }
        PyErr_Clear();
    } else if (!PyErr_ExceptionMatches(PyExc_TypeError)) {
        return -1;
    }
    PyErr_Clear();
    SHMQ_ERR_TYPE_NAME(PyExc_TypeError, "frames are bytes-like objects, not", o);
    return -1;
}

void release_items(Item *items, Py_ssize_t k) {
    for (Py_ssize_t i = 0; i < k; i++)
        for (int j = 0; j < items[i].nviews; j++) PyBuffer_Release(&items[i].views[j]);
}

int load_item(Item *it, PyObject *o, int checksum) {
    it->nviews = 0;
    it->n = 0;
    it->crc = 0;
    it->fill = NULL;
    if (PyTuple_CheckExact(o)) {
        Py_ssize_t k = PyTuple_GET_SIZE(o);
        if (k > MAX_SEGS) {
            PyErr_Format(PyExc_ValueError, "a frame has at most %d segments", MAX_SEGS);
            return -1;
        }
        for (Py_ssize_t j = 0; j < k; j++) {
            if (get_segment(PyTuple_GET_ITEM(o, j), &it->views[j]) < 0) {
                for (int q = 0; q < it->nviews; q++) PyBuffer_Release(&it->views[q]);
                it->nviews = 0;
                return -1;
            }
            it->nviews++;
            it->n += (uint64_t)it->views[j].len;
        }
    } else {
        if (get_segment(o, &it->views[0]) < 0) return -1;
        it->nviews = 1;
        it->n = (uint64_t)it->views[0].len;
    }
    if (checksum) {
        uint32_t crc = 0;
        for (int j = 0; j < it->nviews; j++) crc = crc_update(crc, it->views[j].buf, (size_t)it->views[j].len);
        it->crc = crc;
    }
    return 0;
}

/* Where a batch of `count` frames of needs[] bytes (total: their sum) goes
 * (writer lock held): fills placed[] and *pl, evicts what is in the way and,
 * on a growable ring, allocates its pages (may wrap early).  0 (nothing
 * written yet: the caller writes the frames, write_pads, then
 * commit_batch), a status (ST_BACKLOG, ST_NO_ROOM, ST_SLOW, ST_NO_SPACE:
 * nothing changed but the room marker), or ST_PYERR.  The one placement of
 * put, put_many and reserve. */
int place_batch(Ring *r, Py_ssize_t count, const uint64_t *needs, uint64_t total, int64_t max_backlog,
                uint64_t *placed, Placement *pl) {
    uint64_t *c = r->ctl, ring = r->ring_bytes;
    uint64_t seq0 = ld_rlx(&c[W_NEXT_SEQ]), start = ld_rlx(&c[W_NEXT_POS]);
    pl->seq0 = seq0;
    pl->start = start;
    if (max_backlog >= 0) {
        uint64_t floor;
        if (slot_floor(r, S_SEQ, &floor) && seq0 - floor + (uint64_t)count > (uint64_t)max_backlog) {
            take_full_marker(r);
            return ST_BACKLOG;
        }
    }
    /* Placement: a frame that does not fit before the ring's end is preceded
     * by padding to the end (a PAD header if 32+ bytes remain). */
    uint64_t pos = start;
    int restart = 0;
    pl->npads = 0;
    for (Py_ssize_t k = 0; k < count; k++) {
        uint64_t off = pos % ring;
        if (ring - off < needs[k]) {
            if (pl->npads == 2) { restart = 1; break; } /* wraps more than once: start at the ring's start */
            if (ring - off >= FRAME_BYTES) {
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
        if (off && ring - off >= FRAME_BYTES) {
            pl->pads_off[0] = off;
            pl->pads_gap[0] = ring - off;
            pl->pads_k[0] = 0;
            pl->npads = 1;
        }
        if (off) pos += ring - off;
        for (Py_ssize_t k = 0; k < count; k++) {
            placed[k] = pos;
            pos += needs[k];
        }
    }
    pl->end = pos;
    if (r->segment) { /* a growable ring: its pages first (may wrap early) */
        int st = zone_place(r, start, count, needs, total, placed, pl, seq0);
        if (st != 0) return st;
    }
    if (pl->end - ld_rlx(&c[W_FIRST_POS]) > ring) return make_room(r, pl->end - ring, seq0, placed[0]);
    return 0;
}

/* The PAD headers of a placement (writer lock held, after place_batch). */
void write_pads(Ring *r, const Placement *pl, uint64_t ts) {
    for (int p = 0; p < pl->npads; p++) {
        FrameHeader h = {pl->seq0 + (uint64_t)pl->pads_k[p], (uint32_t)pl->pads_gap[p], 0, ts, 0, FLAG_PAD, 0, 0};
        memcpy(r->ring + pl->pads_off[p], &h, FRAME_BYTES);
    }
}

/* Publish frames written below `next_seq` / `end` (writer lock held): the
 * commit point, then the statistics, exact under the lock (puts are
 * NEXT_SEQ itself).  The one commit of put, put_many and reserve. */
void commit_batch(Ring *r, uint64_t next_seq, uint64_t end, uint64_t count, uint64_t nbytes, uint64_t ts) {
    uint64_t *c = r->ctl;
    st_rel(&c[W_NEXT_SEQ], next_seq); /* <- the commit point */
    st_rlx(&c[W_NEXT_POS], end);
    st_rlx(&c[W_PUT_BYTES], ld_rlx(&c[W_PUT_BYTES]) + nbytes);
    st_rlx(&c[W_LAST_PUT_NS], ts);
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
void unplace(Ring *r, uint64_t seq0, uint64_t start) {
    uint64_t *c = r->ctl;
    if (ld_rlx(&c[W_FIRST_SEQ]) >= seq0 && ld_rlx(&c[W_FIRST_POS]) != start) st_rel(&c[W_FIRST_POS], start);
}

/* Place, write and publish a batch (writer lock held).  Returns the first
 * seq, or a negative status (ST_PYERR: exception set).  Python-free on a sane
 * fixed ring without a crash hook or options `o` (see the file's comment).
 * With `o`: before_commit runs once the batch is placed (evicted, pages
 * allocated), before any byte is written; a Deferred's fill writes its
 * payload in place, its crc computed after; imported timestamps go in the
 * headers (the statistics count the put at now); sync msyncs the batch's
 * pages before the commit.  A callout that raises aborts the batch
 * (unplace): nothing published. */
int64_t write_locked(Ring *r, Item *items, Py_ssize_t count, uint64_t *needs, uint64_t total, int codec,
                     int64_t max_backlog, uint64_t *placed, const WriteOpts *o) {
    Placement pl;
    int st = place_batch(r, count, needs, total, max_backlog, placed, &pl);
    if (st != 0) return st;
    uint64_t ts = now_ns();
    if (o && o->before_commit && call_before_commit(r, o->before_commit, pl.seq0, placed, count) < 0) goto abort;
    write_pads(r, &pl, ts);
    uint64_t nbytes = 0, seq = pl.seq0;
    uint16_t flags = r->checksum ? FLAG_CRC : 0;
    int hooked = count > 1 && r->st && r->st->crash_hook;
    for (Py_ssize_t k = 0; k < count; k++) {
        uint64_t off = placed[k] % r->ring_bytes;
        FrameHeader h = {seq, (uint32_t)needs[k], (uint32_t)items[k].n, ts, items[k].crc, flags, (uint8_t)codec, 0};
        char *dst = r->ring + off + FRAME_BYTES;
        if (o) {
            if (o->timestamps) h.ts = o->timestamps[k];
            if (o->deferred && items[k].fill) {
                if (fill_payload(r, items[k].fill, dst, items[k].n) < 0) goto abort;
                if (r->checksum) h.crc = crc_update(0, (const unsigned char *)dst, (size_t)items[k].n);
                dst += items[k].n;
            }
        }
        memcpy(r->ring + off, &h, FRAME_BYTES);
        for (int j = 0; j < items[k].nviews; j++) {
            memcpy(dst, items[k].views[j].buf, (size_t)items[k].views[j].len);
            dst += items[k].views[j].len;
        }
        uint64_t pad = needs[k] - FRAME_BYTES - items[k].n;
        if (pad) memset(dst, 0, (size_t)pad);
        seq++;
        nbytes += items[k].n;
        if (hooked && call_crash_hook(r->st, "frame-written") < 0) goto abort;
    }
    if (o && o->sync && sync_ring(r, pl.start, pl.end) < 0) goto abort; /* durable before published */
    if (hooked) { /* the harness kills between the commit point and NEXT_POS */
        st_rel(&r->ctl[W_NEXT_SEQ], seq); /* <- the commit point */
        if (call_crash_hook(r->st, "committed") < 0) return ST_PYERR;
    }
    commit_batch(r, seq, pl.end, (uint64_t)count, nbytes, ts);
    return (int64_t)pl.seq0;
abort:
    unplace(r, pl.seq0, pl.start);
    return ST_PYERR;
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
 * but the faults the writes then take. */
#define POPULATE_CHUNK (256u << 10)
void populate_ahead(Ring *r, uint64_t pos, uint64_t len) {
    if (r->pop_state == 2 || r->segment) return;
    uint64_t ring = r->ring_bytes, page = 4096;
    if (r->pop_state == 0 || pos > r->pop_pos) { /* first write, or written past: restart at pos */
        if (r->pop_state == 0) r->pop_start = pos & ~(page - 1);
        r->pop_pos = pos & ~(page - 1);
        r->pop_state = 1;
    }
    uint64_t want = pos + len + POPULATE_CHUNK;
    while (r->pop_pos < want) {
        if (r->pop_pos - r->pop_start >= ring) { /* a whole lap is mapped in this process */
            r->pop_state = 2;
            return;
        }
        uint64_t off = r->pop_pos % ring, n = POPULATE_CHUNK;
        if (n > ring - off) n = ring - off;
        if (madvise(r->ring + off, n, MADV_POPULATE_WRITE) != 0) {
            r->pop_state = 2;
            return;
        }
        r->pop_pos += n;
    }
}

/* Ask for the lines the next puts will write, for writing, while this one
 * returns.  On a ring that has wrapped they were last touched a lap ago (out
 * of cache: on a 64 MiB ring every store missed to memory, 3.3 against 6.2 M
 * frames/s with the prefetch); on a fresh one the page fault that zeroed them
 * warmed them anyway.  Only into free space ([NEXT_POS, FIRST_POS + ring),
 * evicted frames): when the ring is full those lines are the ones a reader is
 * about to read, and taking them exclusive made it refetch each one (a 1 MiB
 * full ring: 7.7 -> 4.1 M/s). */
#define PREFETCH_FROM 256
#define PREFETCH_TO 512
static void prefetch_ahead(Ring *r, uint64_t next) {
    uint64_t ring = r->ring_bytes, first = ld_rlx(&r->ctl[W_FIRST_POS]);
    if (first + ring < next + PREFETCH_TO + 4096) return; /* little free space: a reader is near */
    uint64_t off = next % ring;
    for (uint64_t k = PREFETCH_FROM; k < PREFETCH_TO && off + k < ring; k += 64)
        __builtin_prefetch(r->ring + off + k, 1, 3);
}

/* Headroom before evicting (block policy, a blocking put: `patient`).  A
 * producer faster than its consumers keeps the ring full: each put then
 * evicts the one or two frames the reader has just committed and writes
 * into the lines right behind the one the reader is reading, so the two
 * processes take those lines, the oldest-frame words and the reader's slot
 * from each other about every 10 frames (the 1 MiB wrapped benchmark row
 * ran at 88% of an unwrapped ring).  Waiting, GIL held, until consumers
 * have freed ROOM_HEADROOM bytes (an eighth of a small ring), at most
 * ROOM_WAIT_NS, lets the writer then put a burst while the reader reads
 * elsewhere: +7-8% on that row in an interleaved A/B, fresh rings
 * unchanged.  Never longer than ROOM_WAIT_NS: a consumer that stops leaves
 * the room it freed usable, as before. */
#define ROOM_HEADROOM (16u << 10)
#define ROOM_WAIT_NS 20000ull
static inline void wait_for_headroom(Ring *r, uint64_t total) {
    uint64_t ring = r->ring_bytes, nxt = ld_rlx(&r->ctl[W_NEXT_POS]), f;
    if (r->segment || nxt + total - ld_rlx(&r->ctl[W_FIRST_POS]) <= ring) return; /* room without evicting */
    uint64_t want = nxt + total + (ring / 8 < ROOM_HEADROOM ? ring / 8 : ROOM_HEADROOM), t0 = mono_ns();
    while (slot_floor(r, S_POS, &f) && f < nxt && f + ring < want && mono_ns() - t0 < ROOM_WAIT_NS)
        for (int k = 0; k < 64; k++) cpu_relax(); /* poll the consumers' slots sparingly: they store there */
}

/* Write a batch (the GIL held): take the writer lock (up to lock_wait,
 * GIL released while waiting), write_locked, release, ring the readers'
 * doorbell.  The first seq, a status, or ST_PYERR. */
int64_t ring_write_opts(Ring *r, Item *items, Py_ssize_t count, int codec, int64_t max_backlog, double lock_wait,
                        int patient, const WriteOpts *o) {
    if (r->reserved_by || r->callout) {
        unsigned long me = PyThread_get_thread_ident();
        if (r->reserved_by && r->reserved_by->thread == me) {
            PyErr_SetString(PyExc_RuntimeError, "put inside an open reservation of the same spool in the same "
                                                "thread would deadlock: commit or abandon it first");
            return ST_PYERR;
        }
        if (r->callout == me) {
            PyErr_SetString(PyExc_RuntimeError, "put from a fill() or before_commit() of the same spool would "
                                                "deadlock (they run under the writer lock)");
            return ST_PYERR;
        }
    }
    uint64_t stack_needs[64], stack_placed[64];
    uint64_t *needs = stack_needs, *placed = stack_placed;
    if (count > 64) {
        needs = PyMem_Malloc(sizeof(uint64_t) * 2 * (size_t)count);
        if (!needs) {
            PyErr_NoMemory();
            return ST_PYERR;
        }
        placed = needs + count;
    }
    int64_t res;
    uint64_t total = 0;
    for (Py_ssize_t k = 0; k < count; k++) {
        if (items[k].n > r->max_payload) {
            res = ST_TOO_LARGE;
            goto out;
        }
        needs[k] = FRAME_BYTES + ((items[k].n + 7) & ~(uint64_t)7);
        total += needs[k];
    }
    if (total > r->ring_bytes || (max_backlog >= 0 && count > max_backlog)) {
        res = ST_TOO_LARGE;
        goto out;
    }
    if (patient && r->policy == 1) wait_for_headroom(r, total);
    int lk = sem_lock_as(r->wsem, lock_wait, r, &r->ctl[W_LOCK_HOLDER], r->holder); /* holder recorded at once */
    if (lk != 0) {
        res = lk > 0 ? ST_LOCK_STUCK : ST_PYERR;
        goto out;
    }
    res = write_locked(r, items, count, needs, total, codec, max_backlog, placed, o);
    wlock_release(r);
    if (res >= 0) {
        ring_bell(r, r->rsem);
        uint64_t next = ld_rlx(&r->ctl[W_NEXT_POS]);
        populate_ahead(r, next, total);
        prefetch_ahead(r, next);
        /* ... and the commit itself (another writer's since, at worst).  Failing,
         * the batch is published but not known durable: OSError says so. */
        if (o && o->sync && sync_header(r) < 0) res = ST_PYERR;
    }
    ring_finish(r);
out:
    if (needs != stack_needs) PyMem_Free(needs);
    return res;
}

