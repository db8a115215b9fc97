/*
 * shmq/core/module.c: the module shmq._core -- multi-phase init (PEP 489),
 * its state (PEP 630: one CoreState per module object, so per interpreter),
 * its heap types (from the specs in ring.c, cursor.c, reserve.c, lock.c,
 * api.c, options.c and frame.c), its functions, and the hooks through which
 * the engine drops the GIL around its waits.
 *
 * Objects keep a pointer to the state (Ring.st; a Cursor, Reservation or
 * QueuePort through its Ring), so the hot paths never look it up.  A type
 * holds its module (PyType_FromModuleAndSpec) and every instance holds its
 * type, so the state outlives every object that points at it.
 *
 * Subinterpreters: declared Py_MOD_PER_INTERPRETER_GIL_SUPPORTED.  No C
 * global holds a Python object; the only process-wide data is the engine's
 * CRC table (filled once under pthread_once, then read-only).  The shared
 * locks are cross-process semaphores, so two interpreters of one process
 * contend for them as two processes do.
 *
 * Free-threaded builds: the engine carries its own thread safety (engine.h),
 * but this binding still relies on the GIL for its Python-side fields and
 * for signal safety of a held shared lock (no Python code runs in between),
 * so Py_mod_gil is NOT declared Py_MOD_GIL_NOT_USED: importing the module
 * there re-enables the GIL (with a RuntimeWarning).
 */
#include "binding.h"

/* ---- the engine's hooks: the GIL around its waits ---- */

static void *gil_unlock(void) { return PyEval_SaveThread(); }
static void gil_relock(void *saved) { PyEval_RestoreThread((PyThreadState *)saved); }
/* A wait woke: run the signal handlers; nonzero if one raised (Ctrl-C). */
static int gil_interrupted(void) { return PyErr_CheckSignals() < 0; }

const eng_hooks binding_gil_hooks = {gil_unlock, gil_relock, gil_interrupted, NULL, NULL, 0.0};

static int crash_trampoline(void *ctx, const char *point) { return call_crash_hook((CoreState *)ctx, point) < 0; }

static inline CoreState *state_of(PyObject *m) { return (CoreState *)PyModule_GetState(m); }

ValuesKeys *values_keys_of(PyObject *m) { return &state_of(m)->keys; }

int call_crash_hook(CoreState *st, const char *point) {
    if (!st->crash_hook) return 0;
    PyObject *res = PyObject_CallFunction(st->crash_hook, "sO", point, Py_None);
    if (!res) return -1;
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
    state_of(m)->hooks.safety_net_s = s;
    Py_RETURN_NONE;
}

/* The buffer_callback of dumps_inband: keep the buffer in-band, count it. */
static PyObject *core_inband(PyObject *m, PyObject *buf) {
    state_of(m)->buffers_seen++;
    Py_RETURN_TRUE;
}

static PyObject *core_setup(PyObject *m, PyObject *args) {
    /* setup(SpoolFormatError, Empty, ShmqError): the engine's errors as exceptions */
    CoreState *st = state_of(m);
    PyObject *fmt_err, *empty, *base_err;
    if (!PyArg_ParseTuple(args, "OOO", &fmt_err, &empty, &base_err)) return NULL;
    Py_XSETREF(st->ShmqError, Py_NewRef(base_err));
    Py_XSETREF(st->EmptyError, Py_NewRef(empty));
    Py_XSETREF(st->SpoolFormatError, Py_NewRef(fmt_err));
    Py_RETURN_NONE;
}

static PyObject *core_setup_pickle(PyObject *m, PyObject *args) {
    /* setup_pickle(pickle.loads, pickle.dumps, protocol): the Queue port's item codec
     * (shmq.queue hands it over: the spool layer carries bytes) */
    CoreState *st = state_of(m);
    PyObject *loads, *dumps, *protocol;
    if (!PyArg_ParseTuple(args, "OOO", &loads, &dumps, &protocol)) return NULL;
    Py_XSETREF(st->pickle_loads, Py_NewRef(loads));
    Py_XSETREF(st->pickle_dumps, Py_NewRef(dumps));
    Py_XSETREF(st->dumps_protocol, Py_NewRef(protocol));
    Py_RETURN_NONE;
}

static PyObject *core_set_crash_hook(PyObject *m, PyObject *hook) {
    CoreState *st = state_of(m);
    Py_XSETREF(st->crash_hook, hook == Py_None ? NULL : Py_NewRef(hook));
    st->hooks.crash = st->crash_hook ? crash_trampoline : NULL; /* the engine's crash points ask only then */
    Py_RETURN_NONE;
}

static PyObject *core_crc32(PyObject *m, PyObject *args) {
    Py_buffer b;
    unsigned int crc = 0;
    if (!PyArg_ParseTuple(args, "y*|I", &b, &crc)) return NULL;
    uint32_t v = eng_crc(crc, b.buf, (size_t)b.len);
    PyBuffer_Release(&b);
    return PyLong_FromUnsignedLong(v);
}

/* The zero bits among a bitmap's first nbits, least significant bit first: the
 * nulls of an Arrow column from its validity bitmap, without pyarrow's per-column
 * wrapper objects (put_arrow looks at every column of every batch). */
static PyObject *core_count_zero_bits(PyObject *m, PyObject *args) {
    Py_buffer b;
    unsigned long long nbits;
    if (!PyArg_ParseTuple(args, "y*K", &b, &nbits)) return NULL;
    if (nbits > (unsigned long long)b.len * 8) {
        PyBuffer_Release(&b);
        PyErr_Format(PyExc_ValueError, "%llu bits is past the buffer's %zd bytes", nbits, b.len);
        return NULL;
    }
    const unsigned char *p = b.buf;
    size_t whole = (size_t)(nbits / 8), i = 0;
    unsigned long long ones = 0;
    for (; i + 8 <= whole; i += 8) {
        uint64_t w;
        memcpy(&w, p + i, 8);
        ones += (unsigned long long)__builtin_popcountll(w);
    }
    for (; i < whole; i++) ones += (unsigned long long)__builtin_popcount(p[i]);
    if (nbits % 8) ones += (unsigned long long)__builtin_popcount(p[whole] & ((1u << (nbits % 8)) - 1));
    PyBuffer_Release(&b);
    return PyLong_FromUnsignedLongLong(nbits - ones);
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

static PyObject *core_spin_for_frame(PyObject *m, PyObject *arg) {
    unsigned long long n = PyLong_AsUnsignedLongLong(arg);
    if (n == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    return PyFloat_FromDouble((double)eng_spin_ns(n) * 1e-9);
}

static PyMethodDef core_methods[] = {
    {"setup", core_setup, METH_VARARGS, "setup(SpoolFormatError, Empty, ShmqError)"},
    {"setup_pickle", core_setup_pickle, METH_VARARGS, "setup_pickle(pickle.loads, pickle.dumps, protocol)"},
    {"set_safety_net", core_set_safety_net, METH_O,
     "set_safety_net(seconds): the longest sleep of a get parked in C (shmq._notify hands its value over)"},
    {"_inband", core_inband, METH_O, "QueuePort.put's pickle buffer_callback: keep the buffer in-band"},
    {"set_crash_hook", core_set_crash_hook, METH_O, "fault-injection harness only"},
    {"encode_batch", queue_encode_batch, METH_VARARGS,
     "encode_batch(items, values=False) -> (tuple of frame items, codec) for a batch of one kind, or None "
     "(shmq.Queue)"},
    {"values_dumps", values_dumps, METH_O,
     "values_dumps(obj) -> bytes: obj in the values codec (CODEC_VALUES), or None if it is not made only "
     "of exact builtin values"},
    {"values_loads", values_loads, METH_O,
     "values_loads(buffer) -> object: a values-codec payload decoded (ValueError if damaged)"},
    {"crc32", core_crc32, METH_VARARGS, "crc32(data, crc=0): the frame checksum (equals zlib.crc32)"},
    {"copy_cache", core_copy_cache, METH_NOARGS,
     "copy_cache() -> (mappings, bytes): released large copies (LargeCopy) kept for reuse, at most 256 MiB"},
    {"spin_for_frame", core_spin_for_frame, METH_O,
     "spin_for_frame(nbytes) -> seconds a caught-up reader whose last frame was nbytes long spins before it "
     "parks (the engine's rule for its own reads)"},
    {"count_zero_bits", core_count_zero_bits, METH_VARARGS,
     "count_zero_bits(bitmap, nbits) -> the zero bits among the first nbits, least significant bit first "
     "(an Arrow validity bitmap's nulls)"},
    {"yield_cpu", core_yield_cpu, METH_NOARGS,
     "yield_cpu(): sched_yield() with the GIL held (a spinning waiter's pause between looks)"},
    {NULL}};

static int add_type(PyObject *m, PyType_Spec *spec, PyTypeObject **slot) {
    PyObject *t = PyType_FromModuleAndSpec(m, spec, NULL);
    if (!t) return -1;
    *slot = (PyTypeObject *)t;
    return PyModule_AddType(m, *slot);
}

static int core_exec(PyObject *m) {
    CoreState *st = state_of(m);
    st->hooks = binding_gil_hooks;
    st->hooks.crash_ctx = st;
    st->hooks.safety_net_s = 0.1;
    if (add_type(m, &ring_spec, &st->RingType) < 0 || add_type(m, &cursor_spec, &st->CursorType) < 0 ||
        add_type(m, &reservation_spec, &st->ReservationType) < 0 || add_type(m, &lock_spec, &st->LockType) < 0 ||
        add_type(m, &waiting_spec, &st->WaitingType) < 0 || add_type(m, &queue_port_spec, &st->QueuePortType) < 0 ||
        add_type(m, &deferred_spec, &st->DeferredType) < 0 || add_type(m, &semaphore_spec, &st->SemaphoreType) < 0 ||
        add_type(m, &largecopy_spec, &st->LargeCopyType) < 0)
        return -1;
    if (PyModule_AddFunctions(m, inspect_methods) < 0) return -1;
    if (!(st->FrameType = frame_type_new())) return -1;
    if (PyModule_AddObjectRef(m, "Frame", (PyObject *)st->FrameType) < 0) return -1;
    if (!(st->dumps_kwnames = Py_BuildValue("(s)", "buffer_callback"))) return -1;
    if (!(st->str_release = PyUnicode_InternFromString("release"))) return -1;
    if (!(st->inband_callback = PyObject_GetAttrString(m, "_inband"))) return -1;
    if (!(st->EMPTY = PyObject_CallNoArgs((PyObject *)&PyBaseObject_Type)) ||
        !(st->STUCK = PyObject_CallNoArgs((PyObject *)&PyBaseObject_Type)) ||
        !(st->UNDECODED = PyObject_CallNoArgs((PyObject *)&PyBaseObject_Type)))
        return -1;
    if (PyModule_AddObjectRef(m, "EMPTY", st->EMPTY) < 0 || PyModule_AddObjectRef(m, "STUCK", st->STUCK) < 0 ||
        PyModule_AddObjectRef(m, "UNDECODED", st->UNDECODED) < 0)
        return -1;
    /* the engine's statuses, as the writer and the readers return them to Python */
    if (PyModule_AddIntConstant(m, "LOCK_STUCK", SHMQ_ELOCKED) < 0 ||
        PyModule_AddIntConstant(m, "NO_ROOM", SHMQ_EFULL) < 0 || PyModule_AddIntConstant(m, "SLOW", SHMQ_EPINNED) < 0 ||
        PyModule_AddIntConstant(m, "TOO_LARGE", SHMQ_ETOOLARGE) < 0 ||
        PyModule_AddIntConstant(m, "NO_SPACE", SHMQ_ENOSPACE) < 0 ||
        PyModule_AddIntConstant(m, "BACKLOG", SHMQ_EBACKLOG) < 0 ||
        PyModule_AddIntConstant(m, "MAX_SEGMENTS", MAX_SEGS) < 0)
        return -1;
    return 0;
}

#define STATE_OBJECTS(X)                                                                                         \
    X(SpoolFormatError) X(ShmqError) X(crash_hook) X(pickle_loads) X(EmptyError) X(pickle_dumps) X(dumps_protocol)           \
    X(dumps_kwnames) X(str_release) X(inband_callback) X(EMPTY) X(STUCK) X(UNDECODED) X(FrameType) X(RingType) X(CursorType)   \
    X(ReservationType) X(LockType) X(WaitingType) X(QueuePortType) X(DeferredType) X(SemaphoreType) X(LargeCopyType)

static int core_traverse(PyObject *m, visitproc visit, void *arg) {
    CoreState *st = state_of(m);
    if (!st) return 0;
#define VISIT(f) Py_VISIT(st->f);
    STATE_OBJECTS(VISIT)
#undef VISIT
    return values_keys_traverse(&st->keys, visit, arg);
}

static int core_clear(PyObject *m) {
    CoreState *st = state_of(m);
    if (!st) return 0;
#define CLEAR(f) Py_CLEAR(st->f);
    STATE_OBJECTS(CLEAR)
#undef CLEAR
    values_keys_clear(&st->keys);
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
                                         .m_doc = "The Python binding of shmq's engine (internal; see docs/format.md).",
                                         .m_size = sizeof(CoreState),
                                         .m_methods = core_methods,
                                         .m_slots = core_slots,
                                         .m_traverse = core_traverse,
                                         .m_clear = core_clear,
                                         .m_free = core_free};

PyMODINIT_FUNC PyInit__core(void) { return PyModuleDef_Init(&core_module); }
