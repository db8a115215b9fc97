/*
 * shmq/core/binding.h: the Python binding's internal header.  shmq._core
 * is the engine (shmq/engine/, plain C, no Python) compiled together with
 * the files in this folder, which own every Python object: argument
 * parsing, the types (Ring, Cursor, Frame, Reservation, Lock, Waiting,
 * Semaphore, Deferred), the Queue port (pickling, maxsize, sentinels),
 * errors as exceptions, and the GIL, which the engine drops around its
 * blocking waits through the hooks this binding hands it.
 *
 * Map of the files (docs/format.md, "The engine and its Python binding"):
 *   binding.h  this header
 *   module.c   module state, init, module functions (incl. the read-only
 *              inspection functions fsck and repair share with the engine)
 *   ring.c     the Ring type: one spool mapping (engine eng_ring)
 *   cursor.c   the Cursor type: a reader's position (engine eng_cursor) and its takes
 *   api.c      the entry points Spool, Reader and Queue bind, and their
 *              hand-off to the Python slow paths; the Queue port
 *   reserve.c  the Reservation type (zero-copy writes)
 *   options.c  put_many's options: Deferred, before_commit, timestamps, sync
 *   lock.c     the Lock, Waiting and Semaphore types
 *   frame.c    Frame
 *
 * Thread and signal safety: every function here holds the GIL but while the
 * engine waits (hooks.unlock / relock), and runs no Python code while the
 * engine holds a shared lock, but for three callouts a caller asks for:
 * put_many's Deferred fill() and before_commit() (options.c) and the crash
 * hook of the fault-injection harness.  Python signal handlers and other
 * threads only run between bytecodes or inside those waits (which hold no
 * shared lock: the engine takes a lock only once its wait returned), so
 * Ctrl-C can never leave a shared lock held; a callout that raises (a
 * signal handler's exception included) aborts its batch and the lock is
 * released before the exception propagates.
 */
#ifndef SHMQ_BINDING_H
#define SHMQ_BINDING_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "engine.h"
#include "take.h"
#include "abi.h" /* the stable-ABI build (Py_LIMITED_API); nothing without it */
#include "values.h"

/* ---- module state (PEP 630): one per interpreter that imports shmq._core ---- */
typedef struct {
    PyObject *SpoolFormatError; /* set by _core.setup() */
    PyObject *ShmqError;        /*   (the base: a squatted semaphore) */
    PyObject *crash_hook;       /* fault-injection harness only */
    PyObject *pickle_loads;     /* for Cursor.get_obj */
    PyObject *EmptyError;       /* shmq.Empty, raised when a wait in C times out */
    PyObject *pickle_dumps;     /* for QueuePort.put, with: */
    PyObject *dumps_protocol;   /*   shmq.codec.PROTOCOL */
    PyObject *dumps_kwnames;    /*   ("buffer_callback",) */
    PyObject *inband_callback;  /*   core_inband, as a callable */
    unsigned long buffers_seen; /* bumped by core_inband */
    eng_hooks hooks;            /* the GIL around the engine's waits; the crash hook */
    PyObject *EMPTY, *STUCK, *UNDECODED; /* get_obj's sentinels */
    PyObject *str_release;      /* "release": a reservation's memoryview is released by name */
    PyTypeObject *FrameType, *RingType, *CursorType, *ReservationType, *LockType, *WaitingType, *QueuePortType;
    PyTypeObject *DeferredType; /* shmq.Deferred: a payload written by fill() under the writer lock */
    PyTypeObject *SemaphoreType;
    PyTypeObject *LargeCopyType; /* a large payload's private copy (frame.c) */
    ValuesKeys keys;            /* the values codec's cache of dict keys (values.h) */
} CoreState;

/* ---- the Ring: one spool mapping ---- */
typedef struct {
    PyObject_HEAD
    eng_ring eng;       /* the engine's handle (base NULL: closed) */
    CoreState *st;      /* the module state of the module that made this type (hot paths: no lookup) */
    Py_buffer buf;      /* the mapping, exported by the mmap object while open */
    int have_buf;
    PyObject *path;
    PyObject *owner;    /* weak reference to the Python handle whose slow path completes put_api */
    PyObject *put_slow; /* owner's slow path, a plain function: put_slow(owner, data, block, timeout, codec) */
    int fast_put;       /* 0: the handle's sync=True: put_api always takes the slow path, reserve_api's
                         * reservations msync at their commit */
    PyObject *reserve_slow; /* owner's reserve_slow(owner, nbytes, codec, timeout), completing reserve_api */
} Ring;

typedef struct {
    PyObject_HEAD
    eng_resv eng;
    Ring *ring;
    PyObject *view;
} Reservation;

/* ---- Cursor: a reader's position ---- */
typedef struct {
    PyObject_HEAD
    eng_cursor eng;
    Ring *ring;
    PyObject *closed_msg;
    PyObject *last;     /* the frame get_obj() could not decode (UNDECODED) */
    PyObject *owner;    /* weak reference to the handle whose get_slow completes get_api / get_obj_api */
    PyObject *get_slow; /* owner's slow path, a plain function: get_slow(owner, block, timeout, first) */
} Cursor;

/* The buffers (or the bytes object) that keep one item's segments alive while
 * the engine writes it (load_item fills them and the engine's eng_item);
 * `item`: a single put's. */
typedef struct {
    Py_buffer views[MAX_SEGS];
    eng_seg segs[MAX_SEGS];
    int nviews;
    PyObject *hold; /* a bytes object used without a view (strong), or NULL */
    eng_item item;
} Item;

/* ---- small helpers ---- */
static inline int ring_check_open(Ring *r) {
    if (!r->eng.base) {
        PyErr_SetString(PyExc_ValueError, "spool handle is closed");
        return -1;
    }
    return 0;
}

/* Set the exception for engine code `code` (< 0) and return NULL. */
PyObject *engine_error(CoreState *st, PyObject *path, int code);
static inline PyObject *ring_error(Ring *r, int code) { return engine_error(r->st, r->path, code); }
/* The engine's statuses: outcomes a caller retries or reports, not errors. */
static inline int is_status(int64_t code) { return code <= SHMQ_ELOCKED && code >= SHMQ_EBACKLOG; }

/* ---- module.c, inspect.c ---- */
int call_crash_hook(CoreState *st, const char *point);
extern const eng_hooks binding_gil_hooks;
extern PyMethodDef inspect_methods[];

/* ---- ring.c ---- */
extern PyType_Spec ring_spec;
int load_item(Item *it, eng_item *e, PyObject *o, int checksum);
void load_raw_item(Item *it, eng_item *e, const char *p, uint64_t n, int checksum); /* n bytes at p, which outlive the write */
void release_items(Item *items, Py_ssize_t k);

/* ---- cursor.c ---- */
extern PyType_Spec cursor_spec;
int cursor_check(Cursor *c);
PyObject *cursor_error(Cursor *c, int code);
typedef int (*park_take_fn)(Cursor *c, PyObject **out);
PyObject *wait_take(Cursor *c, PyObject *(*take)(Cursor *), PyObject *nothing, uint64_t deadline, PyObject *timeout);
int park_deadline(PyObject *block, PyObject *timeout, uint64_t *deadline);
PyObject *time_left(PyObject *timeout, uint64_t deadline);
/* `codes` (as_list only): the objects mode of get_obj_many: a list entry is
 * the payload alone, its codec in codes[i], or for a codec the core does not
 * decode a Frame (codes[i] = CODE_FRAME). */
#define CODE_FRAME 255
typedef struct {
    uint8_t *v;
    Py_ssize_t cap; /* grown as frames come: max may be far more than will be taken */
    int unpickle;   /* in-band pickles decoded here (a trusted queue), else left as Frames */
} Codes;
PyObject *cursor_take(Cursor *c, Py_ssize_t max, int as_list, double lock_wait, shmq_frame_header *rawh,
                      Codes *codes);
PyObject *read_one(Ring *r, uint64_t *seqp, uint64_t *posp, int verify, uint64_t *lost);

/* ---- api.c ---- */
int parse_api(PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames, const char *const *names, int nnames,
              PyObject **out);
PyObject *Ring_put_api(Ring *r, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames);
PyObject *Ring_bind(Ring *r, PyObject *args);
PyObject *Ring_reduce(Ring *r, PyObject *ignored);
PyObject *Cursor_reduce(Cursor *c, PyObject *ignored);
PyObject *Cursor_get_api(Cursor *c, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames);
PyObject *Cursor_bind(Cursor *c, PyObject *args);
PyObject *Cursor_get_obj(Cursor *c, PyObject *unused);
PyObject *take_one(Cursor *c);
PyObject *dumps_inband(CoreState *st, PyObject *obj);
PyObject *queue_encode_batch(PyObject *m, PyObject *args);
extern PyType_Spec queue_port_spec;

/* ---- options.c: put_many's options ---- */
extern PyType_Spec deferred_spec;
typedef struct {
    eng_wopts eng;
    Ring *ring;
    PyObject *before_commit;
} WriteOpts;
int load_deferred(Ring *r, Item *it, eng_item *e, PyObject *o); /* 1: o is a Deferred (loaded), 0: it is not, -1: error */
int parse_write_opts(Ring *r, PyObject *const *kwargs, PyObject *kwnames, Py_ssize_t count, WriteOpts *o);
void free_write_opts(WriteOpts *o);

/* ---- reserve.c ---- */
PyObject *Ring_reserve(Ring *r, PyObject *args);
PyObject *reservation_new(Ring *r, uint64_t nbytes, int codec, double lock_wait, int sync, int *status);
PyObject *Ring_reserve_api(Ring *r, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames);
extern PyType_Spec reservation_spec;

/* ---- lock.c ---- */
extern PyType_Spec lock_spec, waiting_spec, semaphore_spec;

/* ---- frame.c ---- */
PyObject *make_frame(CoreState *st, uint64_t seq, uint64_t ts, PyObject *data, int codec);
PyTypeObject *frame_type_new(void);
/* Payloads of this size or more that a reader copies out as a writable buffer (numpy,
 * out-of-band pickle) get a mapping of their own: large_copy_new (frame.c). */
#define LARGE_COPY ((uint64_t)4 << 20)
extern PyType_Spec largecopy_spec;
PyObject *large_copy_new(CoreState *st, Py_ssize_t n, char **dst);
PyObject *core_copy_cache(PyObject *m, PyObject *unused);

#endif
