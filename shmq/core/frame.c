/*
 * shmq/core/frame.c: what a frame becomes in Python (the Frame struct
 * sequence) and its checksum (CRC-32, the same as zlib.crc32).
 */
#include "core.h"
#include <pthread.h>

/* ---- CRC-32 (IEEE 802.3, the same as zlib.crc32) ---- */
/* Filled once per process (pthread_once: interpreters may import the module
 * concurrently), read-only afterwards. */
static uint32_t crc_table[256];
static pthread_once_t crc_once = PTHREAD_ONCE_INIT;
static void crc_fill(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        crc_table[i] = c;
    }
}
void crc_init(void) { pthread_once(&crc_once, crc_fill); }

uint32_t crc_update(uint32_t crc, const unsigned char *p, size_t n) {
    crc = ~crc;
    while (n--) crc = crc_table[(crc ^ *p++) & 0xFF] ^ (crc >> 8);
    return ~crc;
}

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
