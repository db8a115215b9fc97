/*
 * shmq/core/lock.c: the Lock type (a named semaphore plus a holder word,
 * whose acquire-and-record and clear-and-release are single C calls, so
 * `with lock:` is signal-safe; shmq/_lock.py's RecoverableLock subclasses
 * it) and the Waiting type (a waiter registration, signal-safe the same way).
 */
#include "core.h"

/* ---- Lock: a named semaphore + holder word, whose `with` is signal-safe ---- */

typedef struct {
    PyObject_HEAD
    Py_buffer words;
    int have_words;
    uint64_t *holder_word;
    uint64_t holder;
    sem_t *sem;
    double wait;
    PyObject *on_stuck;
    unsigned long owner; /* thread that holds it through this object, 0: none */
} Lock;

static int lock_open(Lock *l) {
    if (!l->have_words || !l->sem) {
        PyErr_SetString(PyExc_ValueError, "lock is closed");
        return -1;
    }
    return 0;
}

/* 0 acquired, 1 not within wait, -1 exception */
static int lock_take(Lock *l, double wait) {
    int rc = sem_lock_as(l->sem, wait, NULL, l->holder_word, l->holder); /* records the holder at once */
    if (rc == 0) l->owner = PyThread_get_thread_ident();
    return rc;
}

static void lock_give(Lock *l) {
    l->owner = 0;
    st_rlx(l->holder_word, 0);
    sem_post(l->sem);
}

static PyObject *Lock_try_acquire(Lock *l, PyObject *args) {
    double wait = l->wait;
    if (!PyArg_ParseTuple(args, "|d", &wait)) return NULL;
    if (lock_open(l) < 0) return NULL;
    int rc = lock_take(l, wait);
    if (rc < 0) return NULL;
    return PyBool_FromLong(rc == 0);
}

static PyObject *Lock_release(Lock *l, PyObject *unused) {
    if (lock_open(l) < 0) return NULL;
    lock_give(l);
    Py_RETURN_NONE;
}

static PyObject *Lock_release_if_held(Lock *l, PyObject *unused) {
    if (l->have_words && l->sem && l->owner == PyThread_get_thread_ident()) lock_give(l);
    Py_RETURN_NONE;
}

static PyObject *Lock_enter(Lock *l, PyObject *unused) {
    /* Waits as long as it takes; every `wait` seconds without the lock,
     * on_stuck(lock) (Python) may break a dead holder's lock or raise. */
    for (;;) {
        if (lock_open(l) < 0) return NULL;
        int rc = lock_take(l, l->wait);
        if (rc < 0) return NULL;
        if (rc == 0) return Py_NewRef((PyObject *)l);
        if (l->on_stuck && l->on_stuck != Py_None) {
            PyObject *res = PyObject_CallOneArg(l->on_stuck, (PyObject *)l);
            if (!res) return NULL;
            Py_DECREF(res);
        }
    }
}

static PyObject *Lock_exit(Lock *l, PyObject *args) {
    if (l->have_words && l->sem) lock_give(l);
    Py_RETURN_FALSE;
}

static PyObject *Lock_set_holder(Lock *l, PyObject *arg) {
    unsigned long long h = PyLong_AsUnsignedLongLong(arg);
    if (h == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    l->holder = h;
    l->owner = 0;
    Py_RETURN_NONE;
}

static void lock_release_res(Lock *l) {
    if (l->have_words) {
        PyBuffer_Release(&l->words);
        l->have_words = 0;
    }
    if (l->sem) {
        sem_close(l->sem);
        l->sem = NULL;
    }
}

static PyObject *Lock_close(Lock *l, PyObject *unused) {
    lock_release_res(l);
    Py_RETURN_NONE;
}

static int Lock_init(Lock *l, PyObject *args, PyObject *kw) {
    /* Lock(sem_name, words, index, holder, wait, on_stuck) -- words: a writable u64 buffer;
     * on_stuck: None or a callable taking the lock (an unbound method: a bound
     * one would be a reference cycle through the lock) */
    const char *name;
    PyObject *words, *on_stuck;
    Py_ssize_t index;
    unsigned long long holder;
    double wait;
    if (!PyArg_ParseTuple(args, "sOnKdO", &name, &words, &index, &holder, &wait, &on_stuck)) return -1;
    if (on_stuck != Py_None && !PyCallable_Check(on_stuck)) {
        PyErr_SetString(PyExc_TypeError, "on_stuck must be None or a callable taking the lock");
        return -1;
    }
    lock_release_res(l);
    if (PyObject_GetBuffer(words, &l->words, PyBUF_WRITABLE) < 0) return -1;
    l->have_words = 1;
    if (index < 0 || (index + 1) * 8 > l->words.len || ((uintptr_t)l->words.buf % 8)) {
        lock_release_res(l);
        PyErr_SetString(PyExc_ValueError, "holder word out of range");
        return -1;
    }
    l->holder_word = (uint64_t *)l->words.buf + index;
    l->holder = holder;
    l->wait = wait;
    l->owner = 0;
    Py_XSETREF(l->on_stuck, Py_NewRef(on_stuck));
    if (!(l->sem = open_sem(name))) {
        lock_release_res(l);
        return -1;
    }
    return 0;
}

static int Lock_traverse(Lock *l, visitproc visit, void *arg) {
    Py_VISIT(Py_TYPE((PyObject *)l)); /* a heap type: its instances keep it alive */
    Py_VISIT(l->on_stuck);
    return 0;
}

static int Lock_clear(Lock *l) {
    Py_CLEAR(l->on_stuck);
    return 0;
}

static void Lock_dealloc(Lock *l) {
    PyObject_GC_UnTrack(l);
    lock_release_res(l);
    Lock_clear(l);
    PyTypeObject *tp = Py_TYPE((PyObject *)l);
    SHMQ_TP_FREE(tp)((PyObject *)l);
    Py_DECREF(tp);
}

static PyObject *Lock_get_held(Lock *l, void *x) { return PyBool_FromLong(l->owner == PyThread_get_thread_ident()); }

static PyGetSetDef Lock_getset[] = {{"held", (getter)Lock_get_held, NULL, "held by this thread", NULL}, {NULL}};

static PyMethodDef Lock_methods[] = {
    {"try_acquire", (PyCFunction)Lock_try_acquire, METH_VARARGS, "try_acquire(wait) -> True if now held"},
    {"release", (PyCFunction)Lock_release, METH_NOARGS, "clear the holder word and post, in one call"},
    {"release_if_held", (PyCFunction)Lock_release_if_held, METH_NOARGS, "release if this thread holds it"},
    {"set_holder", (PyCFunction)Lock_set_holder, METH_O, "the holder word recorded on acquire (after fork)"},
    {"close", (PyCFunction)Lock_close, METH_NOARGS, "release the buffer and the semaphore"},
    {"__enter__", (PyCFunction)Lock_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)Lock_exit, METH_VARARGS, NULL},
    {NULL}};

static PyType_Slot lock_slots[] = {
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_init, Lock_init},
    {Py_tp_dealloc, Lock_dealloc},
    {Py_tp_traverse, Lock_traverse},
    {Py_tp_clear, Lock_clear},
    {Py_tp_methods, Lock_methods},
    {Py_tp_getset, Lock_getset},
    {Py_tp_doc, (void *)"A cross-process lock on a named semaphore recording its holder in a shared word.\n"
                        "Acquire and release are single C calls, so `with lock:` cannot be interrupted by a\n"
                        "Python signal handler between taking the lock and entering the block."},
    {0, NULL}};

PyType_Spec lock_spec = {"shmq._core.Lock", sizeof(Lock), 0,
                         Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC, lock_slots};

/* ---- Waiting: a waiter registration whose `with` is signal-safe ---- */

typedef struct {
    PyObject_HEAD
    sem_t *sem;
} Waiting;

static int Waiting_init(Waiting *w, PyObject *args, PyObject *kw) {
    const char *name;
    if (!PyArg_ParseTuple(args, "s", &name)) return -1;
    if (w->sem) sem_close(w->sem);
    w->sem = open_sem(name);
    return w->sem ? 0 : -1;
}

static PyObject *Waiting_enter(Waiting *w, PyObject *unused) {
    if (!w->sem) {
        PyErr_SetString(PyExc_ValueError, "closed");
        return NULL;
    }
    sem_post(w->sem); /* register: a full fence before the caller re-checks */
    return Py_NewRef((PyObject *)w);
}

static PyObject *Waiting_exit(Waiting *w, PyObject *args) {
    if (w->sem) sem_trywait(w->sem); /* EAGAIN: the count was reset (fsck --repair) */
    Py_RETURN_FALSE;
}

static PyObject *Waiting_close(Waiting *w, PyObject *unused) {
    if (w->sem) sem_close(w->sem);
    w->sem = NULL;
    Py_RETURN_NONE;
}

static void Waiting_dealloc(Waiting *w) {
    if (w->sem) sem_close(w->sem);
    PyTypeObject *tp = Py_TYPE((PyObject *)w);
    SHMQ_TP_FREE(tp)((PyObject *)w);
    Py_DECREF(tp);
}

static PyMethodDef Waiting_methods[] = {{"__enter__", (PyCFunction)Waiting_enter, METH_NOARGS, NULL},
                                        {"__exit__", (PyCFunction)Waiting_exit, METH_VARARGS, NULL},
                                        {"close", (PyCFunction)Waiting_close, METH_NOARGS, NULL},
                                        {NULL}};

static PyType_Slot waiting_slots[] = {
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_init, Waiting_init},
    {Py_tp_dealloc, Waiting_dealloc},
    {Py_tp_methods, Waiting_methods},
    {Py_tp_doc, (void *)"`with Waiting(name):` counts this waiter in a waiter semaphore for the block; enter and exit\n"
                        "are single C calls, so a signal handler cannot leak or drop a registration."},
    {0, NULL}};

PyType_Spec waiting_spec = {"shmq._core.Waiting", sizeof(Waiting), 0, Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
                            waiting_slots};

