/*
 * shmq/core/module.c: the module shmq._core -- multi-phase init (PEP 489),
 * its state (PEP 630: one CoreState per module object, so per interpreter),
 * its heap types (from the specs in ring.c, cursor.c, reserve.c, lock.c,
 * api.c, options.c and frame.c) and its functions.
 *
 * Objects keep a pointer to the state (Ring.st; a Cursor, Reservation or
 * QueuePort through its Ring), so the hot paths never look it up.  A type
 * holds its module (PyType_FromModuleAndSpec) and every instance holds its
 * type, so the state outlives every object that points at it.
 *
 * Subinterpreters: declared Py_MOD_PER_INTERPRETER_GIL_SUPPORTED.  No C
 * global holds a Python object; the only process-wide data is the CRC
 * table (filled once under pthread_once, then read-only).  The shared
 * locks are cross-process semaphores, so two interpreters of one process
 * contend for them as two processes do.
 *
 * Free-threaded builds: Py_mod_gil is NOT declared Py_MOD_GIL_NOT_USED, so
 * importing the module there re-enables the GIL (with a RuntimeWarning).
 * Each handle's own fields (a Ring's busy/closing/reserved_by and
 * pre-fault state, a Cursor's seq/pos and unflushed counters) are guarded
 * by the GIL, and the signal safety of a held shared lock relies on no
 * Python code running in between (docs/format.md, "The compiled core").
 */
#include "core.h"

static inline CoreState *state_of(PyObject *m) { return (CoreState *)PyModule_GetState(m); }

int call_crash_hook(CoreState *st, const char *point) {
    if (!st->crash_hook) return 0;
    PyObject *res = PyObject_CallFunction(st->crash_hook, "sO", point, Py_None);
    if (!res) return ST_PYERR;
    Py_DECREF(res);
    return 0;
}

/* set_safety_net(seconds): the longest futex sleep of a get parked in C
 * (shmq._notify hands its SAFETY_NET_S over whenever it is set). */
static PyObject *core_set_safety_net(PyObject *m, PyObject *arg) {
    double s = PyFloat_AsDouble(arg);
    if (s == -1.0 && PyErr_Occurred()) return NULL;
    if (!(s > 0 && s < 3600)) {
        PyErr_SetString(PyExc_ValueError, "the safety net is a number of seconds in (0, 3600)");
        return NULL;
    }
    state_of(m)->safety_net_s = s;
    Py_RETURN_NONE;
}

/* The buffer_callback of dumps_inband: keep the buffer in-band, count it. */
static PyObject *core_inband(PyObject *m, PyObject *buf) {
    state_of(m)->buffers_seen++;
    Py_RETURN_TRUE;
}

static PyObject *core_setup(PyObject *m, PyObject *args) {
    /* setup(SpoolFormatError, pickle.loads, pickle.dumps, protocol, Empty) */
    CoreState *st = state_of(m);
    PyObject *fmt_err, *loads, *dumps, *protocol, *empty;
    if (!PyArg_ParseTuple(args, "OOOOO", &fmt_err, &loads, &dumps, &protocol, &empty)) return NULL;
    Py_XSETREF(st->EmptyError, Py_NewRef(empty));
    Py_XSETREF(st->SpoolFormatError, Py_NewRef(fmt_err));
    Py_XSETREF(st->pickle_loads, Py_NewRef(loads));
    Py_XSETREF(st->pickle_dumps, Py_NewRef(dumps));
    Py_XSETREF(st->dumps_protocol, Py_NewRef(protocol));
    Py_RETURN_NONE;
}

/* encode_batch(items) -> (tuple of frame items, codec), or None.  shmq.Queue.put_many's
 * encoder in one call when the batch is of one kind: every item bytes (raw,
 * codec 0) or every item pickled with no out-of-band buffer (codec 1).  None
 * for a mixed batch or one with buffers: the Python encoder's (shmq.codec). */
static PyObject *core_encode_batch(PyObject *m, PyObject *items) {
    CoreState *st = PyModule_GetState(m);
    if (!st->pickle_dumps) Py_RETURN_NONE;
    PyObject *seq = PySequence_Fast(items, "put_many() needs an iterable of objects");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject *out = PyTuple_New(n);
    if (!out) {
        Py_DECREF(seq);
        return NULL;
    }
    int codec = -1;
    unsigned long before = st->buffers_seen;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *o = PySequence_Fast_GET_ITEM(seq, i), *data;
        int kind = PyBytes_CheckExact(o) ? 0 : 1;
        if (codec >= 0 && kind != codec) goto python; /* mixed: item by item, in Python */
        codec = kind;
        if (kind == 0) {
            data = Py_NewRef(o);
        } else {
            if (!(data = dumps_inband(st, o))) {
                Py_DECREF(out);
                Py_DECREF(seq);
                return NULL;
            }
        }
        PyTuple_SET_ITEM(out, i, data);
        if (st->buffers_seen != before) goto python; /* out-of-band buffers: kept uncopied in Python */
    }
    Py_DECREF(seq);
    return Py_BuildValue("(Ni)", out, codec < 0 ? 0 : codec);
python:
    Py_DECREF(out);
    Py_DECREF(seq);
    Py_RETURN_NONE;
}

static PyObject *core_set_crash_hook(PyObject *m, PyObject *hook) {
    CoreState *st = state_of(m);
    Py_XSETREF(st->crash_hook, hook == Py_None ? NULL : Py_NewRef(hook));
    Py_RETURN_NONE;
}

static PyObject *core_crc32(PyObject *m, PyObject *args) {
    Py_buffer b;
    unsigned int crc = 0;
    if (!PyArg_ParseTuple(args, "y*|I", &b, &crc)) return NULL;
    uint32_t v = crc_update(crc, b.buf, (size_t)b.len);
    PyBuffer_Release(&b);
    return PyLong_FromUnsignedLong(v);
}

/* A spinning waiter's pause between two looks: other processes runnable on this
 * CPU (the writer it waits for) run, and it returns at once when there are none.
 * The GIL is kept: threads of this process go on waiting for it as they did
 * while the spin held it, rather than a yield handing it to a CPU-bound thread
 * for a whole switch interval while the awaited frame comes in. */
static PyObject *core_yield_cpu(PyObject *m, PyObject *unused) {
    sched_yield();
    Py_RETURN_NONE;
}

static PyMethodDef core_methods[] = {
    {"setup", core_setup, METH_VARARGS, "setup(SpoolFormatError, pickle.loads, pickle.dumps, protocol, Empty)"},
    {"set_safety_net", core_set_safety_net, METH_O,
     "set_safety_net(seconds): the longest sleep of a get parked in C (shmq._notify hands its value over)"},
    {"_inband", core_inband, METH_O, "QueuePort.put's pickle buffer_callback: keep the buffer in-band"},
    {"set_crash_hook", core_set_crash_hook, METH_O, "fault-injection harness only"},
    {"encode_batch", core_encode_batch, METH_O,
     "encode_batch(items) -> (tuple of frame items, codec) for a batch of one kind, or None"},
    {"crc32", core_crc32, METH_VARARGS, "crc32(data, crc=0): the frame checksum (equals zlib.crc32)"},
    {"yield_cpu", core_yield_cpu, METH_NOARGS,
     "yield_cpu(): sched_yield() with the GIL held (a spinning waiter's pause between looks)"},
    {NULL}};

static int add_type(PyObject *m, PyType_Spec *spec, PyTypeObject **slot) {
    PyObject *t = PyType_FromModuleAndSpec(m, spec, NULL);
    if (!t) return -1;
    *slot = (PyTypeObject *)t;
    return PyModule_AddType(m, *slot);
}

/* m.name = an unsigned 64-bit constant. */
static int add_u64(PyObject *m, const char *name, unsigned long long value) {
    PyObject *v = PyLong_FromUnsignedLongLong(value);
    if (!v) return -1;
    int rc = PyModule_AddObjectRef(m, name, v);
    Py_DECREF(v);
    return rc;
}

static int core_exec(PyObject *m) {
    CoreState *st = state_of(m);
    crc_init();
    st->safety_net_s = 0.1;
    if (add_type(m, &ring_spec, &st->RingType) < 0 || add_type(m, &cursor_spec, &st->CursorType) < 0 ||
        add_type(m, &reservation_spec, &st->ReservationType) < 0 || add_type(m, &lock_spec, &st->LockType) < 0 ||
        add_type(m, &waiting_spec, &st->WaitingType) < 0 || add_type(m, &queue_port_spec, &st->QueuePortType) < 0 ||
        add_type(m, &deferred_spec, &st->DeferredType) < 0)
        return -1;
    if (!(st->FrameType = frame_type_new())) return -1;
    if (PyModule_AddObjectRef(m, "Frame", (PyObject *)st->FrameType) < 0) return -1;
    if (!(st->dumps_kwnames = Py_BuildValue("(s)", "buffer_callback"))) return -1;
    if (!(st->inband_callback = PyObject_GetAttrString(m, "_inband"))) return -1;
    PyObject *layout = Py_BuildValue(
        "{si si si si si si si si si si si si si si si si si si si si si si si si si si si si si si si si si si si si si si si si si}",
        "HEADER_BYTES", HEADER_BYTES, "FRAME_BYTES", FRAME_BYTES, "ALIGN", ALIGN, "W_NEXT_SEQ", W_NEXT_SEQ,
        "W_NEXT_POS", W_NEXT_POS, "W_FIRST_SEQ", W_FIRST_SEQ, "W_FIRST_POS", W_FIRST_POS, "W_LOCK_HOLDER",
        W_LOCK_HOLDER, "W_PUT_BYTES", W_PUT_BYTES, "W_LAST_PUT_NS", W_LAST_PUT_NS, "W_EVICTED", W_EVICTED,
        "W_HIGH_FRAMES", W_HIGH_FRAMES, "W_HIGH_BYTES", W_HIGH_BYTES, "W_SLOT_HWM", W_SLOT_HWM, "W_RATE", W_RATE,
        "RATE_SECONDS", RATE_SECONDS, "RATE_WORDS", RATE_WORDS, "DOORBELL_BYTE", DOORBELL_BYTE, "SLOT_BYTES",
        SLOT_BYTES, "SLOT_WORDS", SLOT_WORDS, "S_STATE", S_STATE, "S_SEQ", S_SEQ, "S_POS", S_POS, "S_LOST", S_LOST,
        "S_GETS", S_GETS, "S_GET_BYTES", S_GET_BYTES, "S_LAST_GET_NS", S_LAST_GET_NS, "S_DELAY_SUM_NS",
        S_DELAY_SUM_NS, "S_DELAY_MAX_NS", S_DELAY_MAX_NS, "S_LAG_HIGH", S_LAG_HIGH, "S_LAG_LOW", S_LAG_LOW,
        "S_LOCK_HOLDER", S_LOCK_HOLDER, "S_DELAY_COUNT", S_DELAY_COUNT, "W_ALLOC_MIN", W_ALLOC_MIN, "W_ALLOC", W_ALLOC, "W_HOLE_LO", W_HOLE_LO, "W_HOLE_HI", W_HOLE_HI, "W_SEGMENT", W_SEGMENT,
        "W_GROWTHS", W_GROWTHS, "W_DATA_BELL", W_DATA_BELL, "W_SPACE_BELL", W_SPACE_BELL);
    if (!layout) return -1;
    int rc = PyModule_AddObjectRef(m, "LAYOUT", layout);
    Py_DECREF(layout);
    if (rc < 0) return -1;
    /* Limits and texts _format states too (_format.CORE_CONSTANTS): compared at import. */
    if (add_u64(m, "MAX_COUNTER", MAX_COUNTER) < 0 || add_u64(m, "NO_PIN", NO_PIN) < 0 ||
        PyModule_AddStringConstant(m, "RING_ADVICE", RING_ADVICE) < 0)
        return -1;
    if (!(st->EMPTY = PyObject_CallNoArgs((PyObject *)&PyBaseObject_Type)) ||
        !(st->STUCK = PyObject_CallNoArgs((PyObject *)&PyBaseObject_Type)) ||
        !(st->UNDECODED = PyObject_CallNoArgs((PyObject *)&PyBaseObject_Type)))
        return -1;
    if (PyModule_AddObjectRef(m, "EMPTY", st->EMPTY) < 0 || PyModule_AddObjectRef(m, "STUCK", st->STUCK) < 0 ||
        PyModule_AddObjectRef(m, "UNDECODED", st->UNDECODED) < 0)
        return -1;
    if (PyModule_AddIntConstant(m, "LOCK_STUCK", ST_LOCK_STUCK) < 0 ||
        PyModule_AddIntConstant(m, "NO_ROOM", ST_NO_ROOM) < 0 || PyModule_AddIntConstant(m, "SLOW", ST_SLOW) < 0 ||
        PyModule_AddIntConstant(m, "TOO_LARGE", ST_TOO_LARGE) < 0 ||
        PyModule_AddIntConstant(m, "NO_SPACE", ST_NO_SPACE) < 0 ||
        PyModule_AddIntConstant(m, "BACKLOG", ST_BACKLOG) < 0)
        return -1;
    return 0;
}

#define STATE_OBJECTS(X)                                                                                         \
    X(SpoolFormatError) X(crash_hook) X(pickle_loads) X(EmptyError) X(pickle_dumps) X(dumps_protocol)           \
    X(dumps_kwnames) X(inband_callback) X(EMPTY) X(STUCK) X(UNDECODED) X(FrameType) X(RingType) X(CursorType)   \
    X(ReservationType) X(LockType) X(WaitingType) X(QueuePortType) X(DeferredType)

static int core_traverse(PyObject *m, visitproc visit, void *arg) {
    CoreState *st = state_of(m);
    if (!st) return 0;
#define VISIT(f) Py_VISIT(st->f);
    STATE_OBJECTS(VISIT)
#undef VISIT
    return 0;
}

static int core_clear(PyObject *m) {
    CoreState *st = state_of(m);
    if (!st) return 0;
#define CLEAR(f) Py_CLEAR(st->f);
    STATE_OBJECTS(CLEAR)
#undef CLEAR
    return 0;
}

static void core_free(void *m) { core_clear((PyObject *)m); }

static PyModuleDef_Slot core_slots[] = {
    {Py_mod_exec, core_exec},
#ifdef Py_mod_multiple_interpreters
    {Py_mod_multiple_interpreters, Py_MOD_PER_INTERPRETER_GIL_SUPPORTED},
#endif
    /* No Py_mod_gil: the GIL is required (see this file's comment). */
    {0, NULL}};

static struct PyModuleDef core_module = {PyModuleDef_HEAD_INIT,
                                         .m_name = "shmq._core",
                                         .m_doc = "The ring's hot path in C (internal; see docs/format.md).",
                                         .m_size = sizeof(CoreState),
                                         .m_methods = core_methods,
                                         .m_slots = core_slots,
                                         .m_traverse = core_traverse,
                                         .m_clear = core_clear,
                                         .m_free = core_free};

PyMODINIT_FUNC PyInit__core(void) { return PyModuleDef_Init(&core_module); }
