/*
 * shmq/core/abi.h: what lets the core build against the stable ABI
 * (Py_LIMITED_API, an abi3 extension) as well as against the full C API.
 *
 * Without Py_LIMITED_API (the default build and the wheels) this header
 * only defines the few SHMQ_* accessors below as exactly what the sources
 * used before, so the compiled code is unchanged.  With
 * -DPy_LIMITED_API=0x030c0000 (SHMQ_LIMITED_API=1, see setup.py and
 * docs/install.md, "Stable ABI (abi3)") it maps the macros the core uses
 * that the limited API lacks onto their limited-API functions, so the
 * other files need no #ifdef.  The variant exists to be measured (issue 27):
 * the macros become calls with argument checks, and struct fields are read
 * through PyType_GetSlot.
 *
 * Why 3.12 and not 3.11: the entry points forward to Python with
 * PyObject_Vectorcall, which (with vectorcallfunc and
 * PY_VECTORCALL_ARGUMENTS_OFFSET) is in the limited API only from 3.12
 * (Include/abstract.h: "Py_LIMITED_API+0 >= 0x030C0000"); 3.11's headers
 * do not declare it at all.  An abi3 build is therefore cp312-abi3, and
 * 3.11 keeps a version-specific wheel.
 */
#ifndef SHMQ_CORE_ABI_H
#define SHMQ_CORE_ABI_H

#ifndef Py_LIMITED_API

/* ---- full C API: the accessors are the plain struct reads ---- */
#define SHMQ_TP_FREE(tp) ((tp)->tp_free)
/* PyErr_Format(exc, "<msg> <type name of o>") */
#define SHMQ_ERR_TYPE_NAME(exc, msg, o) PyErr_Format((exc), msg " %.100s", Py_TYPE(o)->tp_name)
/* The items of a PySequence_Fast result: its item array, read by index. */
typedef PyObject **shmq_fast_items;
#define SHMQ_FAST_ITEMS(seq) PySequence_Fast_ITEMS(seq)
#define SHMQ_FAST_AT(items, k) ((items)[k])

#else /* Py_LIMITED_API */

#if Py_LIMITED_API + 0 < 0x030c0000
#error "shmq's core needs Py_LIMITED_API >= 0x030c0000 (PyObject_Vectorcall is limited API from 3.12)"
#endif

#include <stdio.h> /* vsnprintf: Python.h includes it only for the full API */

#define SHMQ_TP_FREE(tp) ((freefunc)PyType_GetSlot((tp), Py_tp_free))
/* PyType_GetName: the short name (tp_name after its last dot); PyErr_Format's
 * %U holds its own reference while formatting. */
static inline void shmq_err_type_name(PyObject *exc, const char *msg, PyObject *o) {
    PyObject *name = PyType_GetName(Py_TYPE(o));
    if (!name) return;
    PyErr_Format(exc, "%s %.100U", msg, name);
    Py_DECREF(name);
}
#define SHMQ_ERR_TYPE_NAME(exc, msg, o) shmq_err_type_name((exc), msg, (PyObject *)(o))
/* A PySequence_Fast result is a list or a tuple.  Its size and item macros are
 * not limited API, and from 3.14 the limited headers no longer define them
 * (Include/cpython/abstract.h): the lists' and tuples' checked accessors. */
#ifndef PySequence_Fast_GET_SIZE
#define PySequence_Fast_GET_SIZE(o) (PyList_Check(o) ? PyList_Size(o) : PyTuple_Size(o))
#endif
#ifndef PySequence_Fast_GET_ITEM
#define PySequence_Fast_GET_ITEM(o, i) (PyList_Check(o) ? PyList_GetItem((o), (i)) : PyTuple_GetItem((o), (i)))
#endif
/* No item array in the limited API: the sequence itself, one checked read per item. */
typedef PyObject *shmq_fast_items;
#define SHMQ_FAST_ITEMS(seq) (seq)
#define SHMQ_FAST_AT(items, k) PySequence_Fast_GET_ITEM((items), (k))

/* Py_SETREF / Py_XSETREF, as Include/cpython/object.h defines them. */
#define Py_SETREF(dst, src)                                                                        \
    do {                                                                                           \
        PyObject **shmq_ptr_ = (PyObject **)&(dst);                                                \
        PyObject *shmq_tmp_ = *shmq_ptr_;                                                          \
        *shmq_ptr_ = (PyObject *)(src);                                                            \
        Py_DECREF(shmq_tmp_);                                                                      \
    } while (0)
#define Py_XSETREF(dst, src)                                                                       \
    do {                                                                                           \
        PyObject **shmq_ptr_ = (PyObject **)&(dst);                                                \
        PyObject *shmq_tmp_ = *shmq_ptr_;                                                          \
        *shmq_ptr_ = (PyObject *)(src);                                                            \
        Py_XDECREF(shmq_tmp_);                                                                     \
    } while (0)

/* Tuples, lists, bytes: the checked functions.  Every use in the core has
 * a valid index and the right type (callers check), so the checks never fail. */
#define PyTuple_GET_SIZE(op) PyTuple_Size((PyObject *)(op))
#define PyTuple_GET_ITEM(op, i) PyTuple_GetItem((PyObject *)(op), (i))
#define PyList_GET_SIZE(op) PyList_Size((PyObject *)(op))
#define PyList_GET_ITEM(op, i) PyList_GetItem((PyObject *)(op), (i))
/* The *_SET_ITEM macros steal v and leave the old item alone (the core
 * either fills a new container or releases the old item itself);
 * Py{Tuple,List}_SetItem release it, so hold one reference more first. */
static inline void shmq_tuple_set_item(PyObject *t, Py_ssize_t i, PyObject *v) {
    Py_XINCREF(PyTuple_GetItem(t, i));
    (void)PyTuple_SetItem(t, i, v);
}
static inline void shmq_list_set_item(PyObject *l, Py_ssize_t i, PyObject *v) {
    Py_XINCREF(PyList_GetItem(l, i));
    (void)PyList_SetItem(l, i, v);
}
#define PyTuple_SET_ITEM(op, i, v) shmq_tuple_set_item((PyObject *)(op), (i), (PyObject *)(v))
#define PyList_SET_ITEM(op, i, v) shmq_list_set_item((PyObject *)(op), (i), (PyObject *)(v))
#define PyBytes_AS_STRING(op) PyBytes_AsString((PyObject *)(op))
#define PyBytes_GET_SIZE(op) PyBytes_Size((PyObject *)(op))
#define PyByteArray_AS_STRING(op) PyByteArray_AsString((PyObject *)(op))
#define PyStructSequence_GET_ITEM(op, i) PyStructSequence_GetItem((PyObject *)(op), (i))
#define PyStructSequence_SET_ITEM(op, i, v) PyStructSequence_SetItem((PyObject *)(op), (i), (v))

/* Strings: PyUnicode_AsUTF8 is not limited API in 3.12 nor in 3.13
 * (Include/cpython/unicodeobject.h); PyUnicode_AsUTF8AndSize is. */
#define PyUnicode_GET_LENGTH(op) PyUnicode_GetLength((PyObject *)(op))
#define PyUnicode_AsUTF8(op) PyUnicode_AsUTF8AndSize((PyObject *)(op), NULL)

/* PyObject_CallOneArg is not limited API (Include/cpython/abstract.h);
 * this is its definition there, on the limited PyObject_Vectorcall. */
static inline PyObject *shmq_call_one_arg(PyObject *func, PyObject *arg) {
    PyObject *args[2] = {NULL, arg};
    return PyObject_Vectorcall(func, args + 1, 1 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
}
#define PyObject_CallOneArg(func, arg) shmq_call_one_arg((func), (arg))

/* Built with 3.13+ headers for the 3.12 limited API: api.c's 3.13 branch takes
 * PyWeakref_GetRef, limited API only from 3.13; this is it on PyWeakref_GetObject
 * (stable ABI, deprecated from 3.13: borrowed, taken at once under the GIL). */
#if PY_VERSION_HEX >= 0x030D0000 && Py_LIMITED_API + 0 < 0x030D0000
#if PY_VERSION_HEX >= 0x030F0000
/* 3.15's headers no longer declare it; libpython still exports it (stable ABI). */
PyAPI_FUNC(PyObject *) PyWeakref_GetObject(PyObject *ref);
#endif
static inline int shmq_weakref_get_ref(PyObject *ref, PyObject **pobj) {
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
    PyObject *o = PyWeakref_GetObject(ref);
#pragma GCC diagnostic pop
    *pobj = o && o != Py_None ? Py_NewRef(o) : NULL;
    return o ? *pobj != NULL : -1;
}
#define PyWeakref_GetRef(ref, pobj) shmq_weakref_get_ref((ref), (pobj))
#endif

#endif /* Py_LIMITED_API */

#endif /* SHMQ_CORE_ABI_H */
