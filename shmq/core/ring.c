/*
 * shmq/core/ring.c: the Ring type -- one spool mapping: its geometry and
 * semaphores, open and close (deferred while another thread waits with
 * the GIL released), and the methods Python's slow paths call (read,
 * locate, latest, trim, doorbells).  The put entry points live in api.c,
 * the writer in write.c, the reader in read.c.
 */
#include "core.h"

/* After a GIL-released wait on `s`: if the handle was closed meanwhile, give
 * back what we took (`held`: the semaphore was acquired), finish the deferred
 * close and raise.  1: closed (exception set); 0: carry on. */
int ring_closed_meanwhile(Ring *r, int held, sem_t *s) {
    if (!r->closing) return 0;
    if (held) sem_post(s);
    ring_finish(r);
    PyErr_SetString(PyExc_ValueError, "spool handle was closed by another thread");
    return 1;
}

/* Raise SpoolFormatError "<path>: <message>"; returns NULL. */
PyObject *corrupt(Ring *r, const char *fmt, ...) {
    char msg[400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    PyObject *err = r->st && r->st->SpoolFormatError ? r->st->SpoolFormatError : PyExc_RuntimeError;
    PyErr_Format(err, "%U: %s", r->path, msg);
    return NULL;
}

static PyObject *Ring_trim_due(Ring *r, PyObject *unused) {
    if (ring_check_open(r) < 0) return NULL;
    return PyBool_FromLong(trim_due(r));
}

/* The optional (codec, max_backlog, lock_wait) arguments of put / put_many. */
static int parse_put_args(Ring *r, PyObject *const *args, Py_ssize_t nargs, int *codec, long long *backlog,
                          double *wait) {
    if (ring_check_open(r) < 0) return -1;
    *codec = 0;
    *backlog = -1;
    *wait = r->lock_wait;
    if (nargs > 1 && (*codec = (int)PyLong_AsLong(args[1])) == -1 && PyErr_Occurred()) return -1;
    if (nargs > 2 && (*backlog = PyLong_AsLongLong(args[2])) == -1 && PyErr_Occurred()) return -1;
    if (nargs > 3 && args[3] != Py_None && (*wait = PyFloat_AsDouble(args[3])) == -1 && PyErr_Occurred()) return -1;
    return 0;
}

static PyObject *Ring_put(Ring *r, PyObject *const *args, Py_ssize_t nargs) {
    /* put(data, codec=0, max_backlog=-1, lock_wait=default) -> seq or status */
    if (nargs < 1 || nargs > 4) {
        PyErr_SetString(PyExc_TypeError, "put(data, codec=0, max_backlog=-1, lock_wait=None)");
        return NULL;
    }
    int codec;
    long long backlog;
    double wait;
    if (parse_put_args(r, args, nargs, &codec, &backlog, &wait) < 0) return NULL;
    Item item;
    if (load_item(&item, args[0], r->checksum) < 0) return NULL;
    int64_t res = ring_write(r, &item, 1, codec, backlog, wait, 0);
    release_items(&item, 1);
    if (res == ST_PYERR) return NULL;
    return PyLong_FromLongLong(res);
}

static PyObject *Ring_put_many(Ring *r, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    /* put_many(items, codec=0, max_backlog=-1, lock_wait=default, *, before_commit=None,
     * timestamps=None, sync=False) -> first seq or status.  Items are bytes-likes,
     * tuples of them, or Deferred payloads; the keywords are parsed only when given. */
    if (nargs < 1 || nargs > 4) {
        PyErr_SetString(PyExc_TypeError, "put_many(items, codec=0, max_backlog=-1, lock_wait=None, *, "
                                         "before_commit=None, timestamps=None, sync=False)");
        return NULL;
    }
    int codec;
    long long backlog;
    double wait;
    if (parse_put_args(r, args, nargs, &codec, &backlog, &wait) < 0) return NULL;
    PyObject *seq = PySequence_Fast(args[0], "put_many() needs a sequence of bytes-like objects");
    if (!seq) return NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    if (count == 0) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "put_many() needs at least one item");
        return NULL;
    }
    WriteOpts opts = {NULL, NULL, 0, 0};
    if (kwnames && parse_write_opts(r, args + nargs, kwnames, count, &opts) < 0) {
        Py_DECREF(seq);
        return NULL;
    }
    if (count > MAX_BATCH) {
        free_write_opts(&opts);
        Py_DECREF(seq);
        return PyLong_FromLong(ST_TOO_LARGE);
    }
    Item *items = PyMem_Malloc(sizeof(Item) * (size_t)count);
    if (!items) {
        free_write_opts(&opts);
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    shmq_fast_items objs = SHMQ_FAST_ITEMS(seq);
    Py_ssize_t k;
    for (k = 0; k < count; k++) {
        if (load_item(&items[k], SHMQ_FAST_AT(objs, k), r->checksum) < 0) {
            /* a Deferred is no buffer: recognized only here, off the plain path */
            int d = PyErr_ExceptionMatches(PyExc_TypeError) ? load_deferred(r, &items[k], SHMQ_FAST_AT(objs, k)) : 0;
            if (d > 0) {
                PyErr_Clear();
                opts.deferred = 1;
                continue;
            }
            release_items(items, k);
            PyMem_Free(items);
            free_write_opts(&opts);
            Py_DECREF(seq);
            return NULL;
        }
    }
    const WriteOpts *o = opts.before_commit || opts.timestamps || opts.sync || opts.deferred ? &opts : NULL;
    int64_t res = ring_write_opts(r, items, count, codec, backlog, wait, 0, o);
    release_items(items, count);
    PyMem_Free(items);
    free_write_opts(&opts);
    Py_DECREF(seq);
    if (res == ST_PYERR) return NULL;
    return PyLong_FromLongLong(res);
}

/* ---- Ring methods used by Python's slow paths ---- */

static PyObject *Ring_read(Ring *r, PyObject *args) {
    /* read(seq, pos, verify=False) -> (frame|None, seq, pos, lost, codec) */
    unsigned long long seq, pos;
    int verify = 0;
    if (!PyArg_ParseTuple(args, "KK|p", &seq, &pos, &verify)) return NULL;
    if (ring_check_open(r) < 0) return NULL;
    uint64_t s = seq, p = pos, lost = 0;
    PyObject *f = read_one(r, &s, &p, verify, &lost, NULL, 0, NULL);
    if (!f) return NULL;
    if (f == RD_NONE) return Py_BuildValue("(OKKKi)", Py_None, s, p, lost, 0);
    PyObject *codec = PyStructSequence_GET_ITEM(f, 3);
    return Py_BuildValue("(NKKKO)", f, s, p, lost, codec);
}

static PyObject *Ring_locate(Ring *r, PyObject *args) {
    /* locate(seq, hint_seq, hint_pos) -> header position of frame seq;
     * -1: already overwritten; -2: the ring was rewritten under every attempt.
     * Walks headers lock-free from the oldest frame (or the hint). */
    unsigned long long want, hseq, hpos;
    if (!PyArg_ParseTuple(args, "KKK", &want, &hseq, &hpos)) return NULL;
    if (ring_check_open(r) < 0) return NULL;
    uint64_t *c = r->ctl, ring = r->ring_bytes;
    for (int attempt = 0; attempt < 100; attempt++) {
        uint64_t s, p;
        if (first_cursor(r, &s, &p) < 0) return NULL;
        if (want < s) return PyLong_FromLong(-1);
        if (s <= hseq && hseq <= want && hpos >= p) {
            s = hseq;
            p = hpos;
        }
        uint64_t limit = ld_acq(&c[W_NEXT_POS]) + ring; /* a sane walk never gets this far */
        int pads = 0;
        for (;;) {
            uint64_t off = p % ring;
            if (ring - off < FRAME_BYTES) {
                p += ring - off;
                off = 0;
            }
            FrameHeader h;
            read_header(r, off, &h);
            atomic_thread_fence(memory_order_acquire);
            if (ld_rlx(&c[W_FIRST_POS]) > p) break; /* overtaken by the writer: start again */
            if (h.seq != s || !header_sane(&h, off, ring) || p > limit)
                return corrupt(r, "ring is corrupt near seq %llu; " RING_ADVICE, (unsigned long long)s);
            if (h.flags & FLAG_PAD) {
                if (off == 0 || ++pads > 2)
                    return corrupt(r, "corrupt padding near seq %llu", (unsigned long long)s);
                p += h.stored;
                continue;
            }
            pads = 0;
            if (s == want) return PyLong_FromUnsignedLongLong(p);
            s++;
            p += h.stored;
        }
    }
    return PyLong_FromLong(-2);
}

static PyObject *Ring_first_cursor(Ring *r, PyObject *unused) {
    if (ring_check_open(r) < 0) return NULL;
    uint64_t s, p;
    if (first_cursor(r, &s, &p) < 0) return NULL;
    return Py_BuildValue("(KK)", s, p);
}

static PyObject *Ring_latest(Ring *r, PyObject *args) {
    /* latest(lock_wait) -> (NEXT_SEQ, NEXT_POS) as a consistent pair, or None if the lock is stuck */
    double wait = r->lock_wait;
    if (!PyArg_ParseTuple(args, "|d", &wait)) return NULL;
    if (ring_check_open(r) < 0) return NULL;
    int lk = sem_lock_on(r->wsem, wait, r);
    if (lk < 0) return NULL;
    if (lk > 0) Py_RETURN_NONE;
    uint64_t s = ld_rlx(&r->ctl[W_NEXT_SEQ]), p = ld_rlx(&r->ctl[W_NEXT_POS]);
    sem_post(r->wsem);
    return Py_BuildValue("(KK)", s, p);
}

static PyObject *Ring_ring_space(Ring *r, PyObject *unused) {
    if (ring_check_open(r) < 0) return NULL;
    ring_bell(r, r->fsem);
    Py_RETURN_NONE;
}

static PyObject *Ring_ring_data(Ring *r, PyObject *unused) {
    if (ring_check_open(r) < 0) return NULL;
    ring_bell(r, r->rsem);
    Py_RETURN_NONE;
}

/* bell_seen(space) -> the doorbell word's value; read it after registering
 * as a waiter and before re-checking, then pass it to bell_wait. */
static PyObject *Ring_bell_seen(Ring *r, PyObject *space) {
    if (ring_check_open(r) < 0) return NULL;
    int sp = PyObject_IsTrue(space);
    if (sp < 0) return NULL;
    int word = sp ? W_SPACE_BELL : W_DATA_BELL;
    return PyLong_FromUnsignedLong(atomic_load_explicit(bell_word(r, word), memory_order_acquire));
}

/* bell_wait(space, seen, timeout): sleep, GIL released, until the doorbell
 * word is no longer `seen` (someone rang), a signal arrives or `timeout`
 * seconds pass.  Any return means "re-check"; a signal handler's exception
 * propagates (nothing is held here).  The futex is a shared one (keyed by
 * the file's page), so rings from any process wake it. */
static PyObject *Ring_bell_wait(Ring *r, PyObject *args) {
    int space;
    unsigned long seen;
    double timeout;
    if (!PyArg_ParseTuple(args, "pkd", &space, &seen, &timeout)) return NULL;
    if (ring_check_open(r) < 0) return NULL;
    if (timeout <= 0) Py_RETURN_NONE;
    if (timeout > 3600) timeout = 3600;
    struct timespec ts = {(time_t)timeout, (long)((timeout - (double)(time_t)timeout) * 1e9)};
    _Atomic uint32_t *w = bell_word(r, space ? W_SPACE_BELL : W_DATA_BELL);
    r->busy++;
    Py_BEGIN_ALLOW_THREADS
    syscall(SYS_futex, w, FUTEX_WAIT, (uint32_t)seen, &ts, NULL, 0); /* any return means re-check */
    Py_END_ALLOW_THREADS
    r->busy--;
    if (ring_closed_meanwhile(r, 0, NULL)) return NULL;
    if (PyErr_CheckSignals() < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *Ring_set_fd(Ring *r, PyObject *args) {
    unsigned long long holder;
    int fd;
    if (!PyArg_ParseTuple(args, "iK", &fd, &holder)) return NULL;
    int mine = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (mine < 0) return PyErr_SetFromErrno(PyExc_OSError);
    if (r->fd_owned) close(r->fd);
    r->fd = mine;
    r->fd_owned = 1;
    r->holder = holder;
    Py_RETURN_NONE;
}

static PyObject *Ring_trim(Ring *r, PyObject *args) {
    /* trim(lock_wait) -> True, or None if the writer lock was not free within
     * lock_wait: a growable ring with nothing resident (after evicting what every
     * named reader and group consumed) keeps only the writer's current segment
     * and the start allocation (below ALLOC_MIN). */
    double wait = 0;
    if (!PyArg_ParseTuple(args, "|d", &wait)) return NULL;
    if (ring_check_open(r) < 0) return NULL;
    if (!r->segment) Py_RETURN_TRUE;
    int lk = sem_lock_as(r->wsem, wait, r, &r->ctl[W_LOCK_HOLDER], r->holder); /* holder recorded at once */
    if (lk < 0) return NULL;
    if (lk > 0) Py_RETURN_NONE;
    int rc = trim_locked(r);
    wlock_release(r);
    ring_finish(r);
    if (rc == ST_PYERR) return NULL;
    ring_bell(r, r->fsem);
    Py_RETURN_TRUE;
}

static PyObject *Ring_full_marker(Ring *r, PyObject *unused) {
    return Py_BuildValue("(KK)", r->full_floor, r->full_pin);
}

/* The room marker now (no lock: each word is one atomic load), computed as
 * take_full_marker computes full_marker()'s, so a waiter compares like with
 * like; the handle's recorded marker is left alone. */
static PyObject *Ring_room_marker(Ring *r, PyObject *unused) {
    if (ring_check_open(r) < 0) return NULL;
    uint64_t f;
    if (!slot_floor(r, S_POS, &f)) f = ld_rlx(&r->ctl[W_FIRST_POS]);
    return Py_BuildValue("(KK)", f, pin_floor(r));
}

void ring_release(Ring *r) {
    if (r->busy) { /* another thread is in fallocate or a lock wait on this handle */
        r->closing = 1;
        return;
    }
    if (r->fd_owned) {
        close(r->fd); /* our own duplicate: never reused under a concurrent fallocate */
        r->fd_owned = 0;
        r->fd = -1;
    }
    if (r->reserved_by) { /* closing with a reservation open: abandon it (release the lock) */
        r->reserved_by->open = 0;
        if (r->have_buf && r->wsem) wlock_release(r);
        r->reserved_by = NULL;
    }
    if (r->have_buf) {
        PyBuffer_Release(&r->buf);
        r->have_buf = 0;
    }
    if (r->wsem) sem_close(r->wsem);
    if (r->rsem) sem_close(r->rsem);
    if (r->fsem) sem_close(r->fsem);
    r->wsem = r->rsem = r->fsem = NULL;
    r->base = r->ring = NULL;
    r->ctl = r->slots = NULL;
}

static PyObject *Ring_close(Ring *r, PyObject *unused) {
    ring_release(r);
    Py_RETURN_NONE;
}

sem_t *open_sem(const char *name) {
    sem_t *s = sem_open(name, 0);
    if (s == SEM_FAILED) {
        PyErr_SetFromErrnoWithFilename(PyExc_OSError, name);
        return NULL;
    }
    return s;
}

static int Ring_init(Ring *r, PyObject *args, PyObject *kw) {
    /* Ring(mm, path, ring_offset, ring_bytes, slot_offset, slot_count, policy, checksum,
            writer_sem, read_waiters_sem, space_waiters_sem, fd, holder, lock_wait) */
    PyObject *mm, *path;
    unsigned long long ring_offset, ring_bytes, slot_offset, slot_count, holder;
    int policy, checksum, fd;
    const char *wname, *rname, *fname;
    double lock_wait;
    if (!PyArg_ParseTuple(args, "OUKKKKipsssiKd", &mm, &path, &ring_offset, &ring_bytes, &slot_offset, &slot_count,
                          &policy, &checksum, &wname, &rname, &fname, &fd, &holder, &lock_wait))
        return -1;
    ring_release(r);
    r->st = PyType_GetModuleState(Py_TYPE((PyObject *)r));
    if (!r->st) return -1;
    if (PyObject_GetBuffer(mm, &r->buf, PyBUF_WRITABLE) < 0) return -1;
    r->have_buf = 1;
    if (ring_bytes < 4096 || ring_bytes % 4096 || ring_offset % 4096 || ring_offset < HEADER_BYTES ||
        slot_offset < HEADER_BYTES || slot_offset + slot_count * SLOT_BYTES > ring_offset ||
        (uint64_t)r->buf.len < ring_offset + ring_bytes || policy < 0 || policy > 2 ||
        ((uint64_t *)r->buf.buf)[W_SEGMENT] % 4096 || ((uint64_t *)r->buf.buf)[W_SEGMENT] > ring_bytes) {
        ring_release(r);
        PyErr_SetString(PyExc_ValueError, "inconsistent ring geometry");
        return -1;
    }
    Py_XSETREF(r->path, Py_NewRef(path));
    r->base = r->buf.buf;
    r->ctl = (uint64_t *)r->base;
    r->slots = (uint64_t *)(r->base + slot_offset);
    r->ring = r->base + ring_offset;
    r->ring_bytes = ring_bytes;
    r->ring_offset = ring_offset;
    r->segment = ld_rlx(&r->ctl[W_SEGMENT]);
    r->slot_count = slot_count;
    r->max_payload = ring_bytes - FRAME_BYTES;
    if (r->max_payload > 0xFFFFFFFFull - FRAME_BYTES - ALIGN) r->max_payload = 0xFFFFFFFFull - FRAME_BYTES - ALIGN;
    r->policy = policy;
    r->checksum = checksum;
    r->fd = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (r->fd < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        ring_release(r);
        return -1;
    }
    r->fd_owned = 1;
    r->holder = holder;
    r->lock_wait = lock_wait;
    r->rate_until = 0;
    r->rate_word = W_RATE + 1;
    if (!(r->wsem = open_sem(wname)) || !(r->rsem = open_sem(rname)) || !(r->fsem = open_sem(fname))) {
        ring_release(r);
        return -1;
    }
    return 0;
}

static void Ring_dealloc(Ring *r) {
    ring_release(r);
    Py_XDECREF(r->path);
    Py_XDECREF(r->owner);
    Py_XDECREF(r->put_slow);
    PyTypeObject *tp = Py_TYPE((PyObject *)r);
    SHMQ_TP_FREE(tp)((PyObject *)r);
    Py_DECREF(tp);
}

static PyObject *Ring_get_max_payload(Ring *r, void *c) { return PyLong_FromUnsignedLongLong(r->max_payload); }

static PyMethodDef Ring_methods[] = {
    {"__reduce__", (PyCFunction)Ring_reduce, METH_NOARGS, "pickles as its spool's core: sp.put pickles as the spool's put"},
    {"trim", (PyCFunction)Ring_trim, METH_VARARGS,
     "trim(lock_wait=0) -> True, or None if the lock was busy: a drained growable ring keeps its current segment and the start allocation"},
    {"put", (PyCFunction)(void (*)(void))Ring_put, METH_FASTCALL,
     "put(data, codec=0, max_backlog=-1, lock_wait=None) -> seq, or a negative status"},
    {"put_many", (PyCFunction)(void (*)(void))Ring_put_many, METH_FASTCALL | METH_KEYWORDS,
     "put_many(items, codec=0, max_backlog=-1, lock_wait=None, *, before_commit=None, timestamps=None, "
     "sync=False) -> first seq, or a negative status"},
    {"read", (PyCFunction)Ring_read, METH_VARARGS, "read(seq, pos, verify=False) -> (frame|None, seq, pos, lost, codec)"},
    {"put_api", (PyCFunction)(void (*)(void))Ring_put_api, METH_FASTCALL | METH_KEYWORDS,
     "put(data, block=True, timeout=None, codec=0) -> seq (see shmq.Spool.put)"},
    {"bind", (PyCFunction)Ring_bind, METH_VARARGS,
     "bind(owner, put_slow, fast): put_slow(owner, data, block, timeout, codec) completes put_api"},
    {"first_cursor", (PyCFunction)Ring_first_cursor, METH_NOARGS, "(seq, pos) of the oldest frame"},
    {"reserve", (PyCFunction)Ring_reserve, METH_VARARGS, "reserve(nbytes, codec, lock_wait) -> Reservation or status"},
    {"locate", (PyCFunction)Ring_locate, METH_VARARGS, "locate(seq, hint_seq, hint_pos) -> position, -1 lost, -2 busy"},
    {"latest", (PyCFunction)Ring_latest, METH_VARARGS, "latest(lock_wait) -> (next_seq, next_pos) or None"},
    {"ring_space", (PyCFunction)Ring_ring_space, METH_NOARGS, "wake writers waiting for room, if any"},
    {"ring_data", (PyCFunction)Ring_ring_data, METH_NOARGS, "wake readers waiting for frames, if any"},
    {"trim_due", (PyCFunction)Ring_trim_due, METH_NOARGS,
     "True if a growable ring's zone spans more than 4 segments (an idle reader trims it)"},
    {"bell_seen", (PyCFunction)Ring_bell_seen, METH_O, "bell_seen(space) -> the doorbell word (read before re-checking)"},
    {"bell_wait", (PyCFunction)Ring_bell_wait, METH_VARARGS,
     "bell_wait(space, seen, timeout): sleep until the doorbell word moves from seen"},
    {"set_fd", (PyCFunction)Ring_set_fd, METH_VARARGS, "set_fd(fd, holder): after fork"},
    {"full_marker", (PyCFunction)Ring_full_marker, METH_NOARGS, "room marker taken under the lock when full"},
    {"room_marker", (PyCFunction)Ring_room_marker, METH_NOARGS, "the room marker now (compare with full_marker())"},
    {"close", (PyCFunction)Ring_close, METH_NOARGS, "release the mapping and semaphores"},
    {NULL}};

static PyGetSetDef Ring_getset[] = {{"max_payload", (getter)Ring_get_max_payload, NULL, NULL, NULL}, {NULL}};

static PyType_Slot ring_slots[] = {
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_init, Ring_init},
    {Py_tp_dealloc, Ring_dealloc},
    {Py_tp_methods, Ring_methods},
    {Py_tp_getset, Ring_getset},
    {Py_tp_doc, (void *)"The hot path of one spool mapping (internal: use shmq.Spool)."},
    {0, NULL}};

PyType_Spec ring_spec = {"shmq._core.Ring", sizeof(Ring), 0, Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE, ring_slots};
