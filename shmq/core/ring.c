/*
 * shmq/core/ring.c: the Ring type -- one spool mapping over the engine's
 * eng_ring: its init over the mmap object's buffer, close (deferred by the
 * engine while another thread waits in it), the put / put_many entry
 * points' argument parsing, and the methods Python's slow paths call (read,
 * locate, latest, trim, doorbells, room markers).  Spool.put's fast entry
 * point lives in api.c, the writer in the engine.
 */
#include "binding.h"

/* ---- errors ---- */

PyObject *engine_error(CoreState *st, PyObject *path, int code) {
    const char *msg = shmq_errmsg();
    switch (code) {
    case SHMQ_ECALLBACK:
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_SystemError, "shmq engine: a callback failed without an error");
        return NULL;
    case SHMQ_ECORRUPT:
    case SHMQ_EFORMAT:
        PyErr_SetString(st && st->SpoolFormatError ? st->SpoolFormatError : PyExc_RuntimeError, msg);
        return NULL;
    case SHMQ_ESQUATTED:
        PyErr_SetString(st && st->ShmqError ? st->ShmqError : PyExc_RuntimeError, msg);
        return NULL;
    case SHMQ_ECLOSED:
        PyErr_SetString(PyExc_ValueError, msg[0] ? msg : "spool handle is closed");
        return NULL;
    case SHMQ_ESTATE:
        PyErr_SetString(PyExc_RuntimeError, msg);
        return NULL;
    case -ENOMEM:
        return PyErr_NoMemory();
    default:
        break;
    }
    if (code < 0 && code > -4096) {
        errno = -code;
        return path ? PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, path) : PyErr_SetFromErrno(PyExc_OSError);
    }
    PyErr_Format(PyExc_SystemError, "shmq engine: unexpected code %d (%s)", code, shmq_strerror(code));
    return NULL;
}

/* ---- items: Python buffers as the engine's segments ---- */

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
    for (Py_ssize_t i = 0; i < k; i++) {
        for (int j = 0; j < items[i].nviews; j++) PyBuffer_Release(&items[i].views[j]);
        Py_XDECREF(items[i].hold);
    }
}

/* n bytes at p (a values-codec payload: no Python object) as engine item *e. */
void load_raw_item(Item *it, eng_item *e, const char *p, uint64_t n, int checksum) {
    e->segs = it->segs;
    e->crc = 0;
    e->fill = NULL;
    it->hold = NULL; /* no Python object: release_items has nothing to release */
    it->nviews = 0;
    it->segs[0].buf = p;
    it->segs[0].len = (size_t)n;
    e->nsegs = 1;
    e->n = n;
    if (checksum) eng_item_crc(e);
}

/* A bytes-like object, or a tuple of them (segments), as engine item *e,
 * its buffers held in *it (release_items). */
int load_item(Item *it, eng_item *e, PyObject *o, int checksum) {
    e->segs = it->segs;
    e->crc = 0;
    e->fill = NULL;
    it->hold = NULL;
    if (PyBytes_CheckExact(o)) {
        /* bytes are immutable: their storage is the segment for as long as a
         * reference is held, without the buffer protocol's view and release */
        it->segs[0].buf = PyBytes_AS_STRING(o);
        it->segs[0].len = (size_t)PyBytes_GET_SIZE(o);
        Py_INCREF(o);
        it->hold = o;
        it->nviews = 0;
        e->nsegs = 1;
        e->n = (uint64_t)it->segs[0].len;
        if (checksum) eng_item_crc(e);
        return 0;
    }
    e->nsegs = 0;
    e->n = 0;
    if (PyTuple_CheckExact(o)) {
        Py_ssize_t k = PyTuple_GET_SIZE(o);
        if (k > MAX_SEGS) {
            PyErr_Format(PyExc_ValueError, "a frame has at most %d segments", MAX_SEGS);
            return -1;
        }
        for (Py_ssize_t j = 0; j < k; j++) {
            if (get_segment(PyTuple_GET_ITEM(o, j), &it->views[j]) < 0) {
                for (int q = 0; q < e->nsegs; q++) PyBuffer_Release(&it->views[q]);
                it->nviews = e->nsegs = 0;
                return -1;
            }
            it->segs[j].buf = it->views[j].buf;
            it->segs[j].len = (size_t)it->views[j].len;
            e->nsegs++;
            e->n += (uint64_t)it->views[j].len;
        }
    } else {
        if (get_segment(o, &it->views[0]) < 0) return -1;
        it->segs[0].buf = it->views[0].buf;
        it->segs[0].len = (size_t)it->views[0].len;
        e->nsegs = 1;
        e->n = (uint64_t)it->views[0].len;
    }
    it->nviews = e->nsegs;
    if (checksum) eng_item_crc(e);
    return 0;
}

/* ---- Ring methods ---- */

static PyObject *Ring_trim_due(Ring *r, PyObject *unused) {
    if (ring_check_open(r) < 0) return NULL;
    return PyBool_FromLong(trim_due(&r->eng));
}

/* The optional (codec, max_backlog, lock_wait) arguments of put / put_many. */
static int parse_put_args(Ring *r, PyObject *const *args, Py_ssize_t nargs, int *codec, long long *backlog,
                          double *wait) {
    if (ring_check_open(r) < 0) return -1;
    *codec = 0;
    *backlog = -1;
    *wait = r->eng.lock_wait;
    if (nargs > 1 && (*codec = (int)PyLong_AsLong(args[1])) == -1 && PyErr_Occurred()) return -1;
    if (nargs > 2 && (*backlog = PyLong_AsLongLong(args[2])) == -1 && PyErr_Occurred()) return -1;
    if (nargs > 3 && args[3] != Py_None && (*wait = PyFloat_AsDouble(args[3])) == -1 && PyErr_Occurred()) return -1;
    return 0;
}

/* A write's result for Python: the seq or a status, or NULL with the error. */
static PyObject *write_result(Ring *r, int64_t res) {
    if (res >= 0 || is_status(res)) return PyLong_FromLongLong(res);
    return ring_error(r, (int)res);
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
    if (load_item(&item, &item.item, args[0], r->eng.checksum) < 0) return NULL;
    int64_t res = eng_write(&r->eng, &item.item, 1, codec, backlog, wait, 0, NULL);
    release_items(&item, 1);
    return write_result(r, res);
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
    WriteOpts opts;
    memset(&opts, 0, sizeof opts);
    opts.ring = r;
    if (kwnames && parse_write_opts(r, args + nargs, kwnames, count, &opts) < 0) {
        Py_DECREF(seq);
        return NULL;
    }
    if (count > MAX_BATCH) {
        free_write_opts(&opts);
        Py_DECREF(seq);
        return PyLong_FromLong(SHMQ_ETOOLARGE);
    }
    /* one block: the engine's items, then the buffers that keep them alive */
    eng_item *eitems = PyMem_Malloc((sizeof(eng_item) + sizeof(Item)) * (size_t)count);
    Item *items = (Item *)(eitems + count);
    if (!eitems) {
        free_write_opts(&opts);
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    shmq_fast_items objs = SHMQ_FAST_ITEMS(seq);
    Py_ssize_t k;
    for (k = 0; k < count; k++) {
        if (load_item(&items[k], &eitems[k], SHMQ_FAST_AT(objs, k), r->eng.checksum) < 0) {
            /* a Deferred is no buffer: recognized only here, off the plain path */
            int d = PyErr_ExceptionMatches(PyExc_TypeError) ?
                load_deferred(r, &items[k], &eitems[k], SHMQ_FAST_AT(objs, k)) : 0;
            if (d > 0) {
                PyErr_Clear();
                opts.eng.deferred = 1;
                continue;
            }
            release_items(items, k);
            PyMem_Free(eitems);
            free_write_opts(&opts);
            Py_DECREF(seq);
            return NULL;
        }
    }
    const eng_wopts *o =
        opts.eng.before_commit || opts.eng.timestamps || opts.eng.sync || opts.eng.deferred ? &opts.eng : NULL;
    int64_t res = eng_write(&r->eng, eitems, (size_t)count, codec, backlog, wait, 0, o);
    release_items(items, count);
    PyMem_Free(eitems);
    free_write_opts(&opts);
    Py_DECREF(seq);
    return write_result(r, res);
}

/* ---- Ring methods used by Python's slow paths ---- */

static PyObject *Ring_read(Ring *r, PyObject *args) {
    /* read(seq, pos, verify=False) -> (frame|None, seq, pos, lost, codec) */
    unsigned long long seq, pos;
    int verify = 0;
    if (!PyArg_ParseTuple(args, "KK|p", &seq, &pos, &verify)) return NULL;
    if (ring_check_open(r) < 0) return NULL;
    uint64_t s = seq, p = pos, lost = 0;
    PyObject *f = read_one(r, &s, &p, verify, &lost);
    if (!f) return NULL;
    if (f == Py_None) return Py_BuildValue("(NKKKi)", f, s, p, lost, 0);
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
    uint64_t at;
    int rc = eng_locate(&r->eng, want, hseq, hpos, &at);
    if (rc < 0) return ring_error(r, rc);
    if (rc > 0) return PyLong_FromLong(-rc);
    return PyLong_FromUnsignedLongLong(at);
}

static PyObject *Ring_first_cursor(Ring *r, PyObject *unused) {
    if (ring_check_open(r) < 0) return NULL;
    uint64_t s, p;
    int rc = first_cursor(&r->eng, &s, &p);
    if (rc < 0) return ring_error(r, rc);
    return Py_BuildValue("(KK)", s, p);
}

static PyObject *Ring_latest(Ring *r, PyObject *args) {
    /* latest(lock_wait) -> (NEXT_SEQ, NEXT_POS) as a consistent pair, or None if the lock is stuck */
    double wait = r->eng.lock_wait;
    if (!PyArg_ParseTuple(args, "|d", &wait)) return NULL;
    if (ring_check_open(r) < 0) return NULL;
    uint64_t s, p;
    int rc = eng_latest(&r->eng, wait, &s, &p);
    if (rc < 0) return ring_error(r, rc);
    if (rc > 0) Py_RETURN_NONE;
    return Py_BuildValue("(KK)", s, p);
}

static PyObject *Ring_ring_space(Ring *r, PyObject *unused) {
    if (ring_check_open(r) < 0) return NULL;
    ring_bell(&r->eng, r->eng.fsem);
    Py_RETURN_NONE;
}

static PyObject *Ring_ring_data(Ring *r, PyObject *unused) {
    if (ring_check_open(r) < 0) return NULL;
    ring_bell(&r->eng, r->eng.rsem);
    Py_RETURN_NONE;
}

/* bell_seen(space) -> the doorbell word's value; read it after registering
 * as a waiter and before re-checking, then pass it to bell_wait. */
static PyObject *Ring_bell_seen(Ring *r, PyObject *space) {
    if (ring_check_open(r) < 0) return NULL;
    int sp = PyObject_IsTrue(space);
    if (sp < 0) return NULL;
    return PyLong_FromUnsignedLong(eng_bell_seen(&r->eng, sp));
}

/* bell_wait(space, seen, timeout): sleep, GIL released, until the doorbell
 * word is no longer `seen` (someone rang), a signal arrives or `timeout`
 * seconds pass.  Any return means "re-check"; a signal handler's exception
 * propagates (nothing is held here). */
static PyObject *Ring_bell_wait(Ring *r, PyObject *args) {
    int space;
    unsigned long seen;
    double timeout;
    if (!PyArg_ParseTuple(args, "pkd", &space, &seen, &timeout)) return NULL;
    if (ring_check_open(r) < 0) return NULL;
    int rc = eng_bell_wait(&r->eng, space, (uint32_t)seen, timeout);
    if (rc < 0) return ring_error(r, rc);
    Py_RETURN_NONE;
}

static PyObject *Ring_set_fd(Ring *r, PyObject *args) {
    unsigned long long holder;
    int fd;
    if (!PyArg_ParseTuple(args, "iK", &fd, &holder)) return NULL;
    int mine = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (mine < 0) return PyErr_SetFromErrno(PyExc_OSError);
    if (r->eng.fd >= 0) close(r->eng.fd);
    r->eng.fd = mine;
    r->eng.holder = holder;
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
    int rc = eng_trim(&r->eng, wait);
    if (rc < 0) return ring_error(r, rc);
    if (rc > 0) Py_RETURN_NONE;
    Py_RETURN_TRUE;
}

static PyObject *Ring_full_marker(Ring *r, PyObject *unused) {
    uint64_t f, p;
    eng_full_marker(&f, &p); /* this thread's last write that found no room */
    return Py_BuildValue("(KK)", f, p);
}

/* The room marker now (no lock: each word is one atomic load), computed as
 * the full marker is, so a waiter compares like with like. */
static PyObject *Ring_room_marker(Ring *r, PyObject *unused) {
    if (ring_check_open(r) < 0) return NULL;
    uint64_t f, p;
    room_marker(&r->eng, &f, &p);
    return Py_BuildValue("(KK)", f, p);
}

/* room_state(publish) -> 0, 1 or 2: a writer blocked on a full spool, after
 * its write (this thread's) found no room: 0 no room for that write yet, 1
 * room for it, 2 room for a burst.  `publish`: ask consumers to ring once
 * the burst's room is there (its want; the engine's wait.c). */
static PyObject *Ring_room_state(Ring *r, PyObject *publish) {
    if (ring_check_open(r) < 0) return NULL;
    int p = PyObject_IsTrue(publish);
    if (p < 0) return NULL;
    return PyLong_FromLong(room_state(&r->eng, p));
}

/* room_unwant(): the writer waits no more; its published want goes. */
static PyObject *Ring_room_unwant(Ring *r, PyObject *unused) {
    if (ring_check_open(r) < 0) return NULL;
    room_unwant(&r->eng);
    Py_RETURN_NONE;
}

/* repair_after_writer_death() -> [actions]: the engine's re-derivation of
 * the control words (writer lock held by the caller); an unreadable ring is
 * dropped whole (readers count the frames lost). */
static PyObject *Ring_repair_after_writer_death(Ring *r, PyObject *unused) {
    if (ring_check_open(r) < 0) return NULL;
    char log[1024];
    eng_repair_control(r->eng.ctl, r->eng.ring, r->eng.ring_bytes, 1, log, sizeof log);
    return PyUnicode_FromString(log);
}

static PyObject *Ring_close(Ring *r, PyObject *unused) {
    eng_ring_release(&r->eng);
    Py_RETURN_NONE;
}

/* The engine's release of the mapping (now, or by the last thread out of a
 * blocking section): the GIL is held there. */
static void ring_unmap(eng_ring *e) {
    Ring *r = e->owner;
    if (r->have_buf) {
        PyBuffer_Release(&r->buf);
        r->have_buf = 0;
    }
}

static int Ring_init(Ring *r, PyObject *args, PyObject *kw) {
    /* Ring(mm, path, ring_offset, ring_bytes, slot_offset, slot_count, policy, checksum,
            writer_sem, read_waiters_sem, space_waiters_sem, fd, holder, lock_wait[, recovery_timeout]) */
    PyObject *mm, *path;
    unsigned long long ring_offset, ring_bytes, slot_offset, slot_count, holder;
    int policy, checksum, fd;
    const char *wname, *rname, *fname;
    double lock_wait, recovery = 1.0;
    if (!PyArg_ParseTuple(args, "OUKKKKipsssiKd|d", &mm, &path, &ring_offset, &ring_bytes, &slot_offset, &slot_count,
                          &policy, &checksum, &wname, &rname, &fname, &fd, &holder, &lock_wait, &recovery))
        return -1;
    eng_ring_release(&r->eng);
    if (r->eng.base) {
        PyErr_SetString(PyExc_RuntimeError, "Ring is in use by another thread");
        return -1;
    }
    r->st = PyType_GetModuleState(Py_TYPE((PyObject *)r));
    if (!r->st) return -1;
    const char *cpath = PyUnicode_AsUTF8(path);
    if (!cpath) return -1;
    Py_XSETREF(r->path, Py_NewRef(path));
    if (PyObject_GetBuffer(mm, &r->buf, PyBUF_WRITABLE) < 0) return -1;
    r->have_buf = 1;
    eng_ring_spec s = {r->buf.buf, (uint64_t)r->buf.len, ring_offset, ring_bytes, slot_offset, slot_count, policy,
                       checksum, fd, wname, rname, fname, holder, lock_wait, recovery, cpath, &r->st->hooks};
    int rc = eng_ring_init(&r->eng, &s);
    if (rc < 0) {
        PyBuffer_Release(&r->buf);
        r->have_buf = 0;
        if (rc == -EINVAL) {
            PyErr_SetString(PyExc_ValueError, "inconsistent ring geometry");
            return -1;
        }
        errno = -rc;
        PyErr_SetFromErrnoWithFilename(PyExc_OSError, shmq_errmsg()); /* the file or the semaphore */
        return -1;
    }
    r->eng.owner = r;
    r->eng.unmap = ring_unmap;
    return 0;
}

static void Ring_dealloc(Ring *r) {
    eng_ring_release(&r->eng);
    if (r->eng.base) ring_unmap(&r->eng); /* (busy at dealloc: cannot be, every wait holds a reference) */
    Py_XDECREF(r->path);
    Py_XDECREF(r->owner);
    Py_XDECREF(r->put_slow);
    Py_XDECREF(r->reserve_slow);
    PyTypeObject *tp = Py_TYPE((PyObject *)r);
    SHMQ_TP_FREE(tp)((PyObject *)r);
    Py_DECREF(tp);
}

static PyObject *Ring_get_max_payload(Ring *r, void *c) { return PyLong_FromUnsignedLongLong(r->eng.max_payload); }

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
     "bind(owner, put_slow, fast[, reserve_slow]): put_slow(owner, data, block, timeout, codec) completes "
     "put_api, reserve_slow(owner, nbytes, codec, timeout) reserve_api"},
    {"reserve_api", (PyCFunction)(void (*)(void))Ring_reserve_api, METH_FASTCALL | METH_KEYWORDS,
     "reserve(nbytes, *, codec=0, timeout=None) -> Reservation (see shmq.Spool.reserve)"},
    {"first_cursor", (PyCFunction)Ring_first_cursor, METH_NOARGS, "(seq, pos) of the oldest frame"},
    {"reserve", (PyCFunction)Ring_reserve, METH_VARARGS,
     "reserve(nbytes, codec, lock_wait, sync=False) -> Reservation or status"},
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
    {"room_state", (PyCFunction)Ring_room_state, METH_O,
     "room_state(publish) -> 0 no room, 1 room for the write that found none, 2 room for a burst"},
    {"room_unwant", (PyCFunction)Ring_room_unwant, METH_NOARGS, "take back the want room_state(True) published"},
    {"repair_after_writer_death", (PyCFunction)Ring_repair_after_writer_death, METH_NOARGS,
     "re-derive the control words after a dead writer's lock was broken (lock held) -> what was done"},
    {"close", (PyCFunction)Ring_close, METH_NOARGS, "release the mapping and semaphores"},
    {NULL}};

static PyObject *Ring_get_wrap_lag(Ring *r, void *c) { return PyLong_FromUnsignedLongLong(r->eng.wrap_lag); }

static int Ring_set_wrap_lag(Ring *r, PyObject *v, void *c) {
    if (!v) {
        PyErr_SetString(PyExc_AttributeError, "wrap_lag cannot be deleted");
        return -1;
    }
    unsigned long long n = PyLong_AsUnsignedLongLong(v);
    if (n == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    r->eng.wrap_lag = n;
    return 0;
}

static PyGetSetDef Ring_getset[] = {
    {"max_payload", (getter)Ring_get_max_payload, NULL, NULL, NULL},
    {"wrap_lag", (getter)Ring_get_wrap_lag, (setter)Ring_set_wrap_lag,
     "growable rings: bytes consumers may still have unread when this handle's writer wraps early "
     "(0, the default: only once all are caught up).  For a writer that bounds its own lead and "
     "retries a put that finds the ring full; set before the first put.", NULL},
    {NULL}};

static PyObject *Ring_new(PyTypeObject *tp, PyObject *args, PyObject *kw) {
    Ring *r = (Ring *)PyType_GenericNew(tp, args, kw);
    if (r) r->eng.fd = -1;
    return (PyObject *)r;
}

static PyType_Slot ring_slots[] = {
    {Py_tp_new, Ring_new},
    {Py_tp_init, Ring_init},
    {Py_tp_dealloc, Ring_dealloc},
    {Py_tp_methods, Ring_methods},
    {Py_tp_getset, Ring_getset},
    {Py_tp_doc, (void *)"The hot path of one spool mapping (internal: use shmq.Spool)."},
    {0, NULL}};

PyType_Spec ring_spec = {"shmq._core.Ring", sizeof(Ring), 0, Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE, ring_slots};
