/*
 * shmq/core/frame.c: what a frame becomes in Python (the Frame struct
 * sequence).  Its checksum is the engine's (crc.c).
 */
#include "binding.h"

/* A new Frame (steals `data`), or NULL with an exception. */
PyObject *make_frame(CoreState *st, uint64_t seq, uint64_t ts, PyObject *data, int codec) {
    PyObject *f = PyStructSequence_New(st->FrameType);
    if (!f) {
        Py_DECREF(data);
        return NULL;
    }
    PyObject *s = PyLong_FromUnsignedLongLong(seq), *t = PyLong_FromUnsignedLongLong(ts), *cd = PyLong_FromLong(codec);
    if (!s || !t || !cd) {
        Py_XDECREF(s);
        Py_XDECREF(t);
        Py_XDECREF(cd);
        Py_DECREF(data);
        Py_DECREF(f);
        return NULL;
    }
    PyStructSequence_SET_ITEM(f, 0, s);
    PyStructSequence_SET_ITEM(f, 1, t);
    PyStructSequence_SET_ITEM(f, 2, data);
    PyStructSequence_SET_ITEM(f, 3, cd);
    return f;
}

static PyObject *frame_repr(PyObject *f) {
    PyObject *data = PyStructSequence_GET_ITEM(f, 2);
    PyObject *r = PyObject_Repr(data);
    if (!r) return NULL;
    Py_ssize_t n = PyUnicode_GET_LENGTH(r);
    if (n > 60) Py_SETREF(r, PyUnicode_Substring(r, 0, 60));
    if (!r) return NULL;
    PyObject *out = PyUnicode_FromFormat("Frame(seq=%S, timestamp_ns=%S, data=%U)", PyStructSequence_GET_ITEM(f, 0),
                                         PyStructSequence_GET_ITEM(f, 1), r);
    Py_DECREF(r);
    return out;
}

#ifdef Py_LIMITED_API
static PyObject *frame_repr_method(PyObject *f, PyObject *Py_UNUSED(ignored)) { return frame_repr(f); }
static PyMethodDef frame_repr_def = {"__repr__", frame_repr_method, METH_NOARGS, NULL};
#endif

static PyStructSequence_Field frame_fields[] = {
    {"seq", "Sequence number (strictly increasing)."},
    {"timestamp_ns", "Wall-clock ns when it was put."},
    {"data", "The payload (bytes; a bytearray for numpy and out-of-band pickle frames)."},
    {"codec", "The codec tag of the payload (shmq._format.CODEC_*)."},
    {NULL}};

static PyStructSequence_Desc frame_desc = {
    "shmq.Frame",
    "One message: (seq, timestamp_ns, data), a tuple with named fields; .codec names the payload's encoding.",
    frame_fields, 3};


/* The Frame type of one module instance: a named tuple of (seq,
 * timestamp_ns, data), .codec a hidden field. */
PyTypeObject *frame_type_new(void) {
    PyTypeObject *t = PyStructSequence_NewType(&frame_desc);
    if (!t) return NULL;
#ifndef Py_LIMITED_API
    t->tp_repr = frame_repr;
    PyType_Modified(t);
#else
    /* No slot writes in the limited API: a __repr__ method set on the (mutable)
     * type points its tp_repr at that method (abi.h). */
    PyObject *m = PyDescr_NewMethod(t, &frame_repr_def);
    if (!m || PyObject_SetAttrString((PyObject *)t, "__repr__", m) < 0) {
        Py_XDECREF(m);
        Py_DECREF(t);
        return NULL;
    }
    Py_DECREF(m);
#endif
    return t;
}
