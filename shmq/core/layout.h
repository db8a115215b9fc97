/*
 * shmq/core/layout.h: the shared layout, status codes and limits of the
 * compiled core, in one place (see docs/format.md, "The compiled core").
 *
 * Every word offset, flag and codec tag here mirrors shmq/_format.py (the
 * readable spec): the module's LAYOUT table is compared with _format at
 * import, and tests/test_core.py compares every #define below that has a
 * _format name with _format's value.  Plain C: no Python headers, so that
 * a C harness (stress/tsan.py) can include it as it is.
 */
#ifndef SHMQ_CORE_LAYOUT_H
#define SHMQ_CORE_LAYOUT_H

#include <stdint.h>

/* ---- the file: header page, control words, reader slots ---- */
#define HEADER_BYTES 4096
#define FRAME_BYTES 32
#define ALIGN 8
#define W_NEXT_SEQ 16
#define W_NEXT_POS 17
#define W_FIRST_SEQ 40 /* off the writer's line (16..23): see FORMAT_VERSION in _format.py */
#define W_FIRST_POS 41
#define W_ALLOC_MIN 20 /* growable rings: the writer wraps early only past this offset */
#define W_ALLOC 21     /* growable rings: offsets at or above it have no pages */
#define W_LOCK_HOLDER 22
#define W_PUT_BYTES 26
#define W_LAST_PUT_NS 27
#define W_EVICTED 28
#define W_HIGH_FRAMES 29
#define W_HIGH_BYTES 30
#define W_SLOT_HWM 31
#define W_SEGMENT 34  /* growable spools: bytes allocated / released at a time (0: fixed) */
#define W_GROWTHS 35  /* segments allocated since creation */
#define W_HOLE_LO 36  /* growable rings: [HOLE_LO, HOLE_HI) below W_ALLOC may have no pages (trim) */
#define W_HOLE_HI 37
#define W_DATA_BELL 38  /* futex words: bumped by every doorbell ring (see ring_bell) */
#define W_SPACE_BELL 39
#define W_RATE 64
#define RATE_SECONDS 60
#define RATE_WORDS 3
#define DOORBELL_BYTE 4000
#define SLOT_BYTES 256
#define SLOT_WORDS 32
#define SLOT_FREE 0
#define SLOT_READER 1
#define SLOT_GROUP 2
#define SLOT_PIN 3
#define S_STATE 0
#define S_SEQ 1
#define S_POS 2
#define S_LOST 5
#define S_GETS 6
#define S_GET_BYTES 7
#define S_LAST_GET_NS 8
#define S_DELAY_SUM_NS 9
#define S_DELAY_MAX_NS 10
#define S_LAG_HIGH 11
#define S_LAG_LOW 12
#define S_LOCK_HOLDER 13
#define S_DELAY_COUNT 18 /* gets whose delay was measured (sampled: see sample_delay) */

/* ---- frames ---- */
#define FLAG_PAD 0x1
#define FLAG_CRC 0x4
#define CODEC_NUMPY 3
#define CODEC_PICKLE_OOB 6

typedef struct {
    uint64_t seq;
    uint32_t stored;
    uint32_t length;
    uint64_t ts;
    uint32_t crc;
    uint16_t flags;
    uint8_t codec;
    uint8_t ext;
} FrameHeader;

_Static_assert(sizeof(FrameHeader) == FRAME_BYTES, "frame header is 32 bytes");

/* ---- limits ---- */
/* Positions, seqs and counters never get near 2**62 (centuries at memory
 * bandwidth): a larger one comes from a corrupt or hostile file (and would
 * wrap).  A value is valid iff it is < MAX_COUNTER: every check rejects with
 * `>= MAX_COUNTER` (2**62 itself is NO_PIN, a sentinel, never a position).
 *
 * This block's MAX_COUNTER, NO_PIN and RING_ADVICE are _format's, exported by
 * module.c and compared with _format at import (_format.check_core). */
#define MAX_COUNTER (1ull << 62)
/* S_POS of a pin slot that pins nothing: above every valid position, so
 * pin_floor never finds it in the way (_format.NO_PIN). */
#define NO_PIN MAX_COUNTER
#define MAX_BATCH 65536      /* frames per put_many */
#define MAX_SEGS 64          /* segments (a tuple's items) per frame */
#define STATS_FLUSH_FRAMES 64 /* a reader publishes its counters at least this often */

/* The advice every "the ring is corrupt" error ends with, written once
 * (_format.RING_ADVICE, for the errors raised in Python). */
#define RING_ADVICE "see 'shmq fsck'; to keep what is readable: 'shmq export --skip-corrupt', 'shmq rm', 'shmq import'"

/* ---- status codes returned instead of a seq / frame ---- */
#define ST_OK 0
#define ST_LOCK_STUCK (-1) /* the lock was not free within lock_wait: Python checks the holder */
#define ST_NO_ROOM (-2)    /* block/error policy (or maxsize): no room now */
#define ST_SLOW (-3)       /* a zero-copy pin is in the way: Python reclaims dead holders' pins, or waits */
#define ST_TOO_LARGE (-4)  /* the frame or batch can never fit */
#define ST_NO_SPACE (-5)   /* a growable spool could not allocate its next segment (ENOSPC) */
#define ST_BACKLOG (-6)    /* max_backlog (a queue's maxsize) items wait: no room for items, not bytes */
#define ST_PYERR (-100)    /* a Python exception is set (never returned to Python) */

#endif
