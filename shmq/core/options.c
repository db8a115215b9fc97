/*
 * shmq/core/options.c: what put_many's options add to the engine's one
 * writer (shmq/engine/write.c): the shmq.Deferred type, parsing the
 * keywords (before_commit=, timestamps=, sync=) into the engine's
 * eng_wopts, and the Python callouts the engine calls with the writer lock
 * held (a Deferred's fill, before_commit).  Placement, eviction and commit
 * stay the engine's: an option never changes where a frame goes.
 *
 * A callout runs Python with the writer lock held (docs/format.md, "The
 * engine"): the engine marks the handle busy (a close() meanwhile is
 * deferred) and records the thread (a put or reserve from it raises
 * instead of deadlocking); an exception aborts the batch (nothing
 * published).
 */
#include "binding.h"

typedef struct {
    PyObject_HEAD
    Py_ssize_t nbytes;
    PyObject *fill;
} Deferred;

static int Deferred_init(Deferred *d, PyObject *args, PyObject *kw) {
    static char *names[] = {"nbytes", "fill", NULL};
    Py_ssize_t n;
    PyObject *fill;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "nO:Deferred", names, &n, &fill)) return -1;
    if (n < 0) {
        PyErr_SetString(PyExc_ValueError, "Deferred nbytes must be >= 0");
        return -1;
    }
    if (!PyCallable_Check(fill)) {
        PyErr_SetString(PyExc_TypeError, "Deferred fill must be callable: fill(memoryview)");
        return -1;
    }
    d->nbytes = n;
    Py_XSETREF(d->fill, Py_NewRef(fill));
    return 0;
}

static int Deferred_traverse(Deferred *d, visitproc visit, void *arg) {
    Py_VISIT(Py_TYPE((PyObject *)d));
    Py_VISIT(d->fill);
    return 0;
}

static int Deferred_clear(Deferred *d) {
    Py_CLEAR(d->fill);
    return 0;
}

static void Deferred_dealloc(Deferred *d) {
    PyObject_GC_UnTrack(d);
    Py_XDECREF(d->fill);
    PyTypeObject *tp = Py_TYPE((PyObject *)d);
    SHMQ_TP_FREE(tp)((PyObject *)d);
    Py_DECREF(tp);
}

static PyObject *Deferred_get_nbytes(Deferred *d, void *x) { return PyLong_FromSsize_t(d->nbytes); }
static PyObject *Deferred_get_fill(Deferred *d, void *x) { return Py_NewRef(d->fill ? d->fill : Py_None); }

static PyGetSetDef Deferred_getset[] = {
    {"nbytes", (getter)Deferred_get_nbytes, NULL, "payload size", NULL},
    {"fill", (getter)Deferred_get_fill, NULL, "fill(memoryview): writes exactly nbytes", NULL},
    {NULL}};

static PyType_Slot deferred_slots[] = {
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_init, Deferred_init},
    {Py_tp_dealloc, Deferred_dealloc},
    {Py_tp_traverse, Deferred_traverse},
    {Py_tp_clear, Deferred_clear},
    {Py_tp_getset, Deferred_getset},
    {Py_tp_doc, (void *)"Deferred(nbytes, fill): a frame payload of known size, written by fill(memoryview) under\n"
                        "the writer lock, straight into the ring (e.g. an Arrow IPC stream), its checksum\n"
                        "computed after.  fill must write exactly nbytes, must not keep the view, and must not\n"
                        "touch the spool; if it raises, the batch is aborted (nothing published) and the\n"
                        "exception propagates.  An item of Spool.put_many (not of put)."},
    {0, NULL}};

PyType_Spec deferred_spec = {"shmq.spool.Deferred", sizeof(Deferred), 0,
                             Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE | Py_TPFLAGS_HAVE_GC, deferred_slots};

/* fill(view) writes a Deferred's n bytes at dst (the engine's fill callout,
 * writer lock held).  The view is released after the call, so a fill that
 * keeps it cannot write once the lock is gone (unless it exported it
 * further: documented as not allowed).  0, or -1 with an exception. */
static int fill_payload(void *fill, char *dst, uint64_t n) {
    PyObject *view = PyMemoryView_FromMemory(dst, (Py_ssize_t)n, PyBUF_WRITE);
    if (!view) return -1;
    PyObject *res = PyObject_CallOneArg((PyObject *)fill, view);
#if PY_VERSION_HEX >= 0x030C0000
    PyObject *exc = PyErr_GetRaisedException();
#else
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
#endif
    PyObject *done = PyObject_CallMethod(view, "release", NULL);
    if (!done) PyErr_Clear(); /* still exported: the view stays valid (fill broke its contract) */
    Py_XDECREF(done);
    Py_DECREF(view);
#if PY_VERSION_HEX >= 0x030C0000
    PyErr_SetRaisedException(exc);
#else
    PyErr_Restore(et, ev, tb);
#endif
    Py_XDECREF(res);
    return res ? 0 : -1;
}

int load_deferred(Ring *r, Item *it, eng_item *e, PyObject *o) {
    if (!r->st || !Py_IS_TYPE(o, r->st->DeferredType)) return 0;
    if (!((Deferred *)o)->fill) {
        PyErr_SetString(PyExc_ValueError, "Deferred was not initialized");
        return -1;
    }
    it->nviews = 0;
    it->hold = NULL;
    e->segs = it->segs;
    e->nsegs = 0;
    e->n = (uint64_t)((Deferred *)o)->nbytes;
    e->crc = 0; /* computed after fill, under the lock */
    e->fill = fill_payload;
    e->fill_ctx = ((Deferred *)o)->fill;
    return 1;
}

/* before_commit(first_seq, [positions]) (the engine's callout, writer lock
 * held).  0, or -1 with an exception. */
static int call_before_commit(void *ctx, uint64_t seq0, const uint64_t *placed, size_t count) {
    WriteOpts *o = ctx;
    PyObject *positions = PyList_New((Py_ssize_t)count), *first = PyLong_FromUnsignedLongLong(seq0);
    int rc = -1;
    if (!positions || !first) goto out;
    for (size_t k = 0; k < count; k++) {
        PyObject *p = PyLong_FromUnsignedLongLong(placed[k]);
        if (!p) goto out;
        PyList_SET_ITEM(positions, (Py_ssize_t)k, p);
    }
    PyObject *args[2] = {first, positions};
    PyObject *res = PyObject_Vectorcall(o->before_commit, args, 2, NULL);
    rc = res ? 0 : -1;
    Py_XDECREF(res);
out:
    Py_XDECREF(positions);
    Py_XDECREF(first);
    return rc;
}

/* put_many's keyword options (kwargs: their values, named by kwnames) for a
 * batch of `count`: before_commit=callable|None, timestamps=one u64 per
 * frame|None, sync=bool.  0, or -1 with an exception (nothing allocated). */
int parse_write_opts(Ring *r, PyObject *const *kwargs, PyObject *kwnames, Py_ssize_t count, WriteOpts *o) {
    Py_ssize_t nk = PyTuple_GET_SIZE(kwnames);
    PyObject *stamps = NULL;
    for (Py_ssize_t k = 0; k < nk; k++) {
        PyObject *v = kwargs[k];
        const char *name = PyUnicode_AsUTF8(PyTuple_GET_ITEM(kwnames, k));
        if (!name) return -1;
        if (strcmp(name, "before_commit") == 0) {
            if (v != Py_None && !PyCallable_Check(v)) {
                PyErr_SetString(PyExc_TypeError, "before_commit must be callable: before_commit(first_seq, positions)");
                return -1;
            }
            o->before_commit = v == Py_None ? NULL : v;
            o->eng.before_commit = o->before_commit ? call_before_commit : NULL;
            o->eng.ctx = o;
        } else if (strcmp(name, "timestamps") == 0) {
            stamps = v == Py_None ? NULL : v;
        } else if (strcmp(name, "sync") == 0) {
            if ((o->eng.sync = PyObject_IsTrue(v)) < 0) return -1;
        } else {
            PyErr_Format(PyExc_TypeError, "put_many() got an unexpected keyword argument '%s'", name);
            return -1;
        }
    }
    if (!stamps) return 0;
    PyObject *seq = PySequence_Fast(stamps, "timestamps must be one u64 (ns) per frame");
    if (!seq) return -1;
    if (PySequence_Fast_GET_SIZE(seq) != count) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "timestamps must be one u64 (ns) per frame");
        return -1;
    }
    uint64_t *ts = PyMem_Malloc(sizeof(uint64_t) * (size_t)(count ? count : 1));
    if (!ts) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t k = 0; k < count; k++) {
        PyObject *i = PyNumber_Index(PySequence_Fast_GET_ITEM(seq, k));
        ts[k] = i ? PyLong_AsUnsignedLongLong(i) : (uint64_t)-1;
        Py_XDECREF(i);
        if (ts[k] == (uint64_t)-1 && PyErr_Occurred()) {
            PyErr_Clear();
            PyMem_Free(ts);
            Py_DECREF(seq);
            PyErr_SetString(PyExc_ValueError, "timestamps must be one u64 (ns) per frame");
            return -1;
        }
    }
    Py_DECREF(seq);
    o->eng.timestamps = ts;
    return 0;
}

void free_write_opts(WriteOpts *o) {
    PyMem_Free((void *)o->eng.timestamps);
    o->eng.timestamps = NULL;
}

