/*
 * shmq/core/reserve.c: reservations -- zero-copy writes.  Ring.reserve
 * takes the writer lock and places one frame (write.c's place_batch, as a
 * put does); the caller writes the payload in place through a memoryview;
 * commit publishes it (write.c's commit_batch) and releases the lock.
 *
 * reserve_locked and commit_reserved are the Python-free halves (the TSan
 * harness calls them under the writer lock); the rest is the Reservation
 * type.
 */
#include "core.h"

/* Place one frame of `nbytes` (writer lock held): 0 and *rv's seq, off,
 * stored, end filled, or a status (nothing changed), or ST_PYERR. */
int reserve_locked(Ring *r, uint64_t nbytes, Reservation *rv) {
    uint64_t need = FRAME_BYTES + ((nbytes + 7) & ~(uint64_t)7), placed;
    Placement pl;
    int st = place_batch(r, 1, &need, need, -1, &placed, &pl);
    if (st != 0) return st;
    write_pads(r, &pl, now_ns());
    populate_ahead(r, placed, need); /* the caller writes the payload in place: no fault per page */
    /* A header that is not frame `seq` yet: nothing past NEXT_SEQ is read, and
     * recovery after a kill re-derives NEXT_POS from committed frames only. */
    memset(r->ring + placed % r->ring_bytes, 0, FRAME_BYTES);
    rv->seq = pl.seq0;
    rv->off = placed % r->ring_bytes;
    rv->nbytes = nbytes;
    rv->stored = need;
    rv->end = pl.end;
    rv->start = pl.start;
    return 0;
}

/* Publish a reserved frame whose payload is written (writer lock held;
 * the caller releases it). */
void commit_reserved(Ring *r, const Reservation *rv) {
    char *payload = r->ring + rv->off + FRAME_BYTES;
    uint64_t pad = rv->stored - FRAME_BYTES - rv->nbytes;
    if (pad) memset(payload + rv->nbytes, 0, (size_t)pad);
    uint64_t ts = now_ns();
    FrameHeader h = {rv->seq, (uint32_t)rv->stored, (uint32_t)rv->nbytes, ts, 0, 0, (uint8_t)rv->codec, 0};
    if (r->checksum) {
        h.crc = crc_update(0, (const unsigned char *)payload, (size_t)rv->nbytes);
        h.flags = FLAG_CRC;
    }
    memcpy(r->ring + rv->off, &h, FRAME_BYTES);
    commit_batch(r, rv->seq + 1, rv->end, 1, rv->nbytes, ts);
}

static void reservation_unlock(Reservation *rv) {
    Ring *r = rv->ring;
    rv->open = 0;
    if (r->reserved_by == rv) r->reserved_by = NULL;
    if (r->have_buf) wlock_release(r);
}

static void reservation_drop_view(Reservation *rv) {
    if (rv->view) {
        PyObject *res = PyObject_CallMethod(rv->view, "release", NULL);
        if (!res) PyErr_Clear(); /* a derived view still exports it: documented as invalid now */
        Py_XDECREF(res);
        Py_CLEAR(rv->view);
    }
}

static PyObject *Reservation_commit(Reservation *rv, PyObject *unused) {
    if (!rv->open) {
        PyErr_SetString(PyExc_ValueError, "the reservation is closed (committed or abandoned)");
        return NULL;
    }
    Ring *r = rv->ring;
    if (!r->have_buf) {
        rv->open = 0;
        PyErr_SetString(PyExc_ValueError, "spool handle is closed");
        return NULL;
    }
    reservation_drop_view(rv);
    commit_reserved(r, rv);
    reservation_unlock(rv);
    ring_bell(r, r->rsem);
    return PyLong_FromUnsignedLongLong(rv->seq);
}

static PyObject *Reservation_abandon(Reservation *rv, PyObject *unused) {
    if (rv->open) {
        reservation_drop_view(rv);
        if (rv->ring->have_buf) unplace(rv->ring, rv->seq, rv->start);
        reservation_unlock(rv); /* nothing was published: the space is reused by the next write */
    }
    Py_RETURN_NONE;
}

static PyObject *Reservation_enter(Reservation *rv, PyObject *unused) {
    if (!rv->open) {
        PyErr_SetString(PyExc_ValueError, "the reservation is closed (committed or abandoned)");
        return NULL;
    }
    if (!rv->view) {
        /* A slice of a view over the mmap object itself: the mapping knows it
         * is exported, so closing the spool cannot unmap it under the view. */
        Ring *r = rv->ring;
        if (ring_check_open(r) < 0) return NULL;
        PyObject *mv = PyMemoryView_FromObject(r->buf.obj);
        if (!mv) return NULL;
        Py_ssize_t a = (Py_ssize_t)(r->ring - r->base + rv->off + FRAME_BYTES);
        PyObject *lo = PyLong_FromSsize_t(a), *hi = PyLong_FromSsize_t(a + (Py_ssize_t)rv->nbytes);
        PyObject *sl = lo && hi ? PySlice_New(lo, hi, NULL) : NULL;
        Py_XDECREF(lo);
        Py_XDECREF(hi);
        if (!sl) {
            Py_DECREF(mv);
            return NULL;
        }
        rv->view = PyObject_GetItem(mv, sl);
        Py_DECREF(sl);
        Py_DECREF(mv);
        if (!rv->view) return NULL;
    }
    return Py_NewRef(rv->view);
}

static PyObject *Reservation_exit(Reservation *rv, PyObject *args) {
    PyObject *et = Py_None;
    if (PyTuple_GET_SIZE(args) > 0) et = PyTuple_GET_ITEM(args, 0);
    if (et != Py_None) return Reservation_abandon(rv, NULL), Py_NewRef(Py_False);
    PyObject *seq = Reservation_commit(rv, NULL);
    if (!seq) return NULL;
    Py_DECREF(seq);
    Py_RETURN_FALSE;
}

static void Reservation_dealloc(Reservation *rv) {
    if (rv->open) { /* dropped without commit: abandoned */
        if (rv->ring->have_buf) unplace(rv->ring, rv->seq, rv->start);
        reservation_unlock(rv);
    }
    Py_XDECREF(rv->view);
    Py_XDECREF((PyObject *)rv->ring);
    PyTypeObject *tp = Py_TYPE((PyObject *)rv);
    SHMQ_TP_FREE(tp)((PyObject *)rv);
    Py_DECREF(tp);
}

static PyObject *Reservation_get_seq(Reservation *rv, void *x) { return PyLong_FromUnsignedLongLong(rv->seq); }
static PyObject *Reservation_get_nbytes(Reservation *rv, void *x) { return PyLong_FromUnsignedLongLong(rv->nbytes); }
static PyObject *Reservation_get_open(Reservation *rv, void *x) { return PyBool_FromLong(rv->open); }

static PyGetSetDef Reservation_getset[] = {
    {"seq", (getter)Reservation_get_seq, NULL, "the seq the frame gets when committed", NULL},
    {"nbytes", (getter)Reservation_get_nbytes, NULL, "payload size", NULL},
    {"open", (getter)Reservation_get_open, NULL, "True until committed or abandoned", NULL},
    {NULL}};

static PyMethodDef Reservation_methods[] = {
    {"commit", (PyCFunction)Reservation_commit, METH_NOARGS, "publish the frame; return its seq"},
    {"abandon", (PyCFunction)Reservation_abandon, METH_NOARGS, "release the space without publishing anything"},
    {"__enter__", (PyCFunction)Reservation_enter, METH_NOARGS, "a writable memoryview of the payload"},
    {"__exit__", (PyCFunction)Reservation_exit, METH_VARARGS, "commit on a clean exit, abandon on an exception"},
    {NULL}};

static PyType_Slot reservation_slots[] = {
    {Py_tp_dealloc, Reservation_dealloc},
    {Py_tp_methods, Reservation_methods},
    {Py_tp_getset, Reservation_getset},
    {Py_tp_doc, (void *)"Room for one frame, written in place: `with sp.reserve(n) as buf: buf[:] = ...` commits on a\n"
              "clean exit and abandons on an exception; a process killed inside exposes nothing.\n"
              "The writer lock is held while it is open: keep the block short."},
    {0, NULL}};

PyType_Spec reservation_spec = {"shmq.Reservation", sizeof(Reservation), 0,
                                Py_TPFLAGS_DEFAULT | Py_TPFLAGS_DISALLOW_INSTANTIATION | Py_TPFLAGS_IMMUTABLETYPE,
                                reservation_slots};

PyObject *Ring_reserve(Ring *r, PyObject *args) {
    /* reserve(nbytes, codec, lock_wait) -> Reservation, or a negative status */
    unsigned long long nbytes;
    int codec;
    double wait;
    if (!PyArg_ParseTuple(args, "Kid", &nbytes, &codec, &wait)) return NULL;
    if (ring_check_open(r) < 0) return NULL;
    if (r->reserved_by && r->reserved_by->thread == PyThread_get_thread_ident()) {
        PyErr_SetString(PyExc_RuntimeError, "this thread already holds an open reservation of this spool: "
                                            "commit or abandon it first (it holds the writer lock)");
        return NULL;
    }
    if (r->callout && r->callout == PyThread_get_thread_ident()) {
        PyErr_SetString(PyExc_RuntimeError, "reserve from a fill() or before_commit() of the same spool would "
                                            "deadlock (they run under the writer lock)");
        return NULL;
    }
    if (nbytes > r->max_payload) return PyLong_FromLong(ST_TOO_LARGE);
    int lk = sem_lock_as(r->wsem, wait, r, &r->ctl[W_LOCK_HOLDER], r->holder); /* holder recorded at once */
    if (lk < 0) return NULL;
    if (lk > 0) return PyLong_FromLong(ST_LOCK_STUCK);
    Reservation *rv = PyObject_New(Reservation, r->st->ReservationType);
    if (!rv) {
        wlock_release(r);
        ring_finish(r);
        return NULL;
    }
    rv->ring = NULL;
    rv->view = NULL;
    rv->open = 0;
    rv->codec = codec;
    int st = reserve_locked(r, nbytes, rv);
    if (st != 0) {
        wlock_release(r);
        ring_finish(r);
        Py_DECREF(rv);
        if (st == ST_PYERR) return NULL;
        return PyLong_FromLong(st);
    }
    rv->ring = (Ring *)Py_NewRef((PyObject *)r);
    rv->open = 1;
    rv->thread = PyThread_get_thread_ident();
    r->reserved_by = rv;
    return (PyObject *)rv;
}


