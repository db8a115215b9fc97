/*
 * shmq/core/read.c: the reader -- one lock-free read loop (read_loop) and
 * the takes built on it: a private cursor's (anonymous, named) and a
 * group's under its lock, with their statistics, commits and page release.
 *
 * Barrier pairs: the acquire load of NEXT_SEQ pairs with the writer's
 * release store (write.c's commit_batch): every byte of a frame below it is
 * visible.  After copying a frame, an acquire fence then FIRST_POS: if the
 * writer's eviction (its FIRST_POS store and release fence, write.c's
 * publish_first) passed the frame, the copy may be torn and is dropped
 * (seqlock).  Named commits store the position before the seq (release
 * both): resync() re-derives a seq whose store a kill cut off.
 *
 * Python-free for a C caller: read_frame (the read loop with the caller's
 * copy functions), first_cursor, and the take statistics (account,
 * flush_locked) on a sane ring; corruption raises SpoolFormatError.
 */
#include "core.h"

/* ---- reading ---- */

/* A consistent (seq, pos) of the oldest frame, read lock-free. */
int first_cursor(Ring *r, uint64_t *oseq, uint64_t *opos) {
    uint64_t *c = r->ctl, ring = r->ring_bytes;
    for (int i = 0; i < 10000; i++) {
        uint64_t seq = ld_acq(&c[W_FIRST_SEQ]); /* seq before pos: the writer stores pos first */
        uint64_t pos = ld_acq(&c[W_FIRST_POS]);
        uint64_t nxt = ld_acq(&c[W_NEXT_SEQ]);
        if (pos >= MAX_COUNTER || nxt >= MAX_COUNTER || seq >= MAX_COUNTER) break; /* would wrap: corrupt */
        if (seq >= nxt) {
            *oseq = seq;
            *opos = pos;
            return 0;
        }
        uint64_t off = pos % ring;
        if (ring - off < FRAME_BYTES) off = 0;
        FrameHeader h;
        read_header(r, off, &h);
        atomic_thread_fence(memory_order_acquire);
        if (header_sane(&h, off, ring) && seq <= h.seq && h.seq < nxt && ld_rlx(&c[W_FIRST_POS]) == pos) {
            *oseq = h.seq;
            *opos = pos;
            return 0;
        }
    }
    corrupt(r, "cannot find the oldest frame (ring corrupt?); " RING_ADVICE);
    return -1;
}

/* The header at the cursor is not frame `seq` (or was evicted): find out why.
 * Adds skipped frames to *lost. */
static int resync(Ring *r, uint64_t *seq, uint64_t *pos, const FrameHeader *h, uint64_t off, uint64_t *lost) {
    uint64_t *c = r->ctl;
    if (*seq < ld_acq(&c[W_FIRST_SEQ]) || *pos < ld_acq(&c[W_FIRST_POS])) {
        uint64_t s, p;
        if (first_cursor(r, &s, &p) < 0) return -1;
        if (s < *seq) {
            corrupt(r, "reader cursor seq %llu is ahead of the oldest frame %llu yet unreadable; " RING_ADVICE,
                    (unsigned long long)*seq, (unsigned long long)s);
            return -1;
        }
        *lost += s - *seq; /* overwritten: jump to the oldest frame, count exactly */
        *seq = s;
        *pos = p;
        return 0;
    }
    if (*seq < h->seq && h->seq < ld_acq(&c[W_NEXT_SEQ]) && header_sane(h, off, r->ring_bytes)) {
        /* A cursor committed with its position but not its seq (process
         * killed between the two stores): the frames in between were read. */
        *seq = h->seq;
        return 0;
    }
    corrupt(r, "corrupt frame header at seq %llu (ring offset %llu: header says seq %llu, %u bytes stored, "
            "%u bytes long); " RING_ADVICE,
            (unsigned long long)*seq, (unsigned long long)off, (unsigned long long)h->seq, h->stored, h->length);
    return -1;
}


/* The read loop: the frame at cursor (seq, pos), lock-free.  copy(ctx, src,
 * h) copies the payload out (returns the copy's bytes, or NULL: an
 * exception); drop(ctx) discards a copy the writer overwrote meanwhile (the
 * seqlock check after the copy).  1: a frame was copied, *hout is its
 * header, the cursor is past it; 0: caught up (the cursor may have moved
 * past pads and overwritten frames, counted in *lost); ST_PYERR: an
 * exception (a corrupt ring, a failed copy; the cursor is unchanged).
 * Python-free on a sane ring when copy and drop are (read_frame). */
ALWAYS_INLINE int read_loop(Ring *r, uint64_t *seqp, uint64_t *posp, int verify, uint64_t *lost, FrameHeader *hout,
                          uint64_t *known, copy_fn copy, drop_fn drop, void *ctx) {
    uint64_t *c = r->ctl, ring = r->ring_bytes;
    uint64_t seq = *seqp, pos = *posp;
    int pads = 0;
    /* Positions and seqs never get near 2**62: larger ones come from a corrupt
     * or hostile cursor, and would wrap. */
    if (seq >= MAX_COUNTER || pos >= MAX_COUNTER) {
        corrupt(r, "reader cursor out of range (seq %llu, position %llu); reset it with "
                "'shmq readers seek'", (unsigned long long)seq, (unsigned long long)pos);
        return ST_PYERR;
    }
    for (long spins = 0;; spins++) {
        if (spins > 1000000) { /* resyncs and pads always make progress on a sane ring */
            corrupt(r, "cannot read at seq %llu (the ring does not converge); " RING_ADVICE, (unsigned long long)seq);
            return ST_PYERR;
        }
        /* `known`: a NEXT_SEQ this reader loaded (acquire) before, so every
         * frame below it is committed and its bytes visible.  Loading the
         * word only past it spares a reader that is behind one transfer per
         * frame of the control line the writer stores to on every put. */
        if (!known || seq >= *known) {
            uint64_t next = ld_acq(&c[W_NEXT_SEQ]);
            if (known) *known = next;
            if (seq >= next) {
                *seqp = seq;
                *posp = pos;
                return 0;
            }
        }
        uint64_t off = pos % ring;
        if (ring - off < FRAME_BYTES) {
            pos += ring - off;
            off = 0;
        }
        FrameHeader h;
        read_header(r, off, &h);
        if (h.seq != seq || !header_sane(&h, off, ring)) {
            atomic_thread_fence(memory_order_acquire);
            if (resync(r, &seq, &pos, &h, off, lost) < 0) return ST_PYERR;
            continue;
        }
        if (h.flags & FLAG_PAD) {
            atomic_thread_fence(memory_order_acquire);
            if (ld_rlx(&c[W_FIRST_POS]) > pos) { /* the pad itself was overwritten */
                if (resync(r, &seq, &pos, &h, off, lost) < 0) return ST_PYERR;
            } else {
                if (++pads > 2 || off == 0) { /* a pad never starts the ring, never repeats */
                    corrupt(r, "corrupt padding at seq %llu (ring offset %llu); " RING_ADVICE,
                            (unsigned long long)seq, (unsigned long long)off);
                    return ST_PYERR;
                }
                pos += h.stored;
            }
            continue;
        }
        const char *copied = copy(ctx, r->ring + off + FRAME_BYTES, &h);
        if (!copied) return ST_PYERR;
        atomic_thread_fence(memory_order_acquire); /* the copy happens before the re-check */
        if (ld_rlx(&c[W_FIRST_POS]) > pos) {          /* overwritten while we copied */
            drop(ctx);
            if (resync(r, &seq, &pos, &h, off, lost) < 0) return ST_PYERR;
            continue;
        }
        if (verify && (h.flags & FLAG_CRC) && crc_update(0, (const unsigned char *)copied, h.length) != h.crc) {
            drop(ctx);
            corrupt(r, "frame %llu fails its CRC check (memory corruption?); " RING_ADVICE, (unsigned long long)seq);
            return ST_PYERR;
        }
        *seqp = seq + 1;
        *posp = pos + h.stored;
        *hout = h;
        return 1;
    }
}

/* read_loop for a C caller (the TSan harness), out of line. */
int read_frame(Ring *r, uint64_t *seqp, uint64_t *posp, int verify, uint64_t *lost, FrameHeader *hout,
               uint64_t *known, copy_fn copy, drop_fn drop, void *ctx) {
    return read_loop(r, seqp, posp, verify, lost, hout, known, copy, drop, ctx);
}

/* The payload as a new bytes object (a bytearray for numpy and out-of-band
 * pickle frames: arrays rebuilt over it are writable), in *(PyObject **)ctx. */
static const char *copy_py(void *ctx, const char *src, const FrameHeader *h) {
    PyObject **out = ctx;
    if (h->codec == CODEC_PICKLE_OOB || h->codec == CODEC_NUMPY) {
        if (!(*out = PyByteArray_FromStringAndSize(src, h->length))) return NULL;
        return PyByteArray_AS_STRING(*out);
    }
    if (!(*out = PyBytes_FromStringAndSize(src, h->length))) return NULL;
    return PyBytes_AS_STRING(*out);
}

static void drop_py(void *ctx) { Py_CLEAR(*(PyObject **)ctx); }

/* Read the frame at cursor (seq, pos), lock-free.  Returns a new Frame (the
 * payload alone if `raw`), RD_NONE, or NULL with an exception set.
 * Advances the cursor and adds overwritten frames to *lost. */
PyObject *read_one(Ring *r, uint64_t *seqp, uint64_t *posp, int verify, uint64_t *lost, FrameHeader *hout, int raw,
                   uint64_t *known) {
    PyObject *data = NULL;
    FrameHeader h;
    int got = read_loop(r, seqp, posp, verify, lost, &h, known, copy_py, drop_py, &data);
    if (got < 0) return NULL;
    if (!got) return RD_NONE;
    if (hout) *hout = h;
    return raw ? data : make_frame(r->st, h.seq, h.ts, data, h.codec);
}

/* Close the group semaphore once no thread waits on it any more. */
void cursor_finish(Cursor *c) {
    if (c->closed_msg && !c->busy && c->gsem) {
        sem_close(c->gsem);
        c->gsem = NULL;
    }
}

/* Take the group lock like sem_lock; a close() of the reader or of its spool by
 * another thread meanwhile is deferred until we are out, then we give the lock
 * back and raise ValueError: nothing is touched after the handle is gone. */
int group_lock(Cursor *c, double wait, uint64_t *word, uint64_t holder) {
    Ring *r = c->ring;
    c->busy++;
    r->busy++;
    int lk = sem_lock_as(c->gsem, wait, NULL, word, holder); /* `word` (or NULL) recorded at once */
    c->busy--;
    r->busy--;
    if (c->closed_msg || r->closing) {
        if (lk == 0 && word) st_rlx(word, 0);
        if (lk == 0) sem_post(c->gsem);
        int closed_reader = c->closed_msg != NULL;
        cursor_finish(c);
        ring_finish(r);
        if (lk >= 0) {
            if (closed_reader)
                PyErr_SetObject(PyExc_ValueError, c->closed_msg);
            else
                PyErr_SetString(PyExc_ValueError, "spool handle was closed by another thread");
        }
        return -1;
    }
    return lk;
}

/* ---- releasing pages behind a reader ----
 * Every tmpfs page a reader touched would stay mapped: reading 1 GiB through a
 * 1 GiB spool would grow its RSS by 1 GiB.  On a MAP_SHARED mapping
 * MADV_DONTNEED only drops this process's page-table entries: the data stays
 * in the shared file for the writer and every other reader, and a later access
 * here (a reader behind this one in the same process, a pinned zero-copy view)
 * faults the same page back in.  So releasing never changes what anyone reads,
 * it only costs a minor fault if the page is touched again: it is done once per
 * RELEASE_CHUNK of progress, and only on rings large enough for it to matter. */
#define RELEASE_CHUNK ((uint64_t)4 << 20)
/* Rings (and growable zones) of at most KEEP_WHOLE bytes stay mapped: their
 * reader's RSS is bounded by their size anyway, and releasing a lap behind
 * the reader makes it refault every page each lap (1 MiB frames through a
 * 64 MiB ring: 6.1 GB/s released, 10.7 GB/s kept; through a 16 MiB ring a
 * third of the speed).  On larger rings the last KEEP_BEHIND bytes behind
 * the cursor stay mapped, so a reader's RSS stays under about KEEP_WHOLE
 * whatever it reads. */
#define KEEP_WHOLE ((uint64_t)64 << 20)
#define KEEP_BEHIND ((uint64_t)32 << 20)

void release_behind(Ring *r, uint64_t *released, uint64_t pos) {
    uint64_t ring = r->ring_bytes;
    if (!r->ring || ring <= KEEP_WHOLE) return; /* closed: the mapping is gone, never advise */
    if (pos < *released) { /* moved back (a seek): nothing behind it is ours to count yet */
        *released = pos;
        return;
    }
    if (pos - *released < KEEP_BEHIND + RELEASE_CHUNK) return;
    /* Only now the shared ALLOC word: it sits on the control line the writer
     * stores to on every put, and a load per get would bounce that line
     * between the two cores (a fifth of a growable ring's 100 B throughput). */
    if (r->segment && ld_rlx(&r->ctl[W_ALLOC]) <= KEEP_WHOLE) { /* a small hot zone: all of it stays */
        *released = pos; /* ... and the next look is RELEASE_CHUNK on, not at every get */
        return;
    }
    uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE); /* (once per RELEASE_CHUNK of progress) */
    uint64_t start = *released, end = (pos - KEEP_BEHIND) & ~(page - 1);
    if (end - start > ring) start = end - ring;            /* jumped (loss, seek): the whole ring */
    start &= ~(page - 1);
    *released = end;
    uint64_t len = end - start, off = start % ring, first = len < ring - off ? len : ring - off;
    /* errors (EINVAL where pages are larger than the ring's alignment) only cost memory */
    (void)madvise(r->ring + off, (size_t)first, MADV_DONTNEED);
    if (len > first) (void)madvise(r->ring, (size_t)(len - first), MADV_DONTNEED);
}

static void count_read_rate(Ring *r, uint64_t n, uint64_t now) {
    /* Unlocked read-modify-write: concurrent readers may lose an update
     * (documented as approximate); the per-reader counters are exact. */
    uint64_t sec = now / 1000000000ull;
    int b = W_RATE + (int)(sec % RATE_SECONDS) * RATE_WORDS;
    if (ld_rlx(&r->ctl[b]) != sec) {
        st_rlx(&r->ctl[b], sec);
        st_rlx(&r->ctl[b + 1], 0);
        st_rlx(&r->ctl[b + 2], 0);
    }
    st_rlx(&r->ctl[b + 2], ld_rlx(&r->ctl[b + 2]) + n);
}

/* Publish accumulated counters to the slot (named: exclusive; group: lock held). */
void flush_locked(Cursor *c) {
    if (c->slot < 0 || !(c->n || c->lost_pending)) return;
    uint64_t *s = cur_slot(c), now = now_ns();
    st_rlx(&s[S_GETS], ld_rlx(&s[S_GETS]) + c->n);
    st_rlx(&s[S_GET_BYTES], ld_rlx(&s[S_GET_BYTES]) + c->bytes);
    st_rlx(&s[S_DELAY_SUM_NS], ld_rlx(&s[S_DELAY_SUM_NS]) + c->dsum);
    st_rlx(&s[S_DELAY_COUNT], ld_rlx(&s[S_DELAY_COUNT]) + c->dcount);
    if (c->dmax > ld_rlx(&s[S_DELAY_MAX_NS])) st_rlx(&s[S_DELAY_MAX_NS], c->dmax);
    if (c->kind == K_NAMED) st_rlx(&s[S_LOST], ld_rlx(&s[S_LOST]) + c->lost_pending);
    if (c->n) {
        st_rlx(&s[S_LAST_GET_NS], now);
        if (c->lag_peak > ld_rlx(&s[S_LAG_HIGH])) st_rlx(&s[S_LAG_HIGH], c->lag_peak);
    }
    uint64_t nxt = ld_rlx(&c->ring->ctl[W_NEXT_SEQ]);
    uint64_t cur = c->kind == K_GROUP ? ld_rlx(&s[S_SEQ]) : c->seq;
    uint64_t lag = nxt > cur ? nxt - cur : 0;
    if (lag < ld_rlx(&s[S_LAG_LOW])) st_rlx(&s[S_LAG_LOW], lag);
    count_read_rate(c->ring, c->n, now);
    c->n = c->bytes = c->dsum = c->dmax = c->dcount = c->lost_pending = 0;
}

/* The put-to-get delay needs a clock read (a vDSO clock_gettime, ~20 ns on
 * this VM: 3-5% of a Queue.get of a small dict).  A take of several frames
 * reads it once for all of them; a single get reads it on one get in
 * DELAY_SAMPLE_EVERY, chosen at random (xorshift) so that no periodic
 * pattern of the producer lines up with the samples.  Statistics divide the
 * delay sum by the measured count (S_DELAY_COUNT), not by the gets. */
#define DELAY_SAMPLE_EVERY 8
static inline uint64_t delay_clock(Cursor *c, Py_ssize_t max) {
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
static inline void account(Cursor *c, const FrameHeader *h, uint64_t now) {
    uint64_t seq = h->seq, ts = h->ts;
    if (!c->n) {
        uint64_t nxt = ld_rlx(&c->ring->ctl[W_NEXT_SEQ]);
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

int cursor_check(Cursor *c) {
    if (c->closed_msg) {
        PyErr_SetObject(PyExc_ValueError, c->closed_msg);
        return -1;
    }
    return ring_check_open(c->ring);
}

void named_commit(Cursor *c) {
    uint64_t *s = cur_slot(c);
    st_rel(&s[S_POS], c->pos); /* position first: see resync */
    st_rel(&s[S_SEQ], c->seq);
}

static PyObject *obj_entry(Cursor *c, PyObject *data, const FrameHeader *h, Codes *codes, Py_ssize_t i) {
    if (i >= codes->cap) {
        Py_ssize_t cap = codes->cap ? codes->cap * 2 : 128;
        uint8_t *v = PyMem_Realloc(codes->v, (size_t)cap);
        if (!v) {
            Py_DECREF(data);
            return PyErr_NoMemory();
        }
        codes->v = v;
        codes->cap = cap;
    }
    if (h->codec == 0 || (h->codec == 1 && codes->unpickle && c->ring->st->pickle_loads)) {
        codes->v[i] = h->codec;
        return data;
    }
    codes->v[i] = CODE_FRAME;
    return make_frame(c->ring->st, h->seq, h->ts, data, h->codec);
}

/* The take loop over cursor (seq, pos): up to max frames through the read
 * loop into sink k, each counted in the reader's statistics when `count`
 * (named readers and groups; account).  The frames taken, or ST_PYERR;
 * *lost gets the frames skipped.  Python-free when k is. */
ALWAYS_INLINE Py_ssize_t take_loop(Cursor *c, uint64_t *seq, uint64_t *pos, Py_ssize_t max, int count,
                                   uint64_t *lost, const Sink *k) {
    uint64_t now = 0;
    int clocked = 0;
    Py_ssize_t got = 0;
    while (got < max) {
        FrameHeader h;
        int rc = read_loop(c->ring, seq, pos, c->verify, lost, &h, &c->known, k->copy, k->drop, k->ctx);
        if (rc < 0) return ST_PYERR;
        if (!rc) break;
        if (count) {
            if (!clocked) {
                now = delay_clock(c, max);
                clocked = 1;
            }
            account(c, &h, now);
        }
        got++;
        if (k->taken(k->ctx, &h) < 0) return ST_PYERR;
    }
    return got;
}

/* Up to max frames from a private cursor (anonymous / named) into sink k:
 * the take, the loss count, page release, a named reader's auto-commit,
 * statistics flush and space doorbell.  The frames taken, or ST_PYERR.
 * Python-free when k is. */
ALWAYS_INLINE Py_ssize_t private_take_in(Cursor *c, Py_ssize_t max, const Sink *k) {
    Ring *r = c->ring;
    uint64_t lost = 0;
    Py_ssize_t got = take_loop(c, &c->seq, &c->pos, max, c->kind == K_NAMED, &lost, k);
    if (got < 0) return got;
    if (lost) {
        c->lost += lost;
        c->lost_pending += lost;
    }
    if (got || lost) release_behind(r, &c->released, c->pos);
    if (c->kind == K_NAMED && (got || lost)) {
        if (c->autocommit) named_commit(c);
        if (c->n >= STATS_FLUSH_FRAMES || (lost && !got)) flush_locked(c);
        if (c->autocommit && r->policy != 0) ring_bell(r, r->fsem);
    }
    return got;
}

/* Up to max frames from a group's shared cursor (its slot's S_SEQ / S_POS)
 * into sink k, the group lock held by the caller: the take, then the cursor
 * stored back (position first, see resync), lost frames and statistics.
 * *pos_out: the cursor's position after (for release_behind, outside the
 * lock).  The frames taken, or ST_PYERR (nothing stored).  Python-free when
 * k is. */
ALWAYS_INLINE Py_ssize_t group_take_in(Cursor *c, Py_ssize_t max, const Sink *k, uint64_t *pos_out,
                                       uint64_t *lost_out) {
    uint64_t *s = cur_slot(c);
    uint64_t seq = ld_rlx(&s[S_SEQ]), pos = ld_rlx(&s[S_POS]), lost = 0;
    Py_ssize_t got = take_loop(c, &seq, &pos, max, 1, &lost, k);
    *pos_out = pos;
    *lost_out = lost;
    if (got < 0) return got;
    if (got || lost) {
        st_rel(&s[S_POS], pos); /* position first: see resync */
        st_rel(&s[S_SEQ], seq);
        if (lost) st_rlx(&s[S_LOST], ld_rlx(&s[S_LOST]) + lost);
        if (c->n >= STATS_FLUSH_FRAMES) flush_locked(c);
    }
    return got;
}

/* The two takes for a C caller, out of line; the Python takes below inline
 * them with their sink's functions known (no indirect call per frame). */
Py_ssize_t private_take_frames(Cursor *c, Py_ssize_t max, const Sink *k) { return private_take_in(c, max, k); }

Py_ssize_t group_take_locked(Cursor *c, Py_ssize_t max, const Sink *k, uint64_t *pos_out, uint64_t *lost_out) {
    return group_take_in(c, max, k, pos_out, lost_out);
}

/* The Python sink of the takes: each frame a bytes (a Frame unless raw), a
 * list entry (as_list) or the single result. */
typedef struct {
    PyObject *data; /* first: copy_py and drop_py use it */
    Cursor *c;
    PyObject *out, *single;
    FrameHeader *rawh;
    Codes *codes;
    int raw;
    Py_ssize_t i;
} PySink;

static int taken_py(void *ctx, const FrameHeader *h) {
    PySink *k = ctx;
    PyObject *f = k->data;
    k->data = NULL;
    if (!k->raw && !(f = make_frame(k->c->ring->st, h->seq, h->ts, f, h->codec))) return -1;
    if (k->codes && !(f = obj_entry(k->c, f, h, k->codes, k->i))) return -1;
    k->i++;
    if (k->out) {
        int rc = PyList_Append(k->out, f);
        Py_DECREF(f);
        return rc;
    }
    Py_XSETREF(k->single, f);
    if (k->rawh) *k->rawh = *h;
    return 0;
}

/* The result of a take into a PySink: the list, the frame, None; NULL if `got` < 0. */
static PyObject *take_result(PySink *k, Py_ssize_t got) {
    Py_CLEAR(k->data);
    if (got < 0) {
        Py_XDECREF(k->out);
        Py_XDECREF(k->single);
        return NULL;
    }
    if (k->out) return k->out;
    if (k->single) return k->single;
    Py_RETURN_NONE;
}

/* Read up to max frames from a private cursor (anonymous / named). */
static PyObject *private_take(Cursor *c, Py_ssize_t max, int as_list, FrameHeader *rawh, Codes *codes) {
    PySink k = {NULL, c, NULL, NULL, rawh, codes, rawh || codes, 0};
    if (as_list && !(k.out = PyList_New(0))) return NULL;
    Sink sink = {copy_py, drop_py, taken_py, &k};
    return take_result(&k, private_take_in(c, max, &sink));
}

/* Take up to max frames from the group's shared cursor under its lock. */
static PyObject *group_take(Cursor *c, Py_ssize_t max, int as_list, double lock_wait, FrameHeader *rawh,
                            Codes *codes) {
    Ring *r = c->ring;
    PySink k = {NULL, c, NULL, NULL, rawh, codes, rawh || codes, 0};
    if (as_list && !(k.out = PyList_New(0))) return NULL;
    uint64_t *s = cur_slot(c), pos, lost;
    int lk = group_lock(c, lock_wait, &s[S_LOCK_HOLDER], r->holder);
    if (lk != 0) {
        Py_XDECREF(k.out);
        return lk < 0 ? NULL : PyLong_FromLong(ST_LOCK_STUCK);
    }
    Sink sink = {copy_py, drop_py, taken_py, &k};
    Py_ssize_t got = group_take_in(c, max, &sink, &pos, &lost);
    st_rlx(&s[S_LOCK_HOLDER], 0);
    sem_post(c->gsem);
    if (got > 0 || (got == 0 && lost)) release_behind(r, &c->released, pos);
    if (got > 0 && r->policy != 0) ring_bell(r, r->fsem); /* outside the lock: wake writers waiting for room */
    return take_result(&k, got);
}

/* Up to max frames from any cursor: the group take under the group lock
 * (waiting up to lock_wait for it), else the private take.  See those two
 * for as_list, rawh and codes. */
PyObject *cursor_take(Cursor *c, Py_ssize_t max, int as_list, double lock_wait, FrameHeader *rawh,
                             Codes *codes) {
    return c->kind == K_GROUP ? group_take(c, max, as_list, lock_wait, rawh, codes)
                              : private_take(c, max, as_list, rawh, codes);
}

