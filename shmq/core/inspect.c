/*
 * shmq/core/inspect.c: the engine's inspection and recovery functions and
 * its process identity, exposed to Python as module functions over a
 * mapping (an mmap object or any buffer): frame headers, the oldest frame,
 * the control-word checks and the writer-death repair that shmq.ring, fsck
 * (shmq.verify), repair and the dump tools share with the engine, and the
 * holder words, liveness checks and OFD locks of shmq._lock.  Read-only but
 * for repair_control, which writes the control words (its caller holds the
 * writer lock).
 */
#include "binding.h"

/* A buffer of `o` of at least `need` bytes (writable: for repair).  0, or -1. */
static int get_view(PyObject *o, Py_buffer *b, uint64_t need, int writable) {
    if (PyObject_GetBuffer(o, b, writable ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0) return -1;
    if ((uint64_t)b->len < need || ((uintptr_t)b->buf % 8)) {
        PyBuffer_Release(b);
        PyErr_SetString(PyExc_ValueError, "the buffer does not hold that much of a spool (or is misaligned)");
        return -1;
    }
    return 0;
}

static PyObject *hit_tuple(const eng_hit *h) {
    return Py_BuildValue("(KKKKKKKK)", h->seq, h->pos, h->stored, h->length, h->ts, h->crc, h->flags, h->codec);
}

/* The ring of `size` bytes at offset `base` of buffer `o` (a header decoder's
 * arguments, checked: a ring size, inside the buffer).  0, or -1 with an exception. */
static int ring_view(PyObject *o, unsigned long long base, unsigned long long size, Py_buffer *b) {
    if (size < SHMQ_FRAME_BYTES || size % SHMQ_ALIGN) {
        PyErr_SetString(PyExc_ValueError, "not a ring size");
        return -1;
    }
    if (base > UINT64_MAX - size) { /* base + size would wrap past get_view's bound */
        PyErr_SetString(PyExc_ValueError, "the ring's offset and size overflow");
        return -1;
    }
    return get_view(o, b, base + size, 0);
}

static PyObject *core_header_at(PyObject *m, PyObject *args) {
    /* header_at(buf, base, size, pos, checked=True) -> (seq, pos, stored, length, ts,
     * crc, flags, codec), or None if checked and its lengths leave the ring */
    PyObject *o;
    unsigned long long base, size, pos;
    int checked = 1;
    if (!PyArg_ParseTuple(args, "OKKK|p", &o, &base, &size, &pos, &checked)) return NULL;
    Py_buffer b;
    if (ring_view(o, base, size, &b) < 0) return NULL;
    eng_hit h;
    eng_header_at((const char *)b.buf + base, size, pos, &h);
    PyBuffer_Release(&b);
    if (checked && !h.sane) Py_RETURN_NONE;
    return hit_tuple(&h);
}

static PyObject *core_frame_at(PyObject *m, PyObject *args) {
    /* frame_at(buf, base, size, seq, pos) -> the header tuple of data frame seq at
     * cursor pos (past up to three pads), or None: a header whose lengths leave the
     * ring, a fourth pad, or another frame's.  Ring.frame_at's walk in one call: a
     * zero-copy read decodes its frame's header here, not in a Python loop. */
    PyObject *o;
    unsigned long long base, size, seq, pos;
    if (!PyArg_ParseTuple(args, "OKKKK", &o, &base, &size, &seq, &pos)) return NULL;
    Py_buffer b;
    if (ring_view(o, base, size, &b) < 0) return NULL;
    eng_hit h;
    int found = 0;
    for (int k = 0; k < 4; k++) {
        eng_header_at((const char *)b.buf + base, size, pos, &h);
        if (!h.sane) break;
        if (!(h.flags & SHMQ_FLAG_PAD)) {
            found = h.seq == seq;
            break;
        }
        pos = h.pos + h.stored;
    }
    PyBuffer_Release(&b);
    if (!found) Py_RETURN_NONE;
    return hit_tuple(&h);
}

static PyObject *core_first_cursor(PyObject *m, PyObject *args) {
    /* first_cursor(buf, ring_offset, ring_bytes) -> (seq, pos) of the oldest frame, or
     * None (no consistent pair: corrupt) */
    PyObject *o;
    unsigned long long off, size;
    if (!PyArg_ParseTuple(args, "OKK", &o, &off, &size)) return NULL;
    Py_buffer b;
    if (get_view(o, &b, off + size > SHMQ_HEADER_BYTES ? off + size : SHMQ_HEADER_BYTES, 0) < 0) return NULL;
    uint64_t seq, pos;
    int rc = eng_first_cursor((uint64_t *)b.buf, (const char *)b.buf + off, size, &seq, &pos);
    PyBuffer_Release(&b);
    if (rc < 0) Py_RETURN_NONE;
    return Py_BuildValue("(KK)", seq, pos);
}

/* "a\nb" -> ["a", "b"] ("" -> []). */
static PyObject *lines(const char *text) {
    PyObject *s = PyUnicode_FromString(text);
    if (!s) return NULL;
    PyObject *out = PyUnicode_GET_LENGTH(s) ? PyUnicode_Splitlines(s, 0) : PyList_New(0);
    Py_DECREF(s);
    return out;
}

static PyObject *core_control_problems(PyObject *m, PyObject *args) {
    /* control_problems(buf, ring_bytes) -> [problem, ...] with the control words (one
     * look: a caller re-reads a few times before it believes one) */
    PyObject *o;
    unsigned long long size;
    if (!PyArg_ParseTuple(args, "OK", &o, &size)) return NULL;
    Py_buffer b;
    if (get_view(o, &b, SHMQ_HEADER_BYTES, 0) < 0) return NULL;
    char msg[1024];
    eng_control_problems((const uint64_t *)b.buf, size, msg, sizeof msg);
    PyBuffer_Release(&b);
    return lines(msg);
}

static PyObject *core_repair_control(PyObject *m, PyObject *args) {
    /* repair_control(buf, ring_offset, ring_bytes, drop_unreadable) -> (words changed, or -1
     * if the ring was unreadable; [what was done]) -- the writer lock held by the caller */
    PyObject *o;
    unsigned long long off, size;
    int drop;
    if (!PyArg_ParseTuple(args, "OKKp", &o, &off, &size, &drop)) return NULL;
    Py_buffer b;
    if (get_view(o, &b, off + size, 1) < 0) return NULL;
    char msg[1024];
    int rc = eng_repair_control((uint64_t *)b.buf, (const char *)b.buf + off, size, drop, msg, sizeof msg);
    PyBuffer_Release(&b);
    PyObject *done = lines(msg);
    return done ? Py_BuildValue("(iN)", rc, done) : NULL;
}

static PyObject *core_holder_word(PyObject *m, PyObject *unused) {
    return PyLong_FromUnsignedLongLong(eng_holder_word());
}

static PyObject *core_process_start(PyObject *m, PyObject *arg) {
    long pid = PyLong_AsLong(arg);
    if (pid == -1 && PyErr_Occurred()) return NULL;
    return PyLong_FromUnsignedLongLong(pid > 0 && pid <= INT_MAX ? eng_process_start((int)pid) : 0);
}

static PyObject *core_process_alive(PyObject *m, PyObject *args) {
    /* process_alive(pid, start=None) -> bool */
    long long pid;
    PyObject *start = Py_None;
    if (!PyArg_ParseTuple(args, "L|O", &pid, &start)) return NULL;
    unsigned long long s = 0;
    if (start != Py_None && (s = PyLong_AsUnsignedLongLongMask(start)) == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    if (pid <= 0 || pid > INT_MAX) Py_RETURN_FALSE;
    int alive;
    Py_BEGIN_ALLOW_THREADS
    alive = eng_process_alive((int)pid, s, start != Py_None);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(alive);
}

static PyObject *core_sem_unlink(PyObject *m, PyObject *arg) {
    /* sem_unlink(name): unlink a named semaphore; a missing one is fine */
    const char *name = PyUnicode_AsUTF8(arg);
    if (!name) return NULL;
    int rc = eng_sem_unlink(name);
    if (rc < 0) {
        errno = -rc;
        return PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, arg);
    }
    Py_RETURN_NONE;
}

static PyObject *core_ofd_lock(PyObject *m, PyObject *args) {
    /* ofd_lock(fd, byte, exclusive, wait) -> False if another holder conflicts */
    int fd, exclusive, wait, rc;
    unsigned long long byte;
    if (!PyArg_ParseTuple(args, "iKpp", &fd, &byte, &exclusive, &wait)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    rc = eng_ofd_lock(fd, byte, exclusive, wait);
    Py_END_ALLOW_THREADS
    if (rc < 0) {
        errno = -rc;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyBool_FromLong(rc == 0);
}

static PyObject *core_ofd_unlock(PyObject *m, PyObject *args) {
    int fd;
    unsigned long long byte;
    if (!PyArg_ParseTuple(args, "iK", &fd, &byte)) return NULL;
    int rc = eng_ofd_unlock(fd, byte);
    if (rc < 0) {
        errno = -rc;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_RETURN_NONE;
}

static PyObject *core_ofd_locked_by_other(PyObject *m, PyObject *args) {
    int fd;
    unsigned long long byte;
    if (!PyArg_ParseTuple(args, "iK", &fd, &byte)) return NULL;
    int rc = eng_ofd_locked_by_other(fd, byte);
    if (rc < 0) {
        errno = -rc;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyBool_FromLong(rc);
}

static PyObject *core_hold_handle_lock(PyObject *m, PyObject *args) {
    /* hold_handle_lock(fd, wait_s) -> False if still held exclusively after wait_s */
    int fd;
    double wait_s;
    if (!PyArg_ParseTuple(args, "id", &fd, &wait_s)) return NULL;
    int rc = eng_hold_handle_lock(fd, wait_s, &binding_gil_hooks); /* the GIL dropped while it polls */
    if (rc == SHMQ_ECALLBACK) return NULL;                           /* a signal handler raised */
    if (rc < 0) {
        errno = -rc;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyBool_FromLong(rc == 0);
}

PyMethodDef inspect_methods[] = {
    {"header_at", core_header_at, METH_VARARGS,
     "header_at(buf, base, size, pos, checked=True) -> the frame header at/after ring position pos, or None"},
    {"frame_at", core_frame_at, METH_VARARGS,
     "frame_at(buf, base, size, seq, pos) -> the header of data frame seq at cursor pos (past pads), or None"},
    {"first_cursor", core_first_cursor, METH_VARARGS,
     "first_cursor(buf, ring_offset, ring_bytes) -> (seq, pos) of the oldest frame, or None"},
    {"control_problems", core_control_problems, METH_VARARGS,
     "control_problems(buf, ring_bytes) -> [problem, ...] of the control words"},
    {"repair_control", core_repair_control, METH_VARARGS,
     "repair_control(buf, ring_offset, ring_bytes, drop_unreadable) -> (changed, [actions]) (writer lock held)"},
    {"holder_word", core_holder_word, METH_NOARGS, "this process's lock holder word: pid | start stamp << 32"},
    {"process_start", core_process_start, METH_O, "process_start(pid) -> its start stamp (cs since boot + boot salt), 0"},
    {"process_alive", core_process_alive, METH_VARARGS, "process_alive(pid, start=None) -> bool"},
    {"sem_unlink", core_sem_unlink, METH_O, "sem_unlink(name): unlink a named semaphore (missing: fine)"},
    {"ofd_lock", core_ofd_lock, METH_VARARGS, "ofd_lock(fd, byte, exclusive, wait) -> False on a conflict"},
    {"ofd_unlock", core_ofd_unlock, METH_VARARGS, "ofd_unlock(fd, byte)"},
    {"hold_handle_lock", core_hold_handle_lock, METH_VARARGS,
     "hold_handle_lock(fd, wait_s) -> False if another process held it exclusively all along"},
    {"ofd_locked_by_other", core_ofd_locked_by_other, METH_VARARGS,
     "ofd_locked_by_other(fd, byte) -> True if another open file description locks it"},
    {NULL}};
