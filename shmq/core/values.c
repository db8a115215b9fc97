/*
 * shmq/core/values.c: the values codec (CODEC_VALUES) -- shmq.Queue items
 * made only of exact builtin values, written and read without pickle.
 *
 * Why: a small dict took pickle.dumps about 450 ns and pickle.loads about
 * 560 ns here, most of a queue item's cost; an item of exact builtin types
 * needs neither pickle's opcodes nor its memo, and this codec moves one in a
 * fraction of that (docs/benchmarks.md has the figures).  What it does not
 * encode exactly (values.h, VALUES_NOT_EXACT) is pickled as before, so a
 * subclass, an OrderedDict or a bool comes out what it went in.
 *
 * Payload: the version byte VALUES_VERSION, then one value: a tag byte and
 * its body (little-endian, unaligned):
 *   'N' None    'T' True    'F' False
 *   'b' int (int8, 1 byte)   'j' int (int32, 4)   'i' int (int64, 8)
 *   'f' float (8)    'c' complex (2 x 8)
 *   's' str: u8 length, UTF-8    'S' str: u32 length, UTF-8
 *   'y' bytes: u32 length    'Y' bytearray: u32 length
 *   'l' list, 't' tuple, 'e' set, 'z' frozenset: u32 count, the items
 *   'd' dict: u32 count, then key, value, key, value ... (insertion order)
 *
 * Identity: pickle keeps a container reached twice (or a cycle) as one
 * object; this codec would write it twice, so the encoder tracks every
 * mutable container it enters (list, dict, set, bytearray) and answers
 * VALUES_NOT_EXACT on a second visit: such an item is pickled.
 *
 * Decoding treats the payload as hostile (a spool another user can write, a
 * damaged file): each length and count is checked against the bytes left, the
 * depth is bounded by VALUES_MAX_DEPTH, trailing bytes are an error, and
 * nothing is imported or called.  The codec layer still decodes it only under
 * the spool's trust, as a pickle (shmq/codec.py, docs/security.md).
 */
#include "values.h"
#include "abi.h"

#include <stdint.h>
#include <string.h>

#define VALUES_VERSION 1

/* ---- encoding ---- */

#define SEEN_STACK 32 /* a power of two: the open-addressing set of small items */

typedef struct {
    char *buf, *stack;
    Py_ssize_t len, cap;
    void **seen; /* mutable containers entered: open addressing, NULL empty */
    size_t nseen, seen_cap;
    void *seen_stack[SEEN_STACK];
} Enc;

static int grow(Enc *e, Py_ssize_t more) {
    if (more > PY_SSIZE_T_MAX / 2 - e->len) {
        PyErr_NoMemory();
        return -1;
    }
    Py_ssize_t cap = e->cap * 2 > e->len + more ? e->cap * 2 : e->len + more;
    char *b = e->buf == e->stack ? PyMem_Malloc((size_t)cap) : PyMem_Realloc(e->buf, (size_t)cap);
    if (!b) {
        PyErr_NoMemory();
        return -1;
    }
    if (e->buf == e->stack) memcpy(b, e->stack, (size_t)e->len);
    e->buf = b;
    e->cap = cap;
    return 0;
}

/* Room for `n` more bytes; a pointer to them, the length already counted. */
static inline char *take(Enc *e, Py_ssize_t n) {
    if (e->cap - e->len < n && grow(e, n) < 0) return NULL;
    char *p = e->buf + e->len;
    e->len += n;
    return p;
}

static inline size_t slot_of(const void *p, size_t cap) {
    uintptr_t h = (uintptr_t)p >> 4; /* objects are 16-byte aligned */
    h ^= h >> 17;
    return (size_t)(h * 0x9E3779B97F4A7C15ull) & (cap - 1);
}

/* Record container `o`; 1 if it was already there (a second visit), 0, or -1. */
static int seen_before(Enc *e, void *o) {
    if ((e->nseen + 1) * 2 > e->seen_cap) { /* keep the load under half */
        size_t cap = e->seen_cap * 2;
        void **t = PyMem_Calloc(cap, sizeof(void *));
        if (!t) {
            PyErr_NoMemory();
            return -1;
        }
        for (size_t i = 0; i < e->seen_cap; i++) {
            if (!e->seen[i]) continue;
            size_t k = slot_of(e->seen[i], cap);
            while (t[k]) k = (k + 1) & (cap - 1);
            t[k] = e->seen[i];
        }
        if (e->seen != e->seen_stack) PyMem_Free(e->seen);
        e->seen = t;
        e->seen_cap = cap;
    }
    size_t k = slot_of(o, e->seen_cap);
    while (e->seen[k]) {
        if (e->seen[k] == o) return 1;
        k = (k + 1) & (e->seen_cap - 1);
    }
    e->seen[k] = o;
    e->nseen++;
    return 0;
}

static inline int put_u32(Enc *e, char tag, Py_ssize_t n) {
    if ((size_t)n > UINT32_MAX) return VALUES_NOT_EXACT; /* (pickle has no such limit) */
    char *p = take(e, 5);
    if (!p) return -1;
    uint32_t v = (uint32_t)n;
    p[0] = tag;
    memcpy(p + 1, &v, 4);
    return 0;
}

static int put_bytes(Enc *e, char tag, const char *src, Py_ssize_t n) {
    int rc = put_u32(e, tag, n);
    if (rc) return rc;
    char *p = take(e, n);
    if (!p) return -1;
    memcpy(p, src, (size_t)n);
    return 0;
}

static int enc_value(Enc *e, PyObject *o, int depth);

/* The items of a list or tuple (no Python code runs while encoding: a list
 * cannot change under the loop). */
static int enc_seq(Enc *e, PyObject *o, char tag, int depth) {
    int is_list = PyList_CheckExact(o);
    Py_ssize_t n = is_list ? PyList_GET_SIZE(o) : PyTuple_GET_SIZE(o);
    int rc = put_u32(e, tag, n);
    if (rc) return rc;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *x = is_list ? PyList_GET_ITEM(o, i) : PyTuple_GET_ITEM(o, i);
        if ((rc = enc_value(e, x, depth + 1))) return rc;
    }
    return 0;
}

static int enc_dict(Enc *e, PyObject *o, int depth) {
    int rc = put_u32(e, 'd', PyDict_Size(o));
    if (rc) return rc;
    Py_ssize_t pos = 0;
    PyObject *k, *v;
    while (PyDict_Next(o, &pos, &k, &v)) {
        if ((rc = enc_value(e, k, depth + 1)) || (rc = enc_value(e, v, depth + 1))) return rc;
    }
    return 0;
}

static int enc_set(Enc *e, PyObject *o, char tag, int depth) {
    int rc = put_u32(e, tag, PySet_Size(o));
    if (rc) return rc;
    PyObject *it = PyObject_GetIter(o), *x;
    if (!it) return -1;
    while ((x = PyIter_Next(it))) {
        rc = enc_value(e, x, depth + 1);
        Py_DECREF(x);
        if (rc) break;
    }
    Py_DECREF(it);
    if (!rc && PyErr_Occurred()) rc = -1;
    return rc;
}

static int enc_value(Enc *e, PyObject *o, int depth) {
    if (depth > VALUES_MAX_DEPTH) return VALUES_NOT_EXACT;
    if (PyUnicode_CheckExact(o)) {
        Py_ssize_t n;
        const char *s = PyUnicode_AsUTF8AndSize(o, &n);
        if (!s) { /* lone surrogates: pickle writes them (surrogatepass) */
            if (!PyErr_ExceptionMatches(PyExc_UnicodeEncodeError)) return -1;
            PyErr_Clear();
            return VALUES_NOT_EXACT;
        }
        if (n < 256) {
            char *p = take(e, 2 + n);
            if (!p) return -1;
            p[0] = 's';
            p[1] = (char)(unsigned char)n;
            memcpy(p + 2, s, (size_t)n);
            return 0;
        }
        return put_bytes(e, 'S', s, n);
    }
    if (PyLong_CheckExact(o)) {
        int overflow;
        long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
        if (overflow) return VALUES_NOT_EXACT;
        if (v == -1 && PyErr_Occurred()) return -1;
        if (v >= INT8_MIN && v <= INT8_MAX) {
            char *p = take(e, 2);
            if (!p) return -1;
            p[0] = 'b';
            p[1] = (char)(int8_t)v;
        } else if (v >= INT32_MIN && v <= INT32_MAX) {
            char *p = take(e, 5);
            if (!p) return -1;
            int32_t w = (int32_t)v;
            p[0] = 'j';
            memcpy(p + 1, &w, 4);
        } else {
            char *p = take(e, 9);
            if (!p) return -1;
            int64_t w = (int64_t)v;
            p[0] = 'i';
            memcpy(p + 1, &w, 8);
        }
        return 0;
    }
    if (PyFloat_CheckExact(o)) {
        double d = PyFloat_AsDouble(o);
        char *p = take(e, 9);
        if (!p) return -1;
        p[0] = 'f';
        memcpy(p + 1, &d, 8);
        return 0;
    }
    if (o == Py_None || o == Py_True || o == Py_False) {
        char *p = take(e, 1);
        if (!p) return -1;
        *p = o == Py_None ? 'N' : o == Py_True ? 'T' : 'F';
        return 0;
    }
    if (PyDict_CheckExact(o) || PyList_CheckExact(o) || Py_IS_TYPE(o, &PySet_Type) || PyByteArray_CheckExact(o)) {
        int again = seen_before(e, o);
        if (again) return again < 0 ? -1 : VALUES_NOT_EXACT; /* shared or cyclic: pickle keeps identity */
        if (PyDict_CheckExact(o)) return enc_dict(e, o, depth);
        if (PyList_CheckExact(o)) return enc_seq(e, o, 'l', depth);
        if (PyByteArray_CheckExact(o)) return put_bytes(e, 'Y', PyByteArray_AsString(o), PyByteArray_Size(o));
        return enc_set(e, o, 'e', depth);
    }
    if (PyTuple_CheckExact(o)) return enc_seq(e, o, 't', depth);
    if (PyBytes_CheckExact(o)) return put_bytes(e, 'y', PyBytes_AsString(o), PyBytes_Size(o));
    if (PyFrozenSet_CheckExact(o)) return enc_set(e, o, 'z', depth);
    if (PyComplex_CheckExact(o)) {
        double re = PyComplex_RealAsDouble(o), im = PyComplex_ImagAsDouble(o);
        char *p = take(e, 17);
        if (!p) return -1;
        p[0] = 'c';
        memcpy(p + 1, &re, 8);
        memcpy(p + 9, &im, 8);
        return 0;
    }
    return VALUES_NOT_EXACT;
}

Py_ssize_t values_encode(PyObject *obj, char *stack, Py_ssize_t cap, char **out) {
    Enc e = {stack, stack, 0, cap, NULL, 0, SEEN_STACK, {0}};
    e.seen = e.seen_stack;
    int rc = -1;
    char *p = take(&e, 1);
    if (p) {
        *p = VALUES_VERSION;
        rc = enc_value(&e, obj, 0);
    }
    if (e.seen != e.seen_stack) PyMem_Free(e.seen);
    if (rc) {
        if (e.buf != stack) PyMem_Free(e.buf);
        return rc;
    }
    *out = e.buf;
    return e.len;
}

/* ---- decoding ---- */

typedef struct {
    const unsigned char *p, *end;
    ValuesKeys *keys;
} Dec;

static PyObject *damaged(const char *what) {
    PyErr_Format(PyExc_ValueError, "damaged shmq values payload: %s", what);
    return NULL;
}

static inline int need(Dec *d, Py_ssize_t n) { return d->end - d->p >= n; }

/* A u32 length or count after the tag, checked against the bytes left: each
 * of `count` items takes at least `min_each` bytes. */
static int get_count(Dec *d, Py_ssize_t min_each, Py_ssize_t *n) {
    if (!need(d, 4)) return -1;
    uint32_t v;
    memcpy(&v, d->p, 4);
    d->p += 4;
    if ((Py_ssize_t)v > (d->end - d->p) / min_each) return -1;
    *n = (Py_ssize_t)v;
    return 0;
}

static PyObject *dec_value(Dec *d, int depth);

void values_keys_clear(ValuesKeys *k) {
    for (int i = 0; i < VALUES_KEY_SLOTS; i++) Py_CLEAR(k->str[i]);
}

int values_keys_traverse(ValuesKeys *k, visitproc visit, void *arg) {
    for (int i = 0; i < VALUES_KEY_SLOTS; i++) Py_VISIT(k->str[i]);
    return 0;
}

/* A dict key: a short str from the key cache (or decoded into it), else any value. */
static PyObject *dec_key(Dec *d, int depth) {
    if (d->end - d->p < 2 || d->p[0] != 's' || d->p[1] > VALUES_KEY_BYTES || d->end - d->p - 2 < d->p[1])
        return dec_value(d, depth);
    const unsigned char *b = d->p + 2;
    unsigned n = d->p[1], h = n;
    for (unsigned i = 0; i < n; i++) h = h * 31u + b[i];
    h = (h ^ (h >> 8)) & (VALUES_KEY_SLOTS - 1);
    ValuesKeys *k = d->keys;
    d->p = b + n;
    if (k->str[h] && k->len[h] == n && memcmp(k->bytes[h], b, n) == 0) return Py_NewRef(k->str[h]);
    PyObject *s = PyUnicode_DecodeUTF8((const char *)b, n, NULL);
    if (!s) return NULL;
    Py_XSETREF(k->str[h], Py_NewRef(s));
    k->len[h] = (unsigned char)n;
    memcpy(k->bytes[h], b, n);
    return s;
}

static PyObject *dec_items(Dec *d, unsigned char tag, int depth) {
    Py_ssize_t n;
    if (get_count(d, tag == 'd' ? 2 : 1, &n) < 0) return damaged("a count past the end");
    PyObject *c = tag == 'l' ? PyList_New(n) : tag == 't' ? PyTuple_New(n) : tag == 'd' ? PyDict_New()
                : tag == 'e' ? PySet_New(NULL) : PyFrozenSet_New(NULL);
    if (!c) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *x = tag == 'd' && d->keys ? dec_key(d, depth + 1) : dec_value(d, depth + 1);
        if (!x) goto fail;
        if (tag == 'l') {
            PyList_SET_ITEM(c, i, x);
        } else if (tag == 't') {
            PyTuple_SET_ITEM(c, i, x);
        } else if (tag == 'd') {
            PyObject *v = dec_value(d, depth + 1);
            int rc = v ? PyDict_SetItem(c, x, v) : -1; /* an unhashable forged key: TypeError */
            Py_DECREF(x);
            Py_XDECREF(v);
            if (rc < 0) goto fail;
        } else {
            int rc = PySet_Add(c, x); /* (allowed on a frozenset nobody else has seen yet) */
            Py_DECREF(x);
            if (rc < 0) goto fail;
        }
    }
    return c;
fail:
    Py_DECREF(c);
    return NULL;
}

static PyObject *dec_value(Dec *d, int depth) {
    if (depth > VALUES_MAX_DEPTH) return damaged("nested too deep");
    if (!need(d, 1)) return damaged("truncated");
    unsigned char tag = *d->p++;
    Py_ssize_t n;
    switch (tag) {
    case 's':
        if (!need(d, 1)) return damaged("truncated");
        n = *d->p++;
        if (!need(d, n)) return damaged("a str past the end");
        d->p += n;
        return PyUnicode_DecodeUTF8((const char *)d->p - n, n, NULL); /* invalid UTF-8: UnicodeDecodeError */
    case 'S': case 'y': case 'Y':
        if (get_count(d, 1, &n) < 0) return damaged("a length past the end");
        d->p += n;
        if (tag == 'S') return PyUnicode_DecodeUTF8((const char *)d->p - n, n, NULL);
        if (tag == 'y') return PyBytes_FromStringAndSize((const char *)d->p - n, n);
        return PyByteArray_FromStringAndSize((const char *)d->p - n, n);
    case 'b':
        if (!need(d, 1)) return damaged("truncated");
        return PyLong_FromLong((long)(int8_t)*d->p++);
    case 'j': {
        if (!need(d, 4)) return damaged("truncated");
        int32_t v;
        memcpy(&v, d->p, 4);
        d->p += 4;
        return PyLong_FromLong((long)v);
    }
    case 'i': case 'f': {
        if (!need(d, 8)) return damaged("truncated");
        int64_t v;
        double f;
        memcpy(tag == 'i' ? (void *)&v : (void *)&f, d->p, 8);
        d->p += 8;
        return tag == 'i' ? PyLong_FromLongLong((long long)v) : PyFloat_FromDouble(f);
    }
    case 'c': {
        if (!need(d, 16)) return damaged("truncated");
        double re, im;
        memcpy(&re, d->p, 8);
        memcpy(&im, d->p + 8, 8);
        d->p += 16;
        return PyComplex_FromDoubles(re, im);
    }
    case 'N': return Py_NewRef(Py_None);
    case 'T': return Py_NewRef(Py_True);
    case 'F': return Py_NewRef(Py_False);
    case 'l': case 't': case 'd': case 'e': case 'z':
        return dec_items(d, tag, depth);
    default:
        return damaged("an unknown tag");
    }
}

PyObject *values_decode(const char *buf, Py_ssize_t n, ValuesKeys *keys) {
    if (n < 1) return damaged("empty");
    if ((unsigned char)buf[0] != VALUES_VERSION)
        return PyErr_Format(PyExc_ValueError, "shmq values payload of version %d: this shmq reads version %d "
                            "(a newer shmq wrote it)", (unsigned char)buf[0], VALUES_VERSION);
    Dec d = {(const unsigned char *)buf + 1, (const unsigned char *)buf + n, keys};
    PyObject *o = dec_value(&d, 0);
    if (o && d.p != d.end) {
        Py_DECREF(o);
        return damaged("bytes after the value");
    }
    return o;
}

/* ---- the module functions ---- */

PyObject *values_dumps(PyObject *Py_UNUSED(module), PyObject *obj) {
    char stack[VALUES_STACK_BYTES], *out;
    Py_ssize_t n = values_encode(obj, stack, sizeof stack, &out);
    if (n == VALUES_NOT_EXACT) Py_RETURN_NONE;
    if (n < 0) return NULL;
    PyObject *b = PyBytes_FromStringAndSize(out, n);
    if (out != stack) PyMem_Free(out);
    return b;
}

PyObject *values_loads(PyObject *module, PyObject *buf) {
    Py_buffer v;
    if (PyObject_GetBuffer(buf, &v, PyBUF_SIMPLE) < 0) return NULL;
    PyObject *o = values_decode(v.buf, v.len, values_keys_of(module));
    PyBuffer_Release(&v);
    return o;
}
