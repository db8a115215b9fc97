/*
 * shmq/core/cursor.c: the Cursor type -- a reader's position over the
 * engine's eng_cursor (anonymous, named or a group member's): its takes
 * with Python objects as the sink (a Frame per frame, or the payload alone
 * for the Queue port), the blocking wait in C, commit, statistics flush and
 * close.  Reader.get's entry point (get_api) is in api.c.
 */
#include "binding.h"

#include <string.h>

/* ---- errors ---- */

int cursor_check(Cursor *c) {
    if (c->closed_msg) {
        PyErr_SetObject(PyExc_ValueError, c->closed_msg);
        return -1;
    }
    return ring_check_open(c->ring);
}

/* The exception for engine code `code`: a closed reader says why it was closed. */
PyObject *cursor_error(Cursor *c, int code) {
    if (code == SHMQ_ECLOSED && c->closed_msg) {
        PyErr_SetObject(PyExc_ValueError, c->closed_msg);
        return NULL;
    }
    return ring_error(c->ring, code);
}

/* ---- the Python sink of the takes ---- */

/* Where copy_py puts a payload: the new object (first: drop_py clears it). */
typedef struct {
    PyObject *data;
    CoreState *st;
} CopyOut;

/* The payload as a new bytes object, in the CopyOut at ctx.  Numpy and
 * out-of-band pickle payloads are copied writable (arrays rebuilt over them
 * are writable): a bytearray, or from LARGE_COPY bytes a memoryview over a
 * mapping of its own (large_copy_new: one page fault per huge page).  The
 * object is made empty, then filled by eng_copy (engine.h: memcpy but at the
 * distances where x86-64's rep movsb is slow). */
static const char *copy_py(void *ctx, const char *src, const shmq_frame_header *h) {
    CopyOut *o = ctx;
    char *dst;
    if (h->codec == SHMQ_CODEC_PICKLE_OOB || h->codec == SHMQ_CODEC_NUMPY) {
        if (h->length < LARGE_COPY) {
            if (!(o->data = PyByteArray_FromStringAndSize(NULL, h->length))) return NULL;
            dst = PyByteArray_AS_STRING(o->data);
        } else if (!(o->data = large_copy_new(o->st, (Py_ssize_t)h->length, &dst))) {
            return NULL;
        }
    } else {
        if (!(o->data = PyBytes_FromStringAndSize(NULL, h->length))) return NULL;
        dst = PyBytes_AS_STRING(o->data);
    }
    eng_copy(dst, src, h->length);
    return dst;
}

static void drop_py(void *ctx) { Py_CLEAR(*(PyObject **)ctx); }

/* Read the frame at cursor (seq, pos), lock-free: a new Frame, None (caught
 * up), or NULL with an exception.  Advances the cursor and adds overwritten
 * frames to *lost. */
PyObject *read_one(Ring *r, uint64_t *seqp, uint64_t *posp, int verify, uint64_t *lost) {
    CopyOut out = {NULL, r->st};
    shmq_frame_header h = {0};
    int got = read_loop(&r->eng, seqp, posp, verify, lost, &h, NULL, copy_py, drop_py, &out);
    if (got < 0) return ring_error(r, got);
    if (!got) Py_RETURN_NONE;
    return make_frame(r->st, h.seq, h.ts, out.data, h.codec);
}

static PyObject *obj_entry(Cursor *c, PyObject *data, const shmq_frame_header *h, Codes *codes, Py_ssize_t i) {
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
    int objects = codes->unpickle &&
                  (h->codec == SHMQ_CODEC_VALUES || (h->codec == SHMQ_CODEC_PICKLE && c->ring->st->pickle_loads));
    if (h->codec == SHMQ_CODEC_RAW || objects) {
        codes->v[i] = h->codec;
        return data;
    }
    codes->v[i] = CODE_FRAME;
    return make_frame(c->ring->st, h->seq, h->ts, data, h->codec);
}

/* Where each frame goes: a bytes (a Frame unless raw), a list entry
 * (as_list) or the single result. */
typedef struct {
    CopyOut copy; /* first: copy_py and drop_py use it */
    Cursor *c;
    PyObject *out, *single;
    shmq_frame_header *rawh;
    Codes *codes;
    int raw;
    Py_ssize_t i;
} PySink;

static int taken_py(void *ctx, const shmq_frame_header *h) {
    PySink *k = ctx;
    PyObject *f = k->copy.data;
    k->copy.data = NULL;
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

/* The result of a take into a PySink: the list, the frame, None; NULL with
 * the error if `got` < 0. */
static PyObject *take_result(PySink *k, long got) {
    Py_CLEAR(k->copy.data);
    if (got < 0) {
        Py_XDECREF(k->out);
        Py_XDECREF(k->single);
        return cursor_error(k->c, (int)got);
    }
    if (k->out) return k->out;
    if (k->single) return k->single;
    Py_RETURN_NONE;
}

/* Read up to max frames from a private cursor (anonymous / named), under its lock. */
static PyObject *private_take(Cursor *c, Py_ssize_t max, int as_list, shmq_frame_header *rawh, Codes *codes) {
    PySink k = {{NULL, c->ring->st}, c, NULL, NULL, rawh, codes, rawh || codes, 0};
    if (as_list && !(k.out = PyList_New(0))) return NULL;
    Sink sink = {copy_py, drop_py, taken_py, &k};
    long got = eng_cursor_lock(&c->eng);
    if (got == 0) {
        got = private_take_in(&c->eng, max, &sink);
        eng_cursor_unlock(&c->eng);
    }
    return take_result(&k, got);
}

/* Take up to max frames from the group's shared cursor under its lock. */
static PyObject *group_take(Cursor *c, Py_ssize_t max, int as_list, double lock_wait, shmq_frame_header *rawh,
                            Codes *codes) {
    eng_cursor *e = &c->eng;
    eng_ring *r = e->ring;
    PySink k = {{NULL, c->ring->st}, c, NULL, NULL, rawh, codes, rawh || codes, 0};
    if (as_list && !(k.out = PyList_New(0))) return NULL;
    uint64_t *s = cur_slot(e), pos, lost;
    int lk = group_lock(e, lock_wait, &s[SHMQ_S_LOCK_HOLDER], r->holder);
    if (lk != 0) {
        Py_XDECREF(k.out);
        return lk < 0 ? cursor_error(c, lk) : PyLong_FromLong(SHMQ_ELOCKED);
    }
    Sink sink = {copy_py, drop_py, taken_py, &k};
    long got = group_take_in(e, max, &sink, &pos, &lost);
    group_unlock(e, &s[SHMQ_S_LOCK_HOLDER]);
    if (got > 0 || (got == 0 && lost)) release_behind(r, &e->released, pos);
    if (got > 0 && r->policy != SHMQ_POLICY_OVERWRITE) ring_space(r); /* outside the lock: wake writers waiting for room */
    return take_result(&k, got);
}

/* Up to max frames from any cursor: the group take under the group lock
 * (waiting up to lock_wait for it), else the private take.  See those two
 * for as_list, rawh and codes. */
PyObject *cursor_take(Cursor *c, Py_ssize_t max, int as_list, double lock_wait, shmq_frame_header *rawh,
                      Codes *codes) {
    return c->eng.kind == K_GROUP ? group_take(c, max, as_list, lock_wait, rawh, codes)
                                  : private_take(c, max, as_list, rawh, codes);
}

/* ---- waiting in C ---- */

/* Whether a get(block, timeout) may wait in C: block True (or omitted) and
 * timeout None or a positive finite int or float (not a bool: Python
 * validates everything else, and raises the stdlib's errors).  *deadline:
 * 0 for no timeout, else the mono_ns() at which it passes. */
int park_deadline(PyObject *block, PyObject *timeout, uint64_t *deadline) {
    *deadline = 0;
    if (block && block != Py_True) return 0;
    if (!timeout || timeout == Py_None) return 1;
    if (!PyFloat_CheckExact(timeout) && !PyLong_CheckExact(timeout)) return 0;
    double t = PyFloat_AsDouble(timeout);
    if (t == -1.0 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    if (!(t > 0 && t < 1e9)) return 0; /* NaN, zero, negative, absurd: Python's */
    *deadline = mono_ns() + (uint64_t)(t * 1e9);
    return 1;
}

/* The timeout to hand the Python slow path after part of it was spent here. */
PyObject *time_left(PyObject *timeout, uint64_t deadline) {
    if (!deadline) return Py_NewRef(timeout ? timeout : Py_None);
    uint64_t now = mono_ns();
    return PyFloat_FromDouble(now >= deadline ? 0.0 : (double)(deadline - now) / 1e9);
}

/* eng_park's take: the binding's take into a new reference. */
typedef struct {
    Cursor *c;
    PyObject *(*take)(Cursor *);
    PyObject *nothing, *got;
} ParkCtx;

static int park_take(void *ctx) {
    ParkCtx *p = ctx;
    PyObject *got = p->take(p->c);
    if (!got) return SHMQ_ECALLBACK;
    if (got == p->nothing) {
        Py_DECREF(got);
        return 0;
    }
    p->got = got;
    return 1;
}

/* What get_api and get_obj_api do once a take found `nothing` and the call
 * may wait here (park_deadline): spin, then park until `deadline`.  A new
 * reference to what a take returned instead (a frame or an object, or a
 * status for Python); `nothing` when the wait is Python's to do (a group
 * with statistics to flush, which takes the group lock; a growable spool due
 * for an idle trim); NULL with an exception, shmq.Empty once `timeout`
 * passed.  Signals run their Python handlers in the wait; one that raises
 * (Ctrl-C) ends it with nothing held; a close of the reader or the handle by
 * another thread ends it with ValueError. */
PyObject *wait_take(Cursor *c, PyObject *(*take)(Cursor *), PyObject *nothing, uint64_t deadline, PyObject *timeout) {
    eng_cursor *e = &c->eng;
    if (eng_spin_for_frame(e, deadline)) {
        PyObject *got = take(c);
        if (got != nothing) return got;
        Py_DECREF(got);
    }
    if ((e->kind == K_GROUP && (e->n || e->lost_pending)) || trim_due(e->ring)) return Py_NewRef(nothing);
    if (e->kind == K_NAMED) eng_cursor_flush(e, 0); /* what a waiting reader shows the world */
    ParkCtx p = {c, take, nothing, NULL};
    int rc = eng_park(e, park_take, &p, deadline);
    if (rc == 1) return p.got;
    if (rc == SHMQ_EEMPTY) {
        CoreState *st = c->ring->st;
        PyErr_Format(st->EmptyError ? st->EmptyError : PyExc_RuntimeError, "no frame within %S s", timeout);
        return NULL;
    }
    return cursor_error(c, rc);
}

/* ---- the Cursor type ---- */

/* The optional lock_wait argument of the Cursor take methods: seconds, or
 * None for the handle's default.  0, or -1 with an exception set. */
static int lock_wait_arg(Cursor *c, PyObject *const *args, Py_ssize_t nargs, Py_ssize_t i, double *wait) {
    *wait = c->ring->eng.lock_wait;
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
    /* get(lock_wait=None) -> Frame, None (nothing now) or SHMQ_ELOCKED (groups) */
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
    /* get_many(max, lock_wait=None) -> list (maybe empty) or SHMQ_ELOCKED */
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
     * does at attach), decode values payloads and unpickle in-band pickles.  Returns the list of objects
     * (maybe empty), SHMQ_ELOCKED, or (list, indices) when frames of other
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
        return out; /* an error, or SHMQ_ELOCKED */
    }
    PyObject *undecoded = NULL;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(out); i++) {
        if (codes.v[i] == SHMQ_CODEC_PICKLE || codes.v[i] == SHMQ_CODEC_VALUES) {
            PyObject *d = PyList_GET_ITEM(out, i);
            PyObject *o = codes.v[i] == SHMQ_CODEC_PICKLE
                              ? PyObject_CallOneArg(c->ring->st->pickle_loads, d)
                              : values_decode(PyBytes_AS_STRING(d), PyBytes_GET_SIZE(d), &c->ring->st->keys);
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
    int rc = eng_cursor_commit(&c->eng);
    if (rc < 0) return cursor_error(c, rc);
    Py_RETURN_NONE;
}

static PyObject *Cursor_flush(Cursor *c, PyObject *args) {
    /* flush(lock_wait) -> True if flushed (groups take their lock; False: lock stuck) */
    double wait = c->ring->eng.lock_wait;
    if (!PyArg_ParseTuple(args, "|d", &wait)) return NULL;
    if (c->closed_msg || !c->ring->eng.base) Py_RETURN_TRUE;
    int rc = eng_cursor_flush(&c->eng, wait);
    if (rc < 0) return cursor_error(c, rc);
    return PyBool_FromLong(rc == 0);
}

static PyObject *Cursor_available(Cursor *c, PyObject *unused) {
    if (c->closed_msg || !c->ring->eng.base) Py_RETURN_TRUE; /* let the caller raise */
    return PyBool_FromLong(eng_cursor_available(&c->eng));
}

/* A zero-copy read's spin (its frames do not pass through the engine's take):
 * the engine's, so the GIL is released for it as for a copying read's. */
static PyObject *Cursor_spin(Cursor *c, PyObject *arg) {
    double s = PyFloat_AsDouble(arg);
    if (s == -1 && PyErr_Occurred()) return NULL;
    if (c->closed_msg || !c->ring->eng.base) Py_RETURN_TRUE; /* let the caller raise */
    if (!(s > 0)) return PyBool_FromLong(eng_cursor_available(&c->eng));
    uint64_t limit = s < 3600 ? (uint64_t)(s * 1e9) : (uint64_t)3600e9;
    return PyBool_FromLong(eng_spin(&c->eng, limit, 0));
}

static PyObject *Cursor_close(Cursor *c, PyObject *args) {
    PyObject *msg = NULL;
    if (!PyArg_ParseTuple(args, "|U", &msg)) return NULL;
    if (!c->closed_msg) {
        c->closed_msg = msg ? Py_NewRef(msg) : PyUnicode_FromString("reader is closed");
        eng_cursor_close(&c->eng); /* the group semaphore now, or when the last thread waiting on it is out */
    }
    Py_RETURN_NONE;
}

static PyObject *Cursor_add_lost(Cursor *c, PyObject *arg) {
    unsigned long long n = PyLong_AsUnsignedLongLong(arg);
    if (n == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    c->eng.lost += n;
    c->eng.lost_pending += n; /* published to the slot by the next flush */
    Py_RETURN_NONE;
}

static PyObject *Cursor_reset_stats(Cursor *c, PyObject *unused) {
    eng_cursor *e = &c->eng;
    e->n = e->bytes = e->dsum = e->dmax = e->dcount = e->lost_pending = 0;
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
    if (!PyArg_ParseTuple(args, "O!iLKKppO", st->RingType, &ring, &kind, &slot, &seq, &pos, &autocommit, &verify,
                          &gname))
        return -1;
    Ring *r = (Ring *)ring;
    if (ring_check_open(r) < 0) return -1;
    const char *gsem = NULL;
    if (kind == K_GROUP) {
        if (!PyUnicode_Check(gname)) {
            PyErr_SetString(PyExc_TypeError, "a group cursor needs its semaphore name");
            return -1;
        }
        if (!(gsem = PyUnicode_AsUTF8(gname))) return -1;
    }
    if (c->eng.gsem) sem_close(c->eng.gsem);
    int rc = eng_cursor_init(&c->eng, &r->eng, kind, slot, seq, pos, autocommit, verify, gsem);
    if (rc == -EINVAL) {
        PyErr_SetString(PyExc_ValueError, "bad cursor kind or slot");
        return -1;
    }
    if (rc < 0) {
        errno = -rc;
        PyErr_SetFromErrnoWithFilename(PyExc_OSError, gsem);
        return -1;
    }
    Py_XSETREF(c->ring, (Ring *)Py_NewRef(ring));
    return 0;
}

static void Cursor_dealloc(Cursor *c) {
    if (c->eng.gsem) sem_close(c->eng.gsem);
    Py_XDECREF((PyObject *)c->ring);
    Py_XDECREF(c->closed_msg);
    Py_XDECREF(c->last);
    Py_XDECREF(c->owner);
    Py_XDECREF(c->get_slow);
    PyTypeObject *tp = Py_TYPE((PyObject *)c);
    SHMQ_TP_FREE(tp)((PyObject *)c);
    Py_DECREF(tp);
}

/* The private cursor's fields, read and set by Python under the cursor lock. */
static PyObject *cursor_field(Cursor *c, uint64_t *field) {
    if (eng_cursor_lock(&c->eng) < 0) return cursor_error(c, SHMQ_ESTATE);
    uint64_t v = *field;
    eng_cursor_unlock(&c->eng);
    return PyLong_FromUnsignedLongLong(v);
}

static int set_cursor_field(Cursor *c, uint64_t *field, PyObject *v, int pos) {
    unsigned long long n = PyLong_AsUnsignedLongLong(v);
    if (n == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    if (eng_cursor_lock(&c->eng) < 0) {
        cursor_error(c, SHMQ_ESTATE);
        return -1;
    }
    *field = n;
    /* Python moves the cursor itself past frames it read outside the engine
     * (zero-copy columnar reads, seek): those reads release the pages behind
     * them too. */
    if (pos && c->ring && c->ring->eng.base) release_behind(&c->ring->eng, &c->eng.released, c->eng.pos);
    eng_cursor_unlock(&c->eng);
    return 0;
}

static PyObject *Cursor_get_seq(Cursor *c, void *x) { return cursor_field(c, &c->eng.seq); }
static int Cursor_set_seq(Cursor *c, PyObject *v, void *x) { return set_cursor_field(c, &c->eng.seq, v, 0); }
static PyObject *Cursor_get_pos(Cursor *c, void *x) { return cursor_field(c, &c->eng.pos); }
static int Cursor_set_pos(Cursor *c, PyObject *v, void *x) { return set_cursor_field(c, &c->eng.pos, v, 1); }
static PyObject *Cursor_get_lost(Cursor *c, void *x) { return cursor_field(c, &c->eng.lost); }
static int Cursor_set_lost(Cursor *c, PyObject *v, void *x) { return set_cursor_field(c, &c->eng.lost, v, 0); }
static PyObject *Cursor_get_pending(Cursor *c, void *x) { return PyLong_FromUnsignedLongLong(c->eng.n); }

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
     "get_obj_many(max, lock_wait=None, unpickle=False) -> [objects], LOCK_STUCK, or ([objects and Frames], undecoded indices)"},
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
    {"spin", (PyCFunction)Cursor_spin, METH_O,
     "spin(seconds) -> True once a frame is committed past the cursor, False if none is after `seconds` of "
     "spinning (no syscall; the GIL released for spins over 2 us)"},
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
