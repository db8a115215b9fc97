/*
 * shmq/engine/crc.c: the frame checksum (CRC-32, the same as zlib.crc32),
 * and the engine's errors: shmq_strerror and each thread's last message.
 */
#include "engine.h"

/* ---- CRC-32 (IEEE 802.3, the same as zlib.crc32) ---- */
/* Filled once per process (pthread_once), read-only afterwards. */
static uint32_t crc_table[256];
static pthread_once_t crc_once = PTHREAD_ONCE_INIT;
static void crc_fill(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        crc_table[i] = c;
    }
}

uint32_t eng_crc(uint32_t crc, const unsigned char *p, size_t n) {
    pthread_once(&crc_once, crc_fill);
    crc = ~crc;
    while (n--) crc = crc_table[(crc ^ *p++) & 0xFF] ^ (crc >> 8);
    return ~crc;
}

/* ---- errors ---- */
static _Thread_local char last_msg[512];

int eng_fail(int code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last_msg, sizeof last_msg, fmt, ap);
    va_end(ap);
    return code;
}

void eng_clear_error(void) { last_msg[0] = 0; }

const char *shmq_errmsg(void) { return last_msg; }

const char *shmq_strerror(int code) {
    switch (code) {
    case SHMQ_OK: return "success";
    case SHMQ_ELOCKED: return "the lock is held by a live process";
    case SHMQ_EFULL: return "the spool is full";
    case SHMQ_EPINNED: return "a zero-copy view pins a frame in the way";
    case SHMQ_ETOOLARGE: return "the frame or batch can never fit in this spool";
    case SHMQ_ENOSPACE: return "no room on the filesystem for the spool's next segment";
    case SHMQ_EBACKLOG: return "the queue holds its maxsize items";
    case SHMQ_EEMPTY: return "no frame within the timeout";
    case SHMQ_ECORRUPT: return "the spool is corrupt";
    case SHMQ_EFORMAT: return "not a spool of this format";
    case SHMQ_ESQUATTED: return "a semaphore of the spool belongs to another user";
    case SHMQ_EBUSY: return "the reader is attached by another process";
    case SHMQ_ECLOSED: return "the handle was closed";
    case SHMQ_ESIZE: return "the buffer is smaller than the frame";
    case SHMQ_EKIND: return "the name is in use by another kind of reader, or the table is full";
    case SHMQ_ECALLBACK: return "a callback failed";
    case SHMQ_ESTATE: return "not allowed in this state";
    default: break;
    }
    if (code < 0 && code > -4096) return strerror(-code);
    return "unknown shmq error code";
}
