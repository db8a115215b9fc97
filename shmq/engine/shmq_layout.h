/*
 * shmq_layout.h: the on-disk layout of a shmq spool file (format version 4),
 * written once, by hand, here.  docs/format.md describes it in prose.
 *
 * Every other form is generated from this file: the Python constants of
 * shmq._format come from shmq/_layout.py, which setup.py writes from it at
 * build time (every `#define SHMQ_NAME value` below becomes `NAME = value`,
 * each field list a struct format and a tuple of field names).  So keep to
 * what that generator reads: object-like `#define`s whose value is an
 * integer literal, a string literal, or an expression of integer literals
 * and earlier SHMQ_ names with + - * / << and parentheses; field lists as
 * X(C type, name, struct code) entries.
 *
 * Little-endian throughout; shared words are aligned 8-byte words of the
 * header page (SHMQ_W_*, indexes of the page viewed as uint64_t) or of a
 * reader-table slot (SHMQ_S_*).  Installed beside shmq.h; plain C, no
 * Python.
 */
#ifndef SHMQ_LAYOUT_H
#define SHMQ_LAYOUT_H

#include <stddef.h>
#include <stdint.h>

/* ---- the file ---- */
#define SHMQ_MAGIC_STRING "SHMQSPL" /* the geometry's 8 magic bytes, with its NUL */
#define SHMQ_FORMAT_VERSION 4
#define SHMQ_HEADER_BYTES 4096    /* the header page: geometry, control words, lock bytes */
#define SHMQ_PAGE 4096
#define SHMQ_MIN_RING_BYTES 4096
#define SHMQ_GEOMETRY_BYTES 128
#define SHMQ_GEOMETRY_CRC_SPAN 124 /* the CRC-32 of bytes [0, 124) sits at 124 */
#define SHMQ_GEO_FLAG_NETWORK 0x1  /* geometry flags: fed from another host (shmq sub): untrusted */
#define SHMQ_GEO_FLAG_HANDLE_LOCKS 0x2 /* ... every handle holds HANDLE_LOCK_BYTE while mapped */
#define SHMQ_SEM_PREFIX_BYTES 12   /* hex digits of the semaphore prefix (in a 16-byte field) */

/* The immutable geometry block at offset 0 (policy: SHMQ_POLICY_*). */
#define SHMQ_GEOMETRY_FIELDS(X)                                                                    \
    X(char, magic[8], 8s) X(uint32_t, version, I) X(uint32_t, header_bytes, I)                    \
    X(uint64_t, file_bytes, Q) X(uint64_t, ring_offset, Q) X(uint64_t, ring_bytes, Q)             \
    X(uint64_t, slot_offset, Q) X(uint32_t, slot_count, I) X(uint32_t, slot_bytes, I)             \
    X(uint64_t, lease_offset, Q) X(uint32_t, lease_count, I) X(uint32_t, lease_bytes, I)          \
    X(uint8_t, policy, B) X(uint8_t, checksum, B) X(uint16_t, reserved0, H) X(uint32_t, flags, I) \
    X(char, sem_prefix[16], 16s) X(uint64_t, created_ns, Q) X(char, reserved1[20], 20s)           \
    X(uint32_t, crc, I)

/* on_full policies, the geometry's policy byte */
#define SHMQ_POLICY_OVERWRITE 0 /* drop the oldest frames; readers count the loss */
#define SHMQ_POLICY_BLOCK 1     /* writers wait for the slowest named reader or group */
#define SHMQ_POLICY_ERROR 2     /* writers fail with "full" */

/* ---- control words of the header page (uint64_t indexes) ---- */
#define SHMQ_W_NEXT_SEQ 16      /* the commit point: frames below it are readable */
#define SHMQ_W_NEXT_POS 17      /* where the next frame goes (the writer's bookkeeping) */
/* 18, 19: FIRST_SEQ / FIRST_POS of versions 1 and 2 (refused) */
#define SHMQ_W_ALLOC_MIN 20     /* growable rings: the writer wraps early only past this offset */
#define SHMQ_W_ALLOC 21         /* growable rings: offsets at or above it have no pages */
#define SHMQ_W_LOCK_HOLDER 22   /* writer lock holder: pid | start stamp low 32 bits << 32 */
#define SHMQ_W_DATA_ARMED 23    /* 1: a reader armed the data doorbell since its last ring (wait.c's ring_bell) */
#define SHMQ_W_LOCK_TOKEN 24    /* fencing token, bumped whenever a dead holder's lock is broken */
#define SHMQ_W_PUT_BYTES 26     /* payload bytes ever committed (puts: NEXT_SEQ itself) */
#define SHMQ_W_LAST_PUT_NS 27
#define SHMQ_W_EVICTED 28       /* frames pushed out to make room */
#define SHMQ_W_HIGH_FRAMES 29   /* most frames resident, recorded before evicting */
#define SHMQ_W_HIGH_BYTES 30    /* most ring bytes in use, recorded before evicting */
#define SHMQ_W_SLOT_HWM 31      /* 1 + highest slot ever used (bounds table scans) */
#define SHMQ_W_LOCK_BREAKS 32   /* dead writers' locks recovered */
#define SHMQ_W_QUEUE_MAXSIZE 33 /* shmq.Queue's maxsize in items (0: unbounded) */
#define SHMQ_W_SEGMENT 34       /* growable rings: bytes allocated / released at a time (0: fixed) */
#define SHMQ_W_GROWTHS 35       /* segments allocated since creation */
#define SHMQ_W_HOLE_LO 36       /* growable rings: [HOLE_LO, HOLE_HI) below ALLOC may lack pages */
#define SHMQ_W_HOLE_HI 37
#define SHMQ_W_DATA_BELL 38     /* doorbell futex words (low 32 bits): blocked readers ... */
#define SHMQ_W_SPACE_BELL 39    /* ... and writers sleep on them */
/* 40..47: a cache line the writer stores to only when it evicts (since format version 3) */
#define SHMQ_W_FIRST_SEQ 40     /* oldest frame still in the ring */
#define SHMQ_W_FIRST_POS 41     /* its byte position (stored before FIRST_SEQ) */
/* A writer blocked on a full block spool: ring me once the slowest cursor's
 * position (or seq) reaches this; 0 none, SHMQ_ROOM_RANG rung (wait.c).  On
 * the line consumers read FIRST_POS from anyway. */
#define SHMQ_W_ROOM_WANT_POS 42
#define SHMQ_W_ROOM_WANT_SEQ 43
/* 48..63: shmq.WorkQueue */
#define SHMQ_W_WQ_LEASE_SLOTS 48 /* lease records at the start of the lease region (0: no work queue) */
#define SHMQ_W_WQ_KEY_SLOTS 49   /* key-index entries after them */
#define SHMQ_W_WQ_TOKEN 50       /* last fencing token granted */
#define SHMQ_W_WQ_MAX_ATTEMPTS 51
#define SHMQ_W_WQ_LEASE_HWM 52   /* 1 + highest lease record in use */
#define SHMQ_W_WQ_REDELIVERED 53
#define SHMQ_W_WQ_ACKED 54
#define SHMQ_W_WQ_SUPERSEDED 55
#define SHMQ_W_WQ_DEAD 56
#define SHMQ_W_RATE 64          /* per-second series: RATE_SECONDS x (second, puts, gets) */
#define SHMQ_RATE_SECONDS 60
#define SHMQ_RATE_WORDS 3
#define SHMQ_CTL_WORDS (SHMQ_HEADER_BYTES / 8)

/* bytes of the header page (fcntl OFD locks cover them; their contents mean nothing) */
#define SHMQ_DOORBELL_BYTE 4000      /* pwrite target: mmap stores raise no inotify event */
#define SHMQ_RECOVERY_LOCK_BYTE 4064 /* one process recovers the writer lock */
#define SHMQ_TABLE_LOCK_BYTE 4065    /* reader-table allocation */
#define SHMQ_REPLAY_LOCK_BYTE 4066   /* one replayer of a dead-letter spool */
/* Held SHARED by every handle while it has the file mapped (dropped by the kernel
 * when the handle's open file description closes, at the latest when its process
 * dies): an exclusive attempt that succeeds proves no handle exists anywhere (an
 * anonymous queue's orphan check, shmq.anonymous).  Meaningful only on files whose
 * geometry carries SHMQ_GEO_FLAG_HANDLE_LOCKS (an older shmq's handles never took it). */
#define SHMQ_HANDLE_LOCK_BYTE 4067

/* ---- the reader / group table ---- */
#define SHMQ_SLOT_OFFSET SHMQ_HEADER_BYTES
#define SHMQ_SLOT_BYTES 256
#define SHMQ_SLOT_WORDS (SHMQ_SLOT_BYTES / 8)
#define SHMQ_DEFAULT_SLOTS 64
#define SHMQ_MAX_SLOTS 4096
#define SHMQ_NAME_OFFSET 192 /* a slot's name: a length byte, then UTF-8 */
#define SHMQ_NAME_MAX_BYTES (SHMQ_SLOT_BYTES - SHMQ_NAME_OFFSET - 1)
#define SHMQ_SLOT_FREE 0
#define SHMQ_SLOT_READER 1
#define SHMQ_SLOT_GROUP 2
#define SHMQ_SLOT_PIN 3
#define SHMQ_S_STATE 0
#define SHMQ_S_SEQ 1  /* committed cursor (stored after S_POS) */
#define SHMQ_S_POS 2
#define SHMQ_S_PID 3  /* last attaching process */
#define SHMQ_S_LOST 5
#define SHMQ_S_GETS 6
#define SHMQ_S_GET_BYTES 7
#define SHMQ_S_LAST_GET_NS 8
#define SHMQ_S_DELAY_SUM_NS 9
#define SHMQ_S_DELAY_MAX_NS 10
#define SHMQ_S_LAG_HIGH 11
#define SHMQ_S_LAG_LOW 12
#define SHMQ_S_LOCK_HOLDER 13 /* group lock holder (as W_LOCK_HOLDER) */
#define SHMQ_S_LOCK_TOKEN 15
#define SHMQ_S_CREATED_NS 16
#define SHMQ_S_DELAY_COUNT 18 /* gets whose delay was measured: the divisor of S_DELAY_SUM_NS */
#define SHMQ_SLOT_LIVE_BYTE 0     /* fcntl liveness lock on a slot's first byte ... */
#define SHMQ_SLOT_RECOVERY_BYTE 1 /* ... group-lock recovery on its second */

/* ---- the lease region (shmq.WorkQueue) ---- */
#define SHMQ_LEASE_BYTES 64
#define SHMQ_DEFAULT_LEASES 1024
#define SHMQ_LEASE_WORDS 8
#define SHMQ_L_STATE 0
#define SHMQ_L_SEQ 1
#define SHMQ_L_POS 2
#define SHMQ_L_TOKEN 3
#define SHMQ_L_HOLDER 4
#define SHMQ_L_DUE_NS 5
#define SHMQ_L_ATTEMPTS 6
#define SHMQ_L_ENQ_NS 7
#define SHMQ_LEASE_FREE 0
#define SHMQ_LEASE_LEASED 1
#define SHMQ_LEASE_DELAYED 2
#define SHMQ_LEASE_RETRY 3
#define SHMQ_KEY_WORDS 3 /* key-index entry: key hash (0: empty), seq, position */
#define SHMQ_WQ_HAS_KEY 0x1
/* a work queue message's header, before its pickle (body, headers, key) */
#define SHMQ_WQ_HEADER_FIELDS(X) \
    X(uint64_t, key_hash, Q) X(uint64_t, not_before_ns, Q) X(uint32_t, max_attempts, I) X(uint32_t, wq_flags, I)

/* ---- frames ---- */
#define SHMQ_FRAME_BYTES 32
#define SHMQ_ALIGN 8
#define SHMQ_MAX_FRAME_PAYLOAD (0xFFFFFFFF - SHMQ_FRAME_BYTES - SHMQ_ALIGN)
#define SHMQ_FRAME_FIELDS(X)                                                                       \
    X(uint64_t, seq, Q) X(uint32_t, stored, I) X(uint32_t, length, I) X(uint64_t, ts, Q)          \
    X(uint32_t, crc, I) X(uint16_t, flags, H) X(uint8_t, codec, B) X(uint8_t, ext, B)
#define SHMQ_FRAME_FLAGS_OFFSET 28
#define SHMQ_FLAG_PAD 0x1        /* filler to the ring's end; its seq is the next frame's */
#define SHMQ_FLAG_SUPERSEDED 0x2 /* replaced by a newer message with the same key (work queue) */
#define SHMQ_FLAG_CRC 0x4        /* the crc field is valid */
#define SHMQ_FLAG_EXT 0x8        /* reserved: extension header */

/* codec tags: what a payload is (shmq.codec decodes them) */
#define SHMQ_CODEC_RAW 0
#define SHMQ_CODEC_PICKLE 1
#define SHMQ_CODEC_JSON 2
#define SHMQ_CODEC_NUMPY 3
#define SHMQ_CODEC_ARROW 4
#define SHMQ_CODEC_UTF8 5
#define SHMQ_CODEC_PICKLE_OOB 6 /* pickle protocol 5 with out-of-band buffers */
#define SHMQ_CODEC_WORKQ 7      /* a work queue message */
#define SHMQ_CODEC_VALUES 8     /* exact builtin values, without pickle (the binding's shmq/core/values.c) */

/* ---- growable rings ---- */
#define SHMQ_MIN_SEGMENT (64 << 10)
#define SHMQ_MAX_SEGMENT (4 << 20)

/* ---- limits ---- */
/* Positions, seqs and counters never get near 2**62 (centuries at memory
 * bandwidth): a larger one comes from a corrupt or hostile file (and would
 * wrap).  A value is valid iff it is below SHMQ_MAX_COUNTER. */
#define SHMQ_MAX_COUNTER (1ull << 62)
/* S_POS of a pin slot that pins nothing: above every valid position. */
#define SHMQ_NO_PIN SHMQ_MAX_COUNTER
/* W_ROOM_WANT_* once a consumer has rung for it: above every valid position,
 * so no later commit rings again until a writer publishes a new want. */
#define SHMQ_ROOM_RANG (SHMQ_MAX_COUNTER + 1)
/* What every "the ring is corrupt" error ends with. */
#define SHMQ_RING_ADVICE "see 'shmq fsck'; to keep what is readable: 'shmq export --skip-corrupt', 'shmq rm', 'shmq import'"

/* ---- the structs ---- */
#define SHMQ_LAYOUT_FIELD_(ctype, name, code) ctype name;
typedef struct {
    SHMQ_FRAME_FIELDS(SHMQ_LAYOUT_FIELD_)
} shmq_frame_header;
typedef struct {
    SHMQ_GEOMETRY_FIELDS(SHMQ_LAYOUT_FIELD_)
} shmq_geometry;
#undef SHMQ_LAYOUT_FIELD_

_Static_assert(sizeof(shmq_frame_header) == SHMQ_FRAME_BYTES, "a frame header is 32 bytes");
_Static_assert(sizeof(shmq_geometry) == SHMQ_GEOMETRY_BYTES, "the geometry block is 128 bytes");
_Static_assert(offsetof(shmq_geometry, crc) == SHMQ_GEOMETRY_CRC_SPAN, "the CRC follows its span");
_Static_assert(offsetof(shmq_frame_header, flags) == SHMQ_FRAME_FLAGS_OFFSET, "flags at 28");

#endif
