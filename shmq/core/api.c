/*
 * shmq/core/api.c: the boundary -- the entry points shmq.Spool, shmq.Reader
 * and shmq.Queue bind (put, get; the queue's put and get on a QueuePort),
 * each the whole uncontended call in C, and their one-way hand-off to the
 * Python slow paths.
 *
 * The core never looks Python up by name: a handle binds its slow path
 * once, as a plain function (its class's _put_slow / _get_slow, so a
 * subclass's override is the one called) and a weak reference to itself;
 * what the fast path leaves over is handed to slow(owner, *args).  The
 * queue's own state (its owner, maxsize) lives on its QueuePort, not in the
 * Ring or the Cursor.
 */
#include "binding.h"

/* A new reference to what weak reference `ref` points at, or NULL with
 * ValueError when it is gone (the handle was collected: closed). */
static PyObject *owner_of(PyObject *ref) {
    PyObject *o = NULL;
    if (ref) {
#if PY_VERSION_HEX >= 0x030D0000
        if (PyWeakref_GetRef(ref, &o) < 0) return NULL;
#else
        o = PyWeakref_GetObject(ref); /* borrowed: taken at once, under the GIL */
        if (!o) return NULL;
        o = o == Py_None ? NULL : Py_NewRef(o);
#endif
    }
    if (!o) PyErr_SetString(PyExc_ValueError, "handle is closed");
    return o;
}

/* A Ring or Cursor is one process's view of a mapping: it does not pickle.
 * sp.put and r.get (bound per handle to the core) land here when pickled;
 * say what to pickle instead. */
PyObject *Ring_reduce(Ring *r, PyObject *Py_UNUSED(ignored)) {
    return PyErr_Format(PyExc_TypeError,
                        "cannot pickle the spool's core: pickle the Spool and call its put "
                        "(e.g. functools.partial(shmq.Spool.put, spool))");
}

PyObject *Cursor_reduce(Cursor *c, PyObject *Py_UNUSED(ignored)) {
    return PyErr_Format(PyExc_TypeError,
                        "cannot pickle a reader's core cursor: pickle the reader and call its get "
                        "(e.g. functools.partial(shmq.Reader.get, reader))");
}

/* slow(owner, *args): the slow path a handle bound, on the handle itself. */
static PyObject *call_slow(PyObject *owner_ref, PyObject *slow, PyObject *const *args, size_t nargs) {
    if (!slow) {
        PyErr_SetString(PyExc_ValueError, "handle is not bound");
        return NULL;
    }
    PyObject *o = owner_of(owner_ref);
    if (!o) return NULL;
    PyObject *all[6];
    all[0] = o;
    for (size_t i = 0; i < nargs && i < 5; i++) all[i + 1] = args[i];
    PyObject *res = PyObject_Vectorcall(slow, all, nargs + 1, NULL);
    Py_DECREF(o);
    return res;
}

/* *ref = a weak reference to obj, *fn = slow (checked callable).  0, or -1
 * with an exception. */
static int bind_slow(PyObject **ref, PyObject **fn, PyObject *obj, PyObject *slow) {
    if (!PyCallable_Check(slow)) {
        PyErr_SetString(PyExc_TypeError, "the slow path must be callable");
        return -1;
    }
    PyObject *w = PyWeakref_NewRef(obj, NULL);
    if (!w) return -1;
    Py_XSETREF(*ref, w);
    Py_XSETREF(*fn, Py_NewRef(slow));
    return 0;
}

/* Parse (first positional, block=True, timeout=None, codec/extra) for the *_api entry points. */
int parse_api(PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames, const char *const *names, int nnames,
                     PyObject **out) {
    for (int i = 0; i < nnames; i++) out[i] = NULL;
    if (nargs > nnames) {
        PyErr_Format(PyExc_TypeError, "takes at most %d positional arguments", nnames);
        return -1;
    }
    for (Py_ssize_t i = 0; i < nargs; i++) out[i] = args[i];
    if (kwnames) {
        Py_ssize_t nk = PyTuple_GET_SIZE(kwnames);
        for (Py_ssize_t k = 0; k < nk; k++) {
            const char *kn = PyUnicode_AsUTF8(PyTuple_GET_ITEM(kwnames, k));
            if (!kn) return -1;
            int found = 0;
            for (int i = 0; i < nnames; i++) {
                if (strcmp(kn, names[i]) == 0) {
                    if (out[i]) {
                        PyErr_Format(PyExc_TypeError, "got multiple values for argument '%s'", kn);
                        return -1;
                    }
                    out[i] = args[nargs + k];
                    found = 1;
                    break;
                }
            }
            if (!found) {
                PyErr_Format(PyExc_TypeError, "got an unexpected keyword argument '%s'", kn);
                return -1;
            }
        }
    }
    return 0;
}

/* ---- shmq.Spool.put ---- */

/* Whether a put (block, timeout) is tried in C first: block true and timeout
 * None or a plain positive number of seconds; anything else (a put that
 * must not wait, a timeout to validate) is the slow path's.  *lock_wait:
 * how long the writer lock may be waited for here, the handle's lock_wait
 * without a timeout; with one the lock is only tried, so that nothing of
 * the timeout is spent here (at most the 20 us headroom wait) and the slow
 * path gets it whole, with its own rule for a busy or stuck lock (a live
 * holder is waited for up to the longer of the timeout and the recovery
 * timeout: shmq/writer.py) and its messages. */
static int fast_put_wait(Ring *r, PyObject *block, PyObject *timeout, double *lock_wait) {
    uint64_t deadline;
    if (!park_deadline(block, timeout, &deadline)) return 0;
    *lock_wait = deadline ? 0.0 : r->eng.lock_wait;
    return 1;
}

PyObject *Ring_put_api(Ring *r, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    /* Spool.put(data, block=True, timeout=None, codec=0): the uncontended put
     * in one C call, also with a timeout (which bounds only waits); anything
     * else goes to the slow path bound with it. */
    static const char *const names[] = {"data", "block", "timeout", "codec"};
    PyObject *a[4];
    if (parse_api(args, nargs, kwnames, names, 4, a) < 0) return NULL;
    if (!a[0]) {
        PyErr_SetString(PyExc_TypeError, "put() missing required argument: 'data'");
        return NULL;
    }
    int codec = 0;
    if (a[3] && (codec = (int)PyLong_AsLong(a[3])) == -1 && PyErr_Occurred()) return NULL;
    double lock_wait;
    if (r->fast_put && r->eng.base && fast_put_wait(r, a[1], a[2], &lock_wait)) {
        Item item;
        if (load_item(&item, &item.item, a[0], r->eng.checksum) < 0) return NULL;
        int64_t res = eng_write(&r->eng, &item.item, 1, codec, -1, lock_wait, 1, NULL);
        release_items(&item, 1);
        if (res >= 0) return PyLong_FromLongLong(res);
        if (!is_status(res)) return ring_error(r, (int)res);
    }
    PyObject *cd = PyLong_FromLong(codec);
    if (!cd) return NULL;
    PyObject *cargs[4] = {a[0], a[1] ? a[1] : Py_True, a[2] ? a[2] : Py_None, cd};
    PyObject *res = call_slow(r->owner, r->put_slow, cargs, 4);
    Py_DECREF(cd);
    return res;
}

/* bind(owner, put_slow, fast[, reserve_slow]): put_slow(owner, data, block,
 * timeout, codec) completes put_api, reserve_slow(owner, nbytes, codec,
 * timeout) reserve_api; fast 0 sends every put there (sync=True). */
PyObject *Ring_bind(Ring *r, PyObject *args) {
    PyObject *owner, *slow, *rslow = NULL;
    int fast;
    if (!PyArg_ParseTuple(args, "OOp|O", &owner, &slow, &fast, &rslow)) return NULL;
    if (bind_slow(&r->owner, &r->put_slow, owner, slow) < 0) return NULL;
    if (rslow && bind_slow(&r->owner, &r->reserve_slow, owner, rslow) < 0) return NULL;
    r->fast_put = fast;
    Py_RETURN_NONE;
}

/* ---- shmq.Spool.reserve ---- */

PyObject *Ring_reserve_api(Ring *r, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    /* Spool.reserve(nbytes, *, codec=0, timeout=None): the uncontended
     * reservation in one C call (an exact int nbytes, timeout None or
     * positive: fast_put_wait's rule); anything else, and every wait for
     * room or for a stuck lock, goes to the slow path bound with it, which
     * starts over: reserve_slow(owner, nbytes, codec, timeout). */
    static const char *const names[] = {"nbytes", "codec", "timeout"};
    PyObject *a[3];
    if (nargs > 1) {
        PyErr_SetString(PyExc_TypeError, "reserve() takes 1 positional argument (nbytes); codec and timeout "
                                         "are keyword-only");
        return NULL;
    }
    if (parse_api(args, nargs, kwnames, names, 3, a) < 0) return NULL;
    if (!a[0]) {
        PyErr_SetString(PyExc_TypeError, "reserve() missing required argument: 'nbytes'");
        return NULL;
    }
    double lock_wait;
    if (r->reserve_slow && r->eng.base && PyLong_CheckExact(a[0]) && (!a[1] || PyLong_CheckExact(a[1])) &&
        fast_put_wait(r, Py_True, a[2], &lock_wait)) {
        int overflow = 0, status;
        long long n = PyLong_AsLongLongAndOverflow(a[0], &overflow);
        long codec = a[1] ? PyLong_AsLong(a[1]) : 0;
        if (PyErr_Occurred()) return NULL;
        if (!overflow && n >= 0 && codec >= INT_MIN && codec <= INT_MAX) {
            PyObject *rv = reservation_new(r, (uint64_t)n, (int)codec, lock_wait, !r->fast_put, &status);
            if (rv || !status) return rv;
        }
    }
    PyObject *cd = a[1] ? Py_NewRef(a[1]) : PyLong_FromLong(0);
    if (!cd) return NULL;
    PyObject *cargs[3] = {a[0], cd, a[2] ? a[2] : Py_None};
    PyObject *res = call_slow(r->owner, r->reserve_slow, cargs, 3);
    Py_DECREF(cd);
    return res;
}

/* ---- shmq.Reader.get ---- */

/* One frame from the cursor: a Frame, None (nothing now) or SHMQ_ELOCKED (a
 * group whose lock was not free within the handle's lock wait). */
PyObject *take_one(Cursor *c) { return cursor_take(c, 1, 0, c->ring->eng.lock_wait, NULL, NULL); }

PyObject *Cursor_get_api(Cursor *c, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    /* Reader.get(block=True, timeout=None): a frame in one C call when one is
     * there; otherwise the slow path bound with it: get_slow(owner, block, timeout, first_result). */
    static const char *const names[] = {"block", "timeout"};
    PyObject *a[2];
    if (parse_api(args, nargs, kwnames, names, 2, a) < 0) return NULL;
    if (cursor_check(c) < 0) return NULL;
    PyObject *f = take_one(c);
    if (!f) return NULL;
    if (Py_IS_TYPE(f, c->ring->st->FrameType)) return f;
    uint64_t deadline;
    int parkable = f == Py_None && park_deadline(a[0], a[1], &deadline);
    if (parkable) {
        Py_DECREF(f);
        f = wait_take(c, take_one, Py_None, deadline, a[1]);
        if (!f || Py_IS_TYPE(f, c->ring->st->FrameType)) return f; /* else None or a busy group lock: Python's */
    }
    PyObject *left = parkable ? time_left(a[1], deadline) : Py_NewRef(a[1] ? a[1] : Py_None);
    if (!left) {
        Py_DECREF(f);
        return NULL;
    }
    PyObject *cargs[3] = {a[0] ? a[0] : Py_True, left, f};
    PyObject *res = call_slow(c->owner, c->get_slow, cargs, 3);
    Py_DECREF(left);
    Py_DECREF(f);
    return res;
}

/* bind(reader, get_slow): get_slow(reader, block, timeout, first) completes get_api. */
PyObject *Cursor_bind(Cursor *c, PyObject *args) {
    PyObject *owner, *slow;
    if (!PyArg_ParseTuple(args, "OO", &owner, &slow)) return NULL;
    if (bind_slow(&c->owner, &c->get_slow, owner, slow) < 0) return NULL;
    Py_RETURN_NONE;
}

/* ---- shmq.Queue: put and get on a QueuePort ---- */

typedef struct {
    PyObject_HEAD
    Ring *ring;
    Cursor *cur;
    PyObject *owner;              /* weak reference to the shmq.Queue */
    PyObject *put_slow, *get_slow; /* put_slow(queue, obj, block, timeout); get_slow(queue, block, timeout, got) */
    PyObject *port_of;            /* port_of(queue) -> its port holding it: what this port pickles as */
    PyObject *keep;               /* a strong reference to the queue, set only on a port unpickled
                                     for a bound method (Process(target=q.put)): nothing else holds
                                     that queue.  A cycle, so the port is GC-tracked. */
    long long backlog;            /* the queue's maxsize (-1: unbounded) */
    int fast_put;                 /* 0: every put goes to put_slow (a JoinableQueue counts items first) */
} QueuePort;

/* The pickle of a shmq.Queue item, every buffer kept in-band and counted in
 * st->buffers_seen (a caller that sees the count move hands the object to
 * the Python encoder, which keeps the buffers out of band, uncopied). */
PyObject *dumps_inband(CoreState *st, PyObject *obj) {
    PyObject *dargs[3] = {obj, st->dumps_protocol, st->inband_callback};
    return PyObject_Vectorcall(st->pickle_dumps, dargs, 2, st->dumps_kwnames);
}

/* Queue.put(obj, block=True, timeout=None): bytes as they are, exact builtin
 * values in the values codec (values.c), anything else pickled; written in
 * one C call when there is room and the writer lock is free (or, without a
 * timeout, soon free); anything else (and any object with out-of-band
 * buffers, which the Python encoder keeps uncopied) goes to the queue's
 * put_slow. */
static PyObject *QueuePort_put(QueuePort *q, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    Ring *r = q->ring;
    CoreState *st = r->st;
    static const char *const names[] = {"obj", "block", "timeout"};
    PyObject *a[3];
    if (parse_api(args, nargs, kwnames, names, 3, a) < 0) return NULL;
    if (!a[0]) {
        PyErr_SetString(PyExc_TypeError, "put() missing required argument: 'obj'");
        return NULL;
    }
    double lock_wait;
    if (q->fast_put && r->eng.base && st->pickle_dumps && fast_put_wait(r, a[1], a[2], &lock_wait)) {
        PyObject *data = NULL;
        int codec = SHMQ_CODEC_RAW;
        char stack[VALUES_STACK_BYTES], *enc = NULL;
        Py_ssize_t n = VALUES_NOT_EXACT;
        if (PyBytes_CheckExact(a[0])) {
            data = Py_NewRef(a[0]);
        } else if ((n = values_encode(a[0], stack, sizeof stack, &enc)) >= 0) {
            codec = SHMQ_CODEC_VALUES;
        } else if (n != VALUES_NOT_EXACT) {
            return NULL; /* MemoryError */
        } else {
            /* The callback keeps every buffer in-band and counts it: a
             * count that moved (ours, or another thread's: harmless) sends
             * the object to the Python encoder, which keeps them out of band. */
            unsigned long before = st->buffers_seen;
            data = dumps_inband(st, a[0]);
            if (!data) return NULL; /* unpicklable: at once, as the Python put */
            codec = SHMQ_CODEC_PICKLE;
            if (st->buffers_seen != before) Py_CLEAR(data);
        }
        if ((data || enc) && r->eng.base) { /* (__reduce__ code may have closed the handle) */
            Item item;
            if (enc) {
                load_raw_item(&item, &item.item, enc, (uint64_t)n, r->eng.checksum);
            } else {
                int rc = load_item(&item, &item.item, data, r->eng.checksum);
                Py_DECREF(data);
                if (rc < 0) return NULL;
            }
            int64_t res = eng_write(&r->eng, &item.item, 1, codec, q->backlog, lock_wait, 1, NULL);
            release_items(&item, 1);
            if (enc && enc != stack) PyMem_Free(enc);
            if (res >= 0) Py_RETURN_NONE;
            if (!is_status(res)) return ring_error(r, (int)res);
        } else {
            Py_XDECREF(data);
            if (enc && enc != stack) PyMem_Free(enc);
        }
    }
    PyObject *cargs[3] = {a[0], a[1] ? a[1] : Py_True, a[2] ? a[2] : Py_None};
    return call_slow(q->owner, q->put_slow, cargs, 3);
}

PyObject *Cursor_get_obj(Cursor *c, PyObject *unused) {
    /* The shmq.Queue get path in one call: take one frame (group lock held
     * for the copy only), then decode raw, values and pickle frames after
     * releasing the lock.  Returns the object, EMPTY (nothing now), STUCK (the group
     * lock was not free in time) or UNDECODED (another codec: see .last). */
    if (cursor_check(c) < 0) return NULL;
    CoreState *st = c->ring->st;
    shmq_frame_header h; /* the data alone: no Frame object unless it goes to Python */
    PyObject *d = cursor_take(c, 1, 0, c->ring->eng.lock_wait, &h, NULL);
    if (!d) return NULL;
    if (d == Py_None) {
        Py_DECREF(d);
        return Py_NewRef(st->EMPTY);
    }
    if (PyLong_Check(d)) {
        Py_DECREF(d);
        return Py_NewRef(st->STUCK);
    }
    if (h.codec == SHMQ_CODEC_RAW) return d; /* after the group lock was released */
    if (h.codec == SHMQ_CODEC_VALUES) {
        PyObject *out = values_decode(PyBytes_AS_STRING(d), PyBytes_GET_SIZE(d), &st->keys);
        Py_DECREF(d);
        return out;
    }
    if (h.codec == SHMQ_CODEC_PICKLE && st->pickle_loads) {
        PyObject *out = PyObject_CallOneArg(st->pickle_loads, d);
        Py_DECREF(d);
        return out;
    }
    PyObject *f = make_frame(st, h.seq, h.ts, d, h.codec);
    if (!f) return NULL;
    Py_XSETREF(c->last, f);
    return Py_NewRef(st->UNDECODED);
}

static PyObject *get_obj_take(Cursor *c) { return Cursor_get_obj(c, NULL); }

static PyObject *QueuePort_get(QueuePort *q, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    Cursor *c = q->cur;
    CoreState *st = c->ring->st;
    /* shmq.Queue.get(block=True, timeout=None): the item in one C call when
     * one is there (raw or pickle); otherwise get_slow(queue, block, timeout, what the take found). */
    static const char *const names[] = {"block", "timeout"};
    PyObject *a[2];
    if (parse_api(args, nargs, kwnames, names, 2, a) < 0) return NULL;
    PyObject *block = a[0] ? a[0] : Py_True, *timeout = a[1] ? a[1] : Py_None;
    uint64_t deadline = 0;
    /* a timeout is validated by Python first (even with an item there), unless it is one we can wait on */
    int parkable = block == Py_True && park_deadline(block, timeout, &deadline);
    if ((timeout == Py_None || parkable) && !c->closed_msg) {
        PyObject *o = Cursor_get_obj(c, NULL);
        if (o == st->EMPTY && parkable) {
            Py_DECREF(o);
            o = wait_take(c, get_obj_take, st->EMPTY, deadline, timeout);
        }
        if (!o) return NULL;
        if (o != st->EMPTY && o != st->STUCK && o != st->UNDECODED) return o;
        Py_DECREF(o);
        PyObject *left = parkable ? time_left(timeout, deadline) : Py_NewRef(timeout);
        if (!left) return NULL;
        PyObject *cargs[3] = {block, left, c->last ? st->UNDECODED : st->EMPTY}; /* UNDECODED: Python decodes .last */
        PyObject *res = call_slow(q->owner, q->get_slow, cargs, 3);
        Py_DECREF(left);
        return res;
    }
    PyObject *cargs[3] = {block, timeout, st->EMPTY};
    return call_slow(q->owner, q->get_slow, cargs, 3);
}

static int QueuePort_init(QueuePort *q, PyObject *args, PyObject *kw) {
    /* QueuePort(ring, cursor, queue, put_slow, get_slow, max_backlog, fast_put[, port_of]) */
    PyObject *ring, *cur, *queue, *put_slow, *get_slow, *port_of = NULL;
    long long backlog;
    int fast;
    CoreState *st = PyType_GetModuleState(Py_TYPE((PyObject *)q));
    if (!st) return -1;
    if (!PyArg_ParseTuple(args, "O!O!OOOLp|O", st->RingType, &ring, st->CursorType, &cur, &queue, &put_slow,
                          &get_slow, &backlog, &fast, &port_of))
        return -1;
    if (((Cursor *)cur)->ring != (Ring *)ring) {
        PyErr_SetString(PyExc_ValueError, "the cursor reads another ring");
        return -1;
    }
    if (bind_slow(&q->owner, &q->put_slow, queue, put_slow) < 0) return -1;
    if (!PyCallable_Check(get_slow)) {
        PyErr_SetString(PyExc_TypeError, "the slow path must be callable");
        return -1;
    }
    Py_XSETREF(q->get_slow, Py_NewRef(get_slow));
    Py_XSETREF(q->port_of, Py_XNewRef(port_of));
    Py_XSETREF(q->ring, (Ring *)Py_NewRef(ring));
    Py_XSETREF(q->cur, (Cursor *)Py_NewRef(cur));
    q->backlog = backlog;
    q->fast_put = fast;
    return 0;
}

static int QueuePort_traverse(QueuePort *q, visitproc visit, void *arg) {
    Py_VISIT(Py_TYPE((PyObject *)q));
    Py_VISIT(q->ring);
    Py_VISIT(q->cur);
    Py_VISIT(q->owner);
    Py_VISIT(q->put_slow);
    Py_VISIT(q->get_slow);
    Py_VISIT(q->port_of);
    Py_VISIT(q->keep);
    return 0;
}

static int QueuePort_clear(QueuePort *q) {
    Py_CLEAR(q->keep);
    return 0;
}

static void QueuePort_dealloc(QueuePort *q) {
    PyObject_GC_UnTrack(q);
    Py_XDECREF(q->keep);
    Py_XDECREF(q->port_of);
    Py_XDECREF((PyObject *)q->ring);
    Py_XDECREF((PyObject *)q->cur);
    Py_XDECREF(q->owner);
    Py_XDECREF(q->put_slow);
    Py_XDECREF(q->get_slow);
    PyTypeObject *tp = Py_TYPE((PyObject *)q);
    SHMQ_TP_FREE(tp)((PyObject *)q);
    Py_DECREF(tp);
}

/* q.put and q.get are this port's methods, bound per queue: pickled (a
 * Process target under spawn), the port reduces to port_of(queue), handed in
 * by the queue layer, which returns the unpickled queue's port holding that
 * queue (keep), so the method works as the queue's own. */
static PyObject *QueuePort_reduce(QueuePort *q, PyObject *Py_UNUSED(ignored)) {
    if (!q->port_of) return PyErr_Format(PyExc_TypeError, "cannot pickle a QueuePort bound without port_of");
    PyObject *owner = owner_of(q->owner);
    if (!owner) return NULL;
    return Py_BuildValue("(O(N))", q->port_of, owner);
}

/* _hold(queue): keep `queue` alive as long as this port (see QueuePort_reduce). */
static PyObject *QueuePort_hold(QueuePort *q, PyObject *obj) {
    Py_XSETREF(q->keep, Py_NewRef(obj));
    Py_RETURN_NONE;
}

static PyMethodDef QueuePort_methods[] = {
    {"__reduce__", (PyCFunction)QueuePort_reduce, METH_NOARGS, "pickles as its queue's port (q.put as a Process target)"},
    {"_hold", (PyCFunction)QueuePort_hold, METH_O, "_hold(queue): keep the queue alive as long as this port"},
    {"put", (PyCFunction)(void (*)(void))QueuePort_put, METH_FASTCALL | METH_KEYWORDS,
     "put(obj, block=True, timeout=None) (see shmq.Queue.put)"},
    {"get", (PyCFunction)(void (*)(void))QueuePort_get, METH_FASTCALL | METH_KEYWORDS,
     "get(block=True, timeout=None) -> item (see shmq.Queue.get)"},
    {NULL}};

static PyType_Slot queue_port_slots[] = {
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_init, QueuePort_init},
    {Py_tp_dealloc, QueuePort_dealloc},
    {Py_tp_traverse, QueuePort_traverse},
    {Py_tp_clear, QueuePort_clear},
    {Py_tp_methods, QueuePort_methods},
    {Py_tp_doc, (void *)"A shmq.Queue's put and get in C over its spool's Ring and its group Cursor "
                        "(internal: use shmq.Queue)."},
    {0, NULL}};

PyType_Spec queue_port_spec = {"shmq._core.QueuePort", sizeof(QueuePort), 0,
                               Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE | Py_TPFLAGS_HAVE_GC,
                               queue_port_slots};

/* encode_batch(items, values=False) -> (tuple of frame items, codec), or None:
 * shmq.Queue.put_many's encoder in one call when the batch is of one kind:
 * every item bytes (raw, codec 0), with `values` every item exact builtin
 * values (CODEC_VALUES), or else every item pickled with no out-of-band
 * buffer (codec 1).  None for bytes mixed with objects or a batch with
 * buffers: the Python encoder's (shmq.codec). */
PyObject *queue_encode_batch(PyObject *m, PyObject *args) {
    CoreState *st = PyModule_GetState(m);
    PyObject *items;
    int values = 0;
    if (!PyArg_ParseTuple(args, "O|p", &items, &values)) return NULL;
    if (!st->pickle_dumps) Py_RETURN_NONE;
    PyObject *seq = PySequence_Fast(items, "put_many() needs an iterable of objects");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject *out = PyTuple_New(n);
    if (!out) {
        Py_DECREF(seq);
        return NULL;
    }
    int codec = -1; /* the batch's kind: -1 not yet known, then raw, values or pickle */
    unsigned long before = st->buffers_seen;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *o = PySequence_Fast_GET_ITEM(seq, i), *data = NULL;
        int kind = PyBytes_CheckExact(o)                        ? SHMQ_CODEC_RAW
                   : codec == SHMQ_CODEC_PICKLE || !values ? SHMQ_CODEC_PICKLE
                                                                : SHMQ_CODEC_VALUES;
        if (codec >= 0 && (kind == SHMQ_CODEC_RAW) != (codec == SHMQ_CODEC_RAW))
            goto python; /* bytes and objects: item by item, in Python */
        if (kind == SHMQ_CODEC_VALUES) {
            char stack[VALUES_STACK_BYTES], *enc;
            Py_ssize_t len = values_encode(o, stack, sizeof stack, &enc);
            if (len == VALUES_NOT_EXACT) { /* one item needs pickle: the whole batch is pickled */
                kind = SHMQ_CODEC_PICKLE;
                for (Py_ssize_t k = 0; k < i; k++) {
                    PyObject *again = dumps_inband(st, PySequence_Fast_GET_ITEM(seq, k));
                    if (!again) goto fail;
                    PyObject *old = PyTuple_GET_ITEM(out, k);
                    PyTuple_SET_ITEM(out, k, again); /* (leaves the old item alone) */
                    Py_DECREF(old);
                }
            } else if (len < 0) {
                goto fail;
            } else {
                data = PyBytes_FromStringAndSize(enc, len);
                if (enc != stack) PyMem_Free(enc);
                if (!data) goto fail;
            }
        }
        codec = kind;
        if (kind == SHMQ_CODEC_RAW) data = Py_NewRef(o);
        else if (kind == SHMQ_CODEC_PICKLE && !(data = dumps_inband(st, o))) goto fail;
        PyTuple_SET_ITEM(out, i, data);
        if (st->buffers_seen != before) goto python; /* out-of-band buffers: kept uncopied in Python */
    }
    Py_DECREF(seq);
    return Py_BuildValue("(Ni)", out, codec < 0 ? SHMQ_CODEC_RAW : codec);
python:
    Py_DECREF(out);
    Py_DECREF(seq);
    Py_RETURN_NONE;
fail:
    Py_DECREF(out);
    Py_DECREF(seq);
    return NULL;
}
