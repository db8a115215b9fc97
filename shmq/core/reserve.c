/*
 * shmq/core/reserve.c: the Reservation type -- zero-copy writes over the
 * engine's reservation (eng_reserve: the writer lock taken, one frame
 * placed; eng_resv_commit publishes it).  The payload is written through a
 * memoryview over the mmap object itself, so closing the spool cannot unmap
 * it under the view.
 */
#include "binding.h"

static void reservation_drop_view(Reservation *rv) {
    if (rv->view) {
        PyObject *res = PyObject_CallMethodObjArgs(rv->view, rv->ring->st->str_release, NULL);
        if (!res) PyErr_Clear(); /* a derived view still exports it: documented as invalid now */
        Py_XDECREF(res);
        Py_CLEAR(rv->view);
    }
}

static PyObject *Reservation_commit(Reservation *rv, PyObject *unused) {
    if (!rv->eng.open) {
        PyErr_SetString(PyExc_ValueError, "the reservation is closed (committed or abandoned)");
        return NULL;
    }
    reservation_drop_view(rv);
    int64_t seq = eng_resv_commit(&rv->eng);
    if (seq < 0) {
        if (seq == SHMQ_ECLOSED || seq == SHMQ_ESTATE) {
            PyErr_SetString(PyExc_ValueError, seq == SHMQ_ECLOSED ? "spool handle is closed" : shmq_errmsg());
            return NULL;
        }
        return ring_error(rv->ring, (int)seq); /* a sync reservation's msync: OSError */
    }
    return PyLong_FromLongLong(seq);
}

static PyObject *Reservation_abandon(Reservation *rv, PyObject *unused) {
    if (rv->eng.open) {
        reservation_drop_view(rv);
        eng_resv_abandon(&rv->eng); /* nothing was published: the space is reused by the next write */
    }
    Py_RETURN_NONE;
}

static PyObject *Reservation_enter(Reservation *rv, PyObject *unused) {
    if (!rv->eng.open) {
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
        Py_ssize_t a = (Py_ssize_t)(r->eng.ring - r->eng.base + rv->eng.off + SHMQ_FRAME_BYTES);
        PyObject *lo = PyLong_FromSsize_t(a), *hi = PyLong_FromSsize_t(a + (Py_ssize_t)rv->eng.nbytes);
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
    eng_resv_abandon(&rv->eng); /* dropped without commit: abandoned */
    Py_XDECREF(rv->view);
    Py_XDECREF((PyObject *)rv->ring);
    PyTypeObject *tp = Py_TYPE((PyObject *)rv);
    SHMQ_TP_FREE(tp)((PyObject *)rv);
    Py_DECREF(tp);
}

static PyObject *Reservation_get_seq(Reservation *rv, void *x) { return PyLong_FromUnsignedLongLong(rv->eng.seq); }
static PyObject *Reservation_get_nbytes(Reservation *rv, void *x) { return PyLong_FromUnsignedLongLong(rv->eng.nbytes); }
static PyObject *Reservation_get_open(Reservation *rv, void *x) { return PyBool_FromLong(rv->eng.open); }

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

/* A Reservation of `nbytes` (the writer lock taken, waited for up to
 * lock_wait; `sync`: its commit msyncs, see eng_resv): the object, or NULL
 * with *status the engine's status (SHMQ_ELOCKED, SHMQ_EFULL, ...: nothing
 * held), or NULL with an exception set (*status 0). */
PyObject *reservation_new(Ring *r, uint64_t nbytes, int codec, double lock_wait, int sync, int *status) {
    *status = 0;
    if (ring_check_open(r) < 0) return NULL;
    Reservation *rv = PyObject_New(Reservation, r->st->ReservationType);
    if (!rv) return NULL;
    rv->ring = NULL;
    rv->view = NULL;
    memset(&rv->eng, 0, sizeof rv->eng);
    rv->eng.sync = (uint8_t)(sync != 0);
    int st = eng_reserve(&r->eng, nbytes, codec, lock_wait, &rv->eng);
    if (st != 0) {
        Py_DECREF(rv);
        if (is_status(st)) *status = st;
        else ring_error(r, st);
        return NULL;
    }
    rv->ring = (Ring *)Py_NewRef((PyObject *)r);
    return (PyObject *)rv;
}

PyObject *Ring_reserve(Ring *r, PyObject *args) {
    /* reserve(nbytes, codec, lock_wait, sync=False) -> Reservation, or a negative status */
    unsigned long long nbytes;
    int codec, st, sync = 0;
    double wait;
    if (!PyArg_ParseTuple(args, "Kid|p", &nbytes, &codec, &wait, &sync)) return NULL;
    PyObject *rv = reservation_new(r, nbytes, codec, wait, sync, &st);
    return rv || !st ? rv : PyLong_FromLong(st);
}
