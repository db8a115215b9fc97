/*
 * shmq/core/cursor.c: the Cursor type -- a reader's position (anonymous,
 * named or a group member's), its take methods over read.c's takes, its
 * commit, statistics flush and close.  Reader.get's entry point (get_api)
 * is in api.c.
 */
#include "core.h"

/* The optional lock_wait argument of the Cursor take methods: seconds, or
 * None for the handle's default.  0, or -1 with an exception set. */
static int lock_wait_arg(Cursor *c, PyObject *const *args, Py_ssize_t nargs, Py_ssize_t i, double *wait) {
    *wait = c->ring->lock_wait;
    if (nargs > i && args[i] != Py_None && (*wait = PyFloat_AsDouble(args[i])) == -1 && PyErr_Occurred()) return -1;
    return 0;
}

/* The arguments of get_many / get_obj_many: (max, lock_wait=None), the cursor open. */
static int many_args(Cursor *c, PyObject *const *args, Py_ssize_t nargs, const char *usage, Py_ssize_t *max,
                     double *wait) {
    if (nargs < 1) {
        PyErr_SetString(PyExc_TypeError, usage);
        return -1;
    }
    *max = PyLong_AsSsize_t(args[0]);
    if (*max == -1 && PyErr_Occurred()) return -1;
    if (cursor_check(c) < 0) return -1;
    return lock_wait_arg(c, args, nargs, 1, wait);
}

static PyObject *Cursor_get(Cursor *c, PyObject *const *args, Py_ssize_t nargs) {
    /* get(lock_wait=None) -> Frame, None (nothing now) or ST_LOCK_STUCK (groups) */
    double wait;
    if (cursor_check(c) < 0 || lock_wait_arg(c, args, nargs, 0, &wait) < 0) return NULL;
    return cursor_take(c, 1, 0, wait, NULL, NULL);
}



static PyObject *Cursor_get_last(Cursor *c, void *x) {
    PyObject *f = c->last ? c->last : Py_None;
    Py_INCREF(f);
    Py_CLEAR(c->last);
    return f;
}

static PyObject *Cursor_get_many(Cursor *c, PyObject *const *args, Py_ssize_t nargs) {
    /* get_many(max, lock_wait=None) -> list (maybe empty) or ST_LOCK_STUCK */
    Py_ssize_t max;
    double wait;
    if (many_args(c, args, nargs, "get_many(max, lock_wait=None)", &max, &wait) < 0) return NULL;
    return cursor_take(c, max, 1, wait, NULL, NULL);
}

static PyObject *Cursor_get_obj_many(Cursor *c, PyObject *const *args, Py_ssize_t nargs) {
    /* get_obj_many(max, lock_wait=None, unpickle=False): shmq.Queue.get_many
     * in one call, as get_obj for one item: take up to max frames (no Frame
     * objects), release the group lock, then leave raw payloads as they are
     * and, with unpickle (only for a spool whose trust was checked: shmq.Queue
     * does at attach), unpickle in-band pickles.  Returns the list of objects
     * (maybe empty), ST_LOCK_STUCK, or (list, indices) when frames of other
     * codecs were taken: those entries are Frames for Python's decoder.  An
     * item that fails to unpickle raises; the batch is taken. */
    Py_ssize_t max;
    double wait;
    if (many_args(c, args, nargs, "get_obj_many(max, lock_wait=None)", &max, &wait) < 0) return NULL;
    if (max < 1) {
        PyErr_SetString(PyExc_ValueError, "get_obj_many: max must be >= 1");
        return NULL;
    }
    /* Per call, not per cursor: unpickling below may run Python code, and
     * another thread may take from this cursor meanwhile. */
    int unpickle = nargs > 2 ? PyObject_IsTrue(args[2]) : 0;
    if (unpickle < 0) return NULL;
    Codes codes = {NULL, 0, unpickle};
    PyObject *out = cursor_take(c, max, 1, wait, NULL, &codes);
    if (!out || !PyList_Check(out)) {
        PyMem_Free(codes.v);
        return out; /* an error, or ST_LOCK_STUCK */
    }
    PyObject *undecoded = NULL;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(out); i++) {
        if (codes.v[i] == 1) {
            PyObject *o = PyObject_CallOneArg(c->ring->st->pickle_loads, PyList_GET_ITEM(out, i));
            if (!o) goto fail;
            PyObject *old = PyList_GET_ITEM(out, i);
            PyList_SET_ITEM(out, i, o);
            Py_DECREF(old);
        } else if (codes.v[i] == CODE_FRAME) {
            if (!undecoded && !(undecoded = PyList_New(0))) goto fail;
            PyObject *ix = PyLong_FromSsize_t(i);
            if (!ix || PyList_Append(undecoded, ix) < 0) {
                Py_XDECREF(ix);
                goto fail;
            }
            Py_DECREF(ix);
        }
    }
    PyMem_Free(codes.v);
    return undecoded ? Py_BuildValue("(NN)", out, undecoded) : out;
fail:
    PyMem_Free(codes.v);
    Py_DECREF(out);
    Py_XDECREF(undecoded);
    return NULL;
}

static PyObject *Cursor_commit(Cursor *c, PyObject *unused) {
    if (cursor_check(c) < 0) return NULL;
    if (c->kind == K_NAMED) {
        named_commit(c);
        flush_locked(c);
        if (c->ring->policy != 0) ring_bell(c->ring, c->ring->fsem);
    }
    Py_RETURN_NONE;
}

static PyObject *Cursor_flush(Cursor *c, PyObject *args) {
    /* flush(lock_wait) -> True if flushed (groups take their lock; False: lock stuck) */
    double wait = c->ring->lock_wait;
    if (!PyArg_ParseTuple(args, "|d", &wait)) return NULL;
    if (c->closed_msg || !c->ring->have_buf || c->slot < 0) Py_RETURN_TRUE;
    if (c->kind == K_GROUP) {
        if (!c->n) Py_RETURN_TRUE;
        int lk = group_lock(c, wait, NULL, 0);
        if (lk < 0) return NULL;
        if (lk > 0) Py_RETURN_FALSE;
        flush_locked(c);
        sem_post(c->gsem);
    } else {
        flush_locked(c);
    }
    Py_RETURN_TRUE;
}

static PyObject *Cursor_available(Cursor *c, PyObject *unused) {
    if (c->closed_msg || !c->ring->have_buf) Py_RETURN_TRUE; /* let the caller raise */
    uint64_t seq = c->kind == K_GROUP ? ld_acq(&cur_slot(c)[S_SEQ]) : c->seq;
    return PyBool_FromLong(seq < ld_acq(&c->ring->ctl[W_NEXT_SEQ]));
}

static PyObject *Cursor_close(Cursor *c, PyObject *args) {
    PyObject *msg = NULL;
    if (!PyArg_ParseTuple(args, "|U", &msg)) return NULL;
    if (!c->closed_msg) {
        c->closed_msg = msg ? Py_NewRef(msg) : PyUnicode_FromString("reader is closed");
        cursor_finish(c); /* now, or when the last thread waiting on the group lock is out */
    }
    Py_RETURN_NONE;
}

static PyObject *Cursor_add_lost(Cursor *c, PyObject *arg) {
    unsigned long long n = PyLong_AsUnsignedLongLong(arg);
    if (n == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    c->lost += n;
    c->lost_pending += n; /* published to the slot by the next flush */
    Py_RETURN_NONE;
}

static PyObject *Cursor_reset_stats(Cursor *c, PyObject *unused) {
    c->n = c->bytes = c->dsum = c->dmax = c->dcount = c->lost_pending = 0;
    Py_RETURN_NONE;
}

static int Cursor_init(Cursor *c, PyObject *args, PyObject *kw) {
    /* Cursor(ring, kind, slot, seq, pos, autocommit, verify, group_sem_name or None) */
    PyObject *ring;
    int kind, autocommit, verify;
    long long slot;
    unsigned long long seq, pos;
    PyObject *gname;
    CoreState *st = PyType_GetModuleState(Py_TYPE((PyObject *)c));
    if (!st) return -1;
    if (!PyArg_ParseTuple(args, "O!iLKKppO", st->RingType, &ring, &kind, &slot, &seq, &pos, &autocommit, &verify, &gname))
        return -1;
    Ring *r = (Ring *)ring;
    if (kind < 0 || kind > 2 || (kind != K_ANON && (slot < 0 || (uint64_t)slot >= r->slot_count))) {
        PyErr_SetString(PyExc_ValueError, "bad cursor kind or slot");
        return -1;
    }
    Py_XSETREF(c->ring, (Ring *)Py_NewRef(ring));
    c->kind = kind;
    c->slot = kind == K_ANON ? -1 : slot;
    c->seq = seq;
    c->pos = pos;
    c->released = pos;
    c->rng = (now_ns() ^ (uint64_t)(uintptr_t)c) | 1; /* xorshift state: never 0 */
    c->autocommit = autocommit;
    c->verify = verify;
    if (kind == K_GROUP) {
        if (!PyUnicode_Check(gname)) {
            PyErr_SetString(PyExc_TypeError, "a group cursor needs its semaphore name");
            return -1;
        }
        if (!(c->gsem = open_sem(PyUnicode_AsUTF8(gname)))) return -1;
    }
    return 0;
}

static void Cursor_dealloc(Cursor *c) {
    if (c->gsem) sem_close(c->gsem);
    Py_XDECREF((PyObject *)c->ring);
    Py_XDECREF(c->closed_msg);
    Py_XDECREF(c->last);
    Py_XDECREF(c->owner);
    Py_XDECREF(c->get_slow);
    PyTypeObject *tp = Py_TYPE((PyObject *)c);
    SHMQ_TP_FREE(tp)((PyObject *)c);
    Py_DECREF(tp);
}

#define U64_GETSET(field)                                                                         \
    static PyObject *Cursor_get_##field(Cursor *c, void *x) { return PyLong_FromUnsignedLongLong(c->field); } \
    static int Cursor_set_##field(Cursor *c, PyObject *v, void *x) {                              \
        unsigned long long n = PyLong_AsUnsignedLongLong(v);                                      \
        if (n == (unsigned long long)-1 && PyErr_Occurred()) return -1;                           \
        c->field = n;                                                                             \
        return 0;                                                                                 \
    }
U64_GETSET(seq)
U64_GETSET(lost)

static PyObject *Cursor_get_pos(Cursor *c, void *x) { return PyLong_FromUnsignedLongLong(c->pos); }

/* Python moves the cursor itself past frames it read outside the core (zero-copy
 * columnar reads, seek): those reads release the pages behind them too. */
static int Cursor_set_pos(Cursor *c, PyObject *v, void *x) {
    unsigned long long n = PyLong_AsUnsignedLongLong(v);
    if (n == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    c->pos = n;
    if (c->ring) release_behind(c->ring, &c->released, c->pos);
    return 0;
}

static PyObject *Cursor_get_pending(Cursor *c, void *x) { return PyLong_FromUnsignedLongLong(c->n); }

static PyGetSetDef Cursor_getset[] = {
    {"seq", (getter)Cursor_get_seq, (setter)Cursor_set_seq, "next seq (private cursors)", NULL},
    {"pos", (getter)Cursor_get_pos, (setter)Cursor_set_pos, "byte position of the next frame", NULL},
    {"lost", (getter)Cursor_get_lost, (setter)Cursor_set_lost, "frames skipped by this cursor", NULL},
    {"pending", (getter)Cursor_get_pending, NULL, "frames counted but not yet flushed to the slot", NULL},
    {"last", (getter)Cursor_get_last, NULL, "the frame get_obj() returned UNDECODED for (read once)", NULL},
    {NULL}};

static PyMethodDef Cursor_methods[] = {
    {"__reduce__", (PyCFunction)Cursor_reduce, METH_NOARGS, "pickles as its reader's cursor: r.get pickles as the reader's get"},
    {"get", (PyCFunction)(void (*)(void))Cursor_get, METH_FASTCALL, "get(lock_wait=None) -> Frame | None | status"},
    {"get_obj_many", (PyCFunction)(void (*)(void))Cursor_get_obj_many, METH_FASTCALL,
     "get_obj_many(max, lock_wait=None, unpickle=False) -> [objects], ST_LOCK_STUCK, or ([objects and Frames], undecoded indices)"},
    {"get_many", (PyCFunction)(void (*)(void))Cursor_get_many, METH_FASTCALL,
     "get_many(max, lock_wait=None) -> list | status"},
    {"get_obj", (PyCFunction)Cursor_get_obj, METH_NOARGS, "get_obj() -> object | EMPTY | STUCK | UNDECODED"},
    {"get_api", (PyCFunction)(void (*)(void))Cursor_get_api, METH_FASTCALL | METH_KEYWORDS,
     "get(block=True, timeout=None) -> Frame (see shmq.Reader.get)"},
    {"bind", (PyCFunction)Cursor_bind, METH_VARARGS,
     "bind(reader, get_slow): get_slow(reader, block, timeout, first) completes get_api"},
    {"commit", (PyCFunction)Cursor_commit, METH_NOARGS, "store the position in the slot (named readers)"},
    {"flush", (PyCFunction)Cursor_flush, METH_VARARGS, "publish counters to the slot"},
    {"available", (PyCFunction)Cursor_available, METH_NOARGS, "True if a frame is committed past the cursor"},
    {"close", (PyCFunction)Cursor_close, METH_VARARGS, "close(message): later calls raise ValueError(message)"},
    {"reset_stats", (PyCFunction)Cursor_reset_stats, METH_NOARGS, "drop unflushed counters (fork child)"},
    {"add_lost", (PyCFunction)Cursor_add_lost, METH_O, "count frames skipped outside the core"},
    {NULL}};

static PyType_Slot cursor_slots[] = {
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_init, Cursor_init},
    {Py_tp_dealloc, Cursor_dealloc},
    {Py_tp_methods, Cursor_methods},
    {Py_tp_getset, Cursor_getset},
    {Py_tp_doc, (void *)"A reader's cursor over a Ring (internal: use Spool.reader)."},
    {0, NULL}};

PyType_Spec cursor_spec = {"shmq._core.Cursor", sizeof(Cursor), 0, Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
                           cursor_slots};
