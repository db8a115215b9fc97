/*
 * shmq/engine/slots.c: the reader table for the C API's named readers and
 * groups -- find a name, allocate a slot under the table lock, the slot's
 * liveness lock, and reclaiming the pins of dead zero-copy readers.  The
 * rules are docs/format.md's ("Reader / group table"), the ones
 * shmq/slots.py and shmq/pins.py follow: a slot is complete when its state
 * word is stored (last), allocation and removal serialize on an OFD lock on
 * TABLE_LOCK_BYTE, and "attached" is an OFD lock on the slot's first byte
 * (exclusive for a named reader, shared for group members), which the
 * kernel drops when the process dies.
 */
#include "engine.h"

#define FIRST_LOOK_S 0.05

static uint64_t slot_byte(eng_ring *r, int64_t i, int which) {
    return (uint64_t)((char *)(r->slots + i * SHMQ_SLOT_WORDS) - r->base) + (uint64_t)which;
}

static int name_is(eng_ring *r, int64_t i, const char *name, size_t len) {
    const unsigned char *raw = (const unsigned char *)(r->slots + i * SHMQ_SLOT_WORDS) + SHMQ_NAME_OFFSET;
    return raw[0] == len && memcmp(raw + 1, name, len) == 0;
}

/* The slot named `name` (any kind), or -1. */
int eng_slot_find(eng_ring *r, const char *name, size_t len) {
    uint64_t h = slot_hwm(r);
    for (uint64_t i = 0; i < h; i++)
        if (ld_acq(&r->slots[i * SHMQ_SLOT_WORDS + SHMQ_S_STATE]) != SHMQ_SLOT_FREE && name_is(r, (int64_t)i, name, len))
            return (int)i;
    return -1;
}

static const char *kind_name(uint64_t state) {
    return state == SHMQ_SLOT_READER ? "a named reader" : state == SHMQ_SLOT_GROUP ? "a group"
                                                         : state == SHMQ_SLOT_PIN ? "a pin slot" : "in use";
}

/* The cursor a new reader starts at: the oldest frame, or (latest) after the
 * last one, recovering a dead writer's lock on the way. */
static int start_cursor(eng_ring *r, int latest, uint64_t *seq, uint64_t *pos) {
    if (!latest) return first_cursor(r, seq, pos);
    for (;;) {
        double wait = r->recovery_timeout < FIRST_LOOK_S ? r->recovery_timeout : FIRST_LOOK_S;
        int rc = eng_latest(r, wait, seq, pos);
        if (rc != 1) return rc;
        eng_lock_ref l;
        eng_writer_lock_ref(r, &l);
        rc = eng_lock_recover(&l);
        if (rc < 0) return rc;
    }
}

/* Find or create the slot for `name` of `kind` (SHMQ_SLOT_READER or
 * SHMQ_SLOT_GROUP), starting a new one at the oldest frame or (latest) after
 * the last: the slot, or an error (-EINVAL: a bad name; SHMQ_EKIND: the name
 * is of another kind, or the table is full). */
int eng_slot_attach(eng_ring *r, const char *name, int kind, int latest) {
    size_t len = strlen(name);
    if (len == 0 || len > SHMQ_NAME_MAX_BYTES)
        return eng_fail(-EINVAL, "reader name must be 1..%d UTF-8 bytes without NUL", SHMQ_NAME_MAX_BYTES);
    int rc = eng_ofd_lock(r->fd, SHMQ_TABLE_LOCK_BYTE, 1, 1);
    if (rc != 0) return rc < 0 ? eng_fail(rc, "%s: table lock: %s", r->path, strerror(-rc)) : -EAGAIN;
    int i = eng_slot_find(r, name, len);
    if (i >= 0) {
        uint64_t have = ld_acq(&r->slots[(uint64_t)i * SHMQ_SLOT_WORDS + SHMQ_S_STATE]);
        if (have != (uint64_t)kind)
            i = eng_fail(SHMQ_EKIND, "'%s' is %s in %s, not %s", name, kind_name(have), r->path,
                         kind_name((uint64_t)kind));
        goto out;
    }
    uint64_t seq, pos;
    if ((i = start_cursor(r, latest, &seq, &pos)) < 0) goto out;
    for (i = 0; (uint64_t)i < r->slot_count; i++)
        if (ld_acq(&r->slots[(uint64_t)i * SHMQ_SLOT_WORDS + SHMQ_S_STATE]) == SHMQ_SLOT_FREE) break;
    if ((uint64_t)i == r->slot_count) {
        i = eng_fail(SHMQ_EKIND, "%s: reader table is full (%llu slots); remove unused readers or create the "
                     "spool with more", r->path, (unsigned long long)r->slot_count);
        goto out;
    }
    uint64_t *w = r->slots + (uint64_t)i * SHMQ_SLOT_WORDS;
    for (int k = 1; k < SHMQ_NAME_OFFSET / 8; k++) st_rlx(&w[k], 0);
    unsigned char *raw = (unsigned char *)w + SHMQ_NAME_OFFSET;
    memset(raw, 0, SHMQ_NAME_MAX_BYTES + 1);
    raw[0] = (unsigned char)len;
    memcpy(raw + 1, name, len);
    st_rlx(&w[SHMQ_S_POS], pos);
    st_rlx(&w[SHMQ_S_SEQ], seq);
    st_rlx(&w[SHMQ_S_LAG_LOW], UINT64_MAX);
    st_rlx(&w[SHMQ_S_CREATED_NS], now_ns());
    st_rel(&w[SHMQ_S_STATE], (uint64_t)kind); /* published last: the slot is complete */
    if ((uint64_t)i + 1 > ld_rlx(&r->ctl[SHMQ_W_SLOT_HWM])) st_rlx(&r->ctl[SHMQ_W_SLOT_HWM], (uint64_t)i + 1);
out:
    eng_ofd_unlock(r->fd, SHMQ_TABLE_LOCK_BYTE);
    return i;
}

/* Mark slot `i` attached by this handle (its liveness lock): 0, or
 * SHMQ_EBUSY if another process holds it (exclusively, or at all when
 * `exclusive`).  The caller counts its own attachments: OFD locks are per
 * open file description, so one lock serves every attachment of a handle. */
int eng_slot_hold(eng_ring *r, int64_t i, int exclusive) {
    int rc = eng_ofd_lock(r->fd, slot_byte(r, i, SHMQ_SLOT_LIVE_BYTE), exclusive, 0);
    if (rc == 1)
        return eng_fail(SHMQ_EBUSY, "reader %.*s of %s is attached by another process (pid %llu)",
                        (int)((unsigned char *)(r->slots + i * SHMQ_SLOT_WORDS))[SHMQ_NAME_OFFSET],
                        (char *)(r->slots + i * SHMQ_SLOT_WORDS) + SHMQ_NAME_OFFSET + 1, r->path,
                        (unsigned long long)ld_rlx(&r->slots[i * SHMQ_SLOT_WORDS + SHMQ_S_PID]));
    if (rc < 0) return eng_fail(rc, "%s: %s", r->path, strerror(-rc));
    st_rlx(&r->slots[i * SHMQ_SLOT_WORDS + SHMQ_S_PID], (uint64_t)getpid());
    return 0;
}

void eng_slot_let_go(eng_ring *r, int64_t i) {
    if (r->base) eng_ofd_unlock(r->fd, slot_byte(r, i, SHMQ_SLOT_LIVE_BYTE));
}

/* Free the pin slots below `limit` whose holders died (their liveness lock
 * is gone), but slot `mine`: their zero-copy views can no longer be read.
 * The number freed. */
int eng_reclaim_pins(eng_ring *r, uint64_t limit, int64_t mine) {
    uint64_t h = slot_hwm(r);
    int freed = 0;
    for (uint64_t i = 0; i < h; i++) {
        uint64_t *w = r->slots + i * SHMQ_SLOT_WORDS;
        if (ld_acq(&w[SHMQ_S_STATE]) != SHMQ_SLOT_PIN || ld_acq(&w[SHMQ_S_POS]) >= limit || (int64_t)i == mine)
            continue;
        if (eng_ofd_locked_by_other(r->fd, slot_byte(r, (int64_t)i, SHMQ_SLOT_LIVE_BYTE)) == 0) {
            st_rel(&w[SHMQ_S_STATE], SHMQ_SLOT_FREE); /* its process died: release its pins */
            freed++;
        }
    }
    return freed;
}
