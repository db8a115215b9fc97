/*
 * shmq.h: the C API of libshmq, the engine of shmq's spools (docs/c-api.md).
 *
 * A spool is one file: a control block and a ring of frames, shared through
 * mmap by every process that opens it, Python or C.  This header is the
 * whole API: open or create a spool, put frames (one, a batch, or written in
 * place through a reservation), read them through anonymous, named
 * (durable) or group (competing) readers, blocking with a timeout on the
 * same doorbells Python's readers and writers wait on, and read the loss
 * counts and statistics.  The locks and their recovery are Python's: a C
 * writer killed while it holds the writer lock is recovered by the next
 * writer, C or Python, and the other way round.
 *
 * Every function that can fail returns a negative code: -errno (an OS call
 * failed) or one of the SHMQ_E* codes below; shmq_strerror() names either,
 * and shmq_errmsg() holds the calling thread's detailed message for the
 * last failure (a corrupt ring says where).  Nothing is printed.
 *
 * Threads: a spool handle and its readers may be used by any number of
 * threads at once (each call is atomic on its reader; writers serialize on
 * the spool's writer lock), except that shmq_close / shmq_reader_close must
 * not race with other calls on the same handle.  After fork(), the child
 * opens its own handles (the parent's hold its locks).
 *
 * Timeouts are seconds as a double: SHMQ_FOREVER (< 0) waits as long as it
 * takes, 0 does not wait (a writer lock held by a live process is still
 * waited for up to the recovery timeout, as in Python).
 *
 * Build: `make -C shmq/engine` makes libshmq.so and libshmq.a with nothing
 * but a C11 compiler (docs/c-api.md); link with -lshmq -lpthread.
 */
#ifndef SHMQ_H
#define SHMQ_H

#include <stddef.h>
#include <stdint.h>

#include "shmq_layout.h"

#ifdef __cplusplus
extern "C" {
#endif

/* What libshmq exports (the Python extension, which links the engine in,
 * defines it empty: it exports only its module init). */
#ifndef SHMQ_API
#define SHMQ_API __attribute__((visibility("default")))
#endif

#define SHMQ_FOREVER (-1.0)

/* ---- error codes (besides -errno) ---- */
#define SHMQ_OK 0
#define SHMQ_ELOCKED (-2001)   /* a lock was not free within the wait (its holder may be dead: recovery) */
#define SHMQ_EFULL (-2002)     /* no room: the slowest named reader or group is in the way */
#define SHMQ_EPINNED (-2003)   /* a zero-copy view pins a frame in the way */
#define SHMQ_ETOOLARGE (-2004) /* the frame or batch can never fit in this ring */
#define SHMQ_ENOSPACE (-2005)  /* a growable spool's filesystem has no room for its next segment */
#define SHMQ_EBACKLOG (-2006)  /* a queue's maxsize items wait */
#define SHMQ_EEMPTY (-2007)    /* nothing to read within the timeout */
#define SHMQ_ECORRUPT (-2008)  /* the ring or a cursor is corrupt (shmq_errmsg says where) */
#define SHMQ_EFORMAT (-2009)   /* not a spool, a damaged header, or another format version */
#define SHMQ_ESQUATTED (-2010) /* a semaphore of the spool was created by another user */
#define SHMQ_EBUSY (-2011)     /* the named reader is attached by another process */
#define SHMQ_ECLOSED (-2012)   /* the handle was closed meanwhile */
#define SHMQ_ESIZE (-2013)     /* the buffer is smaller than the frame: nothing was taken */
#define SHMQ_EKIND (-2014)     /* the name is a reader of another kind, or the table is full */
#define SHMQ_ECALLBACK (-2015) /* a callback of the caller failed (the error is the caller's) */
#define SHMQ_ESTATE (-2016)    /* not now: e.g. no open reservation, or a put inside one (deadlock) */

/* The name of a code (-errno or SHMQ_E*); never NULL. */
SHMQ_API const char *shmq_strerror(int code);
/* The calling thread's detailed message for the last failure ("" if none). */
SHMQ_API const char *shmq_errmsg(void);

/* ---- spools ---- */
typedef struct shmq_spool shmq_spool;

typedef struct {
    uint64_t capacity;     /* ring bytes, rounded up to 4 KiB (0: 64 MiB) */
    uint64_t max_capacity; /* > capacity: growable up to this ceiling (0: fixed) */
    int on_full;           /* SHMQ_POLICY_OVERWRITE (default), _BLOCK or _ERROR */
    unsigned mode;         /* permission bits, not masked by the umask (0: 0600) */
    unsigned readers;      /* named reader / group slots (0: 64) */
    int leases;            /* lease records for a work queue (-1: 1024, the default) */
    int checksum;          /* store a CRC-32 of every payload */
    int exist_ok;          /* open the spool already there instead of failing with -EEXIST */
} shmq_create_options;

/* Open the spool at `path` (a bare name: the caller's private directory
 * /dev/shm/shmq-<euid>/, as Python's).  `recovery_timeout`: seconds a lock
 * holder is trusted between checks of whether it is alive (<= 0: 1.0).
 * The handle holds the handle lock (SHMQ_HANDLE_LOCK_BYTE, shared) until
 * closed; while shmq removes the file as an orphaned queue (the lock held
 * exclusively) this waits up to 5 s: -ENOENT once removed, SHMQ_ELOCKED if
 * still held. */
SHMQ_API int shmq_open(const char *path, double recovery_timeout, shmq_spool **out);
/* Create a spool (Spool.create's options; NULL: the defaults) and open it. */
SHMQ_API int shmq_create(const char *path, const shmq_create_options *opts, shmq_spool **out);
/* Remove a spool file and its semaphores (handles still open keep working). */
SHMQ_API int shmq_destroy(const char *path);
/* Close the handle and its readers (an open reservation is abandoned). */
SHMQ_API int shmq_close(shmq_spool *sp);

/* ---- writing ---- */
typedef struct {
    const void *data;
    size_t len;
} shmq_iovec;

/* Append one frame; its seq (>= 0), or a code: SHMQ_EFULL (policy "error",
 * or no room within the timeout), SHMQ_ETOOLARGE, SHMQ_ELOCKED (a live
 * holder kept the lock past the timeout), SHMQ_ENOSPACE.  Atomic: readers see
 * the whole frame or nothing, whenever this process dies. */
SHMQ_API int64_t shmq_put(shmq_spool *sp, const void *data, size_t len, int codec, double timeout);
/* Append `count` frames as one atomic, contiguous batch; the first seq. */
SHMQ_API int64_t shmq_put_many(shmq_spool *sp, const shmq_iovec *frames, size_t count, int codec, double timeout);
/* Room for one frame of `nbytes`, written in place at rv->data; the writer lock
 * is held until shmq_commit (publishes; returns the seq) or shmq_abandon (a
 * no-op once committed).  A put or reserve from the thread holding one fails
 * with SHMQ_ESTATE instead of deadlocking; other threads wait for the lock. */
typedef struct {
    void *data;      /* where the payload goes */
    size_t len;      /* nbytes */
    uint64_t seq;    /* the seq the frame gets when committed */
    uint64_t priv_[8];
} shmq_reservation;
SHMQ_API int shmq_reserve(shmq_spool *sp, size_t nbytes, int codec, double timeout, shmq_reservation *rv);
SHMQ_API int64_t shmq_commit(shmq_reservation *rv);
SHMQ_API int shmq_abandon(shmq_reservation *rv);
/* Durable writes (Python's Spool.open(sync=True)), on (1) or off (0, the
 * default) for this handle's later puts, put_manys and reservations: each
 * msyncs its frames before the commit (a failure publishes nothing and
 * returns the -errno) and the header page after it (a failure returns the
 * -errno of a frame that is published but not known durable).  For spools on
 * a disk's file system; on /dev/shm an msync only costs time.  0, or
 * SHMQ_ECLOSED. */
SHMQ_API int shmq_set_sync(shmq_spool *sp, int on);
/* Give back a drained growable spool's memory now (Spool.trim): 0, or
 * SHMQ_ELOCKED if the writer lock stayed busy for `timeout` seconds.  A fixed
 * spool releases nothing. */
SHMQ_API int shmq_trim(shmq_spool *sp, double timeout);

/* ---- reading ---- */
typedef struct shmq_reader shmq_reader;

#define SHMQ_READER_GROUP 0x1   /* a member of the group `name`: each frame to one member */
#define SHMQ_START_LATEST 0x2   /* a new reader starts after the last frame (default: the oldest) */
#define SHMQ_NO_AUTOCOMMIT 0x4  /* a named reader persists its position only at shmq_reader_commit */
#define SHMQ_VERIFY 0x8         /* check each frame's CRC-32 (spools created with checksum) */

/* An anonymous reader (name NULL), a durable named reader, or a group member. */
SHMQ_API int shmq_reader_open(shmq_spool *sp, const char *name, int flags, shmq_reader **out);
SHMQ_API int shmq_reader_close(shmq_reader *r);

typedef struct {
    uint64_t seq;
    uint64_t timestamp_ns; /* wall clock when it was put */
    const void *data;      /* the payload, in the caller's buffer */
    size_t len;
    int codec;             /* SHMQ_CODEC_* */
} shmq_frame;

/* The next frame, its payload copied into buf (cap bytes): 0, SHMQ_EEMPTY
 * once the timeout passed, or SHMQ_ESIZE (frame->len: the size needed;
 * nothing was taken).  Frames overwritten before they were read are skipped
 * and counted (shmq_reader_lost). */
SHMQ_API int shmq_get(shmq_reader *r, void *buf, size_t cap, shmq_frame *frame, double timeout);
/* Up to `max` frames, copied one after the other into buf: how many (>= 1),
 * blocking only for the first. */
SHMQ_API int shmq_take(shmq_reader *r, void *buf, size_t cap, shmq_frame *frames, size_t max, double timeout);
/* Persist a named reader's position (SHMQ_NO_AUTOCOMMIT). */
SHMQ_API int shmq_reader_commit(shmq_reader *r);
/* Seq of the next frame this reader returns (a group's shared cursor). */
SHMQ_API uint64_t shmq_reader_position(shmq_reader *r);
/* Frames skipped because they were overwritten first: exact (named readers
 * and groups: the count stored in the spool for that name). */
SHMQ_API uint64_t shmq_reader_lost(shmq_reader *r);

/* ---- statistics ---- */
typedef struct {
    uint64_t capacity, first_seq, next_seq, frames, used_bytes, put_bytes, last_put_ns, evicted,
        high_water_frames, high_water_bytes, lock_breaks, growths;
    uint32_t lock_pid; /* the writer lock's holder now (0: free) */
    int on_full, checksum, growable;
} shmq_stats;

SHMQ_API int shmq_stats_get(shmq_spool *sp, shmq_stats *out);

#ifdef __cplusplus
}
#endif

#endif
