/*
 * shmq/core/values.h: the values codec (CODEC_VALUES), the whole of its
 * interface: exact builtin values (None, bool, 64-bit int, float, complex,
 * str, bytes, bytearray, and list, tuple, dict, set, frozenset of them) to a
 * compact payload and back, for shmq.Queue items (values.c has the format).
 *
 * Binding side only: the Queue port (api.c), the batch encoder and the
 * module functions (module.c) and the object-mode take (cursor.c) call it;
 * the engine (placement, reads, waits) never does.  Needs the GIL.
 */
#ifndef SHMQ_CORE_VALUES_H
#define SHMQ_CORE_VALUES_H

#include <Python.h>

/* values_encode's answer for an object it does not encode (no exception set):
 * a subclass, an OrderedDict, an int past 64 bits, any other type, a
 * container reached twice (pickle keeps that identity), nesting deeper than
 * VALUES_MAX_DEPTH, a str with lone surrogates.  The caller pickles it. */
#define VALUES_NOT_EXACT (-2)
#define VALUES_MAX_DEPTH 64
/* A caller's stack buffer of this size holds every small item's payload. */
#define VALUES_STACK_BYTES 1024

/* The str keys of decoded dicts, kept between items (one per module state):
 * the items of a queue repeat their keys, and a key found here is neither
 * decoded nor hashed again (a small dict decodes in about 2/3 of the time).
 * A key of up to VALUES_KEY_BYTES UTF-8 bytes, by a hash of its bytes; a
 * slot holds the last key that hashed there. */
#define VALUES_KEY_SLOTS 256
#define VALUES_KEY_BYTES 32
typedef struct {
    PyObject *str[VALUES_KEY_SLOTS];
    unsigned char len[VALUES_KEY_SLOTS];
    char bytes[VALUES_KEY_SLOTS][VALUES_KEY_BYTES];
} ValuesKeys;
void values_keys_clear(ValuesKeys *k);
int values_keys_traverse(ValuesKeys *k, visitproc visit, void *arg);
ValuesKeys *values_keys_of(PyObject *module); /* the module state's (module.c) */

/* Encode `obj` into `stack` (`cap` bytes) or, when it does not fit, into a
 * PyMem buffer.  Returns the payload's length with *out pointing at it (the
 * caller PyMem_Free()s it when *out != stack), VALUES_NOT_EXACT, or -1 with
 * an exception (MemoryError).  Runs no Python code. */
Py_ssize_t values_encode(PyObject *obj, char *stack, Py_ssize_t cap, char **out);

/* The value a payload of `n` bytes holds: a new reference, or NULL with
 * ValueError (a damaged or forged payload: every length, count and depth is
 * checked; nothing is read past buf + n) or MemoryError.  Runs no Python code
 * beyond hashing the builtin keys and set items it builds.  `keys`: the
 * module state's key cache. */
PyObject *values_decode(const char *buf, Py_ssize_t n, ValuesKeys *keys);

/* The module functions (module.c lists them): values_dumps(obj) -> bytes or
 * None (not exact), values_loads(buffer) -> object. */
PyObject *values_dumps(PyObject *module, PyObject *obj);
PyObject *values_loads(PyObject *module, PyObject *buf);

#endif
