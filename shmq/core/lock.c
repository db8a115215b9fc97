/*
 * shmq/core/lock.c: the Lock type (a named semaphore plus a holder word,
 * whose acquire-and-record and clear-and-release are single C calls, so
 * `with lock:` is signal-safe, and whose dead-holder recovery is the
 * engine's; shmq/_lock.py's RecoverableLock subclasses it), the Waiting
 * type (a waiter registration, signal-safe the same way), and the Semaphore
 * type (a spool's named semaphore, opened or created by the engine, which
 * refuses a squatted name).
 */
#include "binding.h"

/* The GIL around the engine's waits (the crash hook is the module state's). */
extern const eng_hooks binding_gil_hooks;

static sem_t *open_sem(const char *name) {
    sem_t *s = sem_open(name, 0);
    if (s == SEM_FAILED) {
        PyErr_SetFromErrnoWithFilename(PyExc_OSError, name);
        return NULL;
    }
    return s;
}

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
    Py_ssize_t token_index, breaks_index; /* recovery: the token and breaks words (-1: none) */
    double unknown_since, unknown_last;   /* the looks of this lock's waits (eng_lock_recover) */
    pthread_mutex_t recover_mu;
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
    int rc = eng_sem_lock(l->sem, wait, &binding_gil_hooks, NULL, l->holder_word, l->holder); /* records the holder at once */
    if (rc == 0) l->owner = PyThread_get_thread_ident();
    if (rc == SHMQ_ECALLBACK) return -1; /* a signal handler raised: nothing is held */
    if (rc < 0) {
        errno = -rc;
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
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

/* A `with lock:` that finds the lock taken spins for it up to LOCK_SPIN_NS
 * (the GIL released) before it sleeps on the semaphore.  Locks are held for
 * one operation: microseconds, or tens of them for a write of 1 MiB under
 * the writer lock, and a zero-copy view's pin taken under the writer lock
 * (shmq/pins.py: groups, overwrite rings) between two puts of a fast
 * producer would sleep and be woken once per frame.  The spin watches the holder word and tries the semaphore only when that
 * reads free, so the holder's release does not contend with the spinner's
 * atomics; the holder is recorded before the GIL is taken back (as
 * eng_sem_lock does).  1: acquired. */
#define LOCK_SPIN_NS 100000ull
static int lock_spin(Lock *l) {
    int got = 0;
    uint64_t *word = l->holder_word, holder = l->holder;
    sem_t *sem = l->sem;
    Py_BEGIN_ALLOW_THREADS
    uint64_t t0 = mono_ns();
    for (unsigned i = 1;; i++) {
        if (!ld_rlx(word) && sem_trywait(sem) == 0) {
            st_rlx(word, holder);
            got = 1;
            break;
        }
        if (!(i & 63) && mono_ns() - t0 > LOCK_SPIN_NS) break;
        cpu_relax();
    }
    Py_END_ALLOW_THREADS
    if (got) l->owner = PyThread_get_thread_ident();
    return got;
}

static PyObject *Lock_enter(Lock *l, PyObject *unused) {
    /* Waits as long as it takes (a spin first: lock_spin); every `wait`
     * seconds without the lock, on_stuck(lock) (Python) may break a dead
     * holder's lock or raise. */
    if (lock_open(l) < 0) return NULL;
    int rc = lock_take(l, 0);
    if (rc < 0) return NULL;
    if (rc == 0 || lock_spin(l)) return Py_NewRef((PyObject *)l);
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

/* The engine's on_recover: the Python callable on_recover(dead_pid). */
static int lock_on_recover(void *ctx, uint32_t dead_pid) {
    PyObject *res = PyObject_CallFunction((PyObject *)ctx, "I", (unsigned int)dead_pid);
    Py_XDECREF(res);
    return res ? 0 : -1;
}

static PyObject *Lock_recover(Lock *l, PyObject *args) {
    /* _recover(fd, recovery_byte, recovery_timeout, me, on_recover) -> True if the dead
     * holder's lock was broken (and released again), False if not: the engine's
     * eng_lock_recover over this lock's words */
    int fd;
    unsigned long long byte, me;
    double timeout;
    PyObject *on_recover;
    if (!PyArg_ParseTuple(args, "iKdKO", &fd, &byte, &timeout, &me, &on_recover)) return NULL;
    if (lock_open(l) < 0) return NULL;
    if (l->token_index < 0) {
        PyErr_SetString(PyExc_ValueError, "this lock has no token word: it cannot be recovered");
        return NULL;
    }
    uint64_t *words = (uint64_t *)l->words.buf;
    eng_lock_ref ref = {l->sem, l->holder_word, words + l->token_index,
                        l->breaks_index >= 0 ? words + l->breaks_index : NULL, fd, byte, timeout,
                        &l->unknown_since, &l->unknown_last, me,
                        on_recover == Py_None ? NULL : lock_on_recover, on_recover, &l->recover_mu,
                        &binding_gil_hooks};
    int rc = eng_lock_recover(&ref);
    if (rc == SHMQ_ECALLBACK) return NULL;
    if (rc < 0) {
        errno = -rc;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    if (rc == 1) l->owner = 0;
    return PyBool_FromLong(rc == 1);
}

static PyObject *Lock_close(Lock *l, PyObject *unused) {
    lock_release_res(l);
    Py_RETURN_NONE;
}

static int Lock_init(Lock *l, PyObject *args, PyObject *kw) {
    /* Lock(sem_name, words, index, holder, wait, on_stuck[, token_index, breaks_index]) --
     * words: a writable u64 buffer; on_stuck: None or a callable taking the lock (an
     * unbound method: a bound one would be a reference cycle through the lock);
     * token_index, breaks_index: the words recovery bumps (-1: none) */
    const char *name;
    PyObject *words, *on_stuck;
    Py_ssize_t index, token_index = -1, breaks_index = -1;
    unsigned long long holder;
    double wait;
    if (!PyArg_ParseTuple(args, "sOnKdO|nn", &name, &words, &index, &holder, &wait, &on_stuck, &token_index,
                          &breaks_index))
        return -1;
    if (on_stuck != Py_None && !PyCallable_Check(on_stuck)) {
        PyErr_SetString(PyExc_TypeError, "on_stuck must be None or a callable taking the lock");
        return -1;
    }
    lock_release_res(l);
    if (PyObject_GetBuffer(words, &l->words, PyBUF_WRITABLE) < 0) return -1;
    l->have_words = 1;
    if (index < 0 || (index + 1) * 8 > l->words.len || ((uintptr_t)l->words.buf % 8) ||
        token_index >= l->words.len / 8 || breaks_index >= l->words.len / 8) {
        lock_release_res(l);
        PyErr_SetString(PyExc_ValueError, "holder word out of range");
        return -1;
    }
    l->holder_word = (uint64_t *)l->words.buf + index;
    l->holder = holder;
    l->wait = wait;
    l->owner = 0;
    l->token_index = token_index;
    l->breaks_index = breaks_index;
    l->unknown_since = 0;
    l->unknown_last = -1e9;
    pthread_mutex_init(&l->recover_mu, NULL);
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
    {"_recover", (PyCFunction)Lock_recover, METH_VARARGS,
     "_recover(fd, recovery_byte, recovery_timeout, me, on_recover) -> True if a dead holder's lock was broken"},
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


/* ---- Semaphore: a spool's named semaphore, opened by the engine ---- */

typedef struct {
    PyObject_HEAD
    sem_t *sem;
    PyObject *name;
} Semaphore;

static int Semaphore_init(Semaphore *s, PyObject *args, PyObject *kw) {
    /* Semaphore(name, initial=0, mode=0o600, owner=-1, group=-1, create=False, existing=False):
     * open (or create) the named semaphore as the engine does, refusing a squatted name;
     * create: exclusively (FileExistsError if the name is taken); existing: only if it
     * exists (FileNotFoundError), unchecked (fsck reading its value). */
    static char *names[] = {"name", "initial", "mode", "owner", "group", "create", "existing", NULL};
    PyObject *name;
    unsigned int initial = 0, mode = 0600;
    long owner = -1, group = -1;
    int create = 0, existing = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "U|IIllpp:Semaphore", names, &name, &initial, &mode, &owner, &group,
                                     &create, &existing))
        return -1;
    int how = create ? ENG_SEM_CREATE : existing ? ENG_SEM_EXISTING : ENG_SEM_OPEN;
    const char *cname = PyUnicode_AsUTF8(name);
    if (!cname) return -1;
    if (s->sem) sem_close(s->sem);
    s->sem = NULL;
    int err = 0;
    sem_t *sem;
    Py_BEGIN_ALLOW_THREADS /* getpwuid_r may ask NSS (a network directory) */
    sem = eng_sem_open(cname, initial, mode, owner, group, how, &err);
    Py_END_ALLOW_THREADS
    if (sem == SEM_FAILED) {
        CoreState *st = PyType_GetModuleState(Py_TYPE((PyObject *)s));
        if (err == SHMQ_ESQUATTED) {
            engine_error(st, NULL, err);
        } else {
            errno = -err;
            PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, name);
        }
        return -1;
    }
    s->sem = sem;
    Py_XSETREF(s->name, Py_NewRef(name));
    return 0;
}

static int sem_open_check(Semaphore *s) {
    if (!s->sem) {
        PyErr_SetString(PyExc_ValueError, "semaphore is closed");
        return -1;
    }
    return 0;
}

static PyObject *Semaphore_acquire(Semaphore *s, PyObject *args) {
    /* acquire(timeout=None) -> True, or False if not within timeout seconds */
    PyObject *timeout = Py_None;
    if (!PyArg_ParseTuple(args, "|O", &timeout)) return NULL;
    if (sem_open_check(s) < 0) return NULL;
    double t = timeout == Py_None ? 1e9 : PyFloat_AsDouble(timeout);
    if (t == -1.0 && PyErr_Occurred()) return NULL;
    for (;;) { /* a wait longer than 1e9 s is waited in pieces */
        int rc = eng_sem_lock(s->sem, t, &binding_gil_hooks, NULL, NULL, 0);
        if (rc == 0) Py_RETURN_TRUE;
        if (rc == SHMQ_ECALLBACK) return NULL;
        if (rc < 0) {
            errno = -rc;
            return PyErr_SetFromErrno(PyExc_OSError);
        }
        if (timeout != Py_None) Py_RETURN_FALSE;
    }
}

static PyObject *Semaphore_release(Semaphore *s, PyObject *unused) {
    if (sem_open_check(s) < 0) return NULL;
    if (sem_post(s->sem) != 0) return PyErr_SetFromErrno(PyExc_OSError);
    Py_RETURN_NONE;
}

static PyObject *Semaphore_close(Semaphore *s, PyObject *unused) {
    if (s->sem) sem_close(s->sem);
    s->sem = NULL;
    Py_RETURN_NONE;
}

static PyObject *Semaphore_get_value(Semaphore *s, void *x) {
    if (sem_open_check(s) < 0) return NULL;
    int v = 0;
    if (sem_getvalue(s->sem, &v) != 0) return PyErr_SetFromErrno(PyExc_OSError);
    return PyLong_FromLong(v);
}

static PyObject *Semaphore_get_name(Semaphore *s, void *x) { return Py_NewRef(s->name ? s->name : Py_None); }

static void Semaphore_dealloc(Semaphore *s) {
    if (s->sem) sem_close(s->sem);
    Py_XDECREF(s->name);
    PyTypeObject *tp = Py_TYPE((PyObject *)s);
    SHMQ_TP_FREE(tp)((PyObject *)s);
    Py_DECREF(tp);
}

static PyGetSetDef Semaphore_getset[] = {
    {"value", (getter)Semaphore_get_value, NULL, "the semaphore's count now", NULL},
    {"name", (getter)Semaphore_get_name, NULL, "its name (\"/shmq.PREFIX.w\")", NULL},
    {NULL}};

static PyMethodDef Semaphore_methods[] = {
    {"acquire", (PyCFunction)Semaphore_acquire, METH_VARARGS,
     "acquire(timeout=None) -> True, False if not within timeout (GIL released while waiting)"},
    {"release", (PyCFunction)Semaphore_release, METH_NOARGS, "post it"},
    {"close", (PyCFunction)Semaphore_close, METH_NOARGS, "close this process's handle (the name stays)"},
    {NULL}};

static PyType_Slot semaphore_slots[] = {
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_init, Semaphore_init},
    {Py_tp_dealloc, Semaphore_dealloc},
    {Py_tp_methods, Semaphore_methods},
    {Py_tp_getset, Semaphore_getset},
    {Py_tp_doc, (void *)"A spool's POSIX named semaphore, opened (or created exclusively) by the engine with the\n"
                        "spool's mode; one another user squatted is refused (shmq.ShmqError)."},
    {0, NULL}};

PyType_Spec semaphore_spec = {"shmq._core.Semaphore", sizeof(Semaphore), 0,
                              Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE, semaphore_slots};
