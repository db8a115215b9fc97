/*
 * shmq/engine/spool.c: spool files for the C API -- a path's resolution
 * (a bare name lives in the caller's private /dev/shm/shmq-<euid>/),
 * opening a file without following links or blocking, decoding and checking
 * the geometry, mapping, creating a spool (Spool.create's steps: a
 * temporary name, the mode by fchmod, pre-allocation, the semaphores created
 * exclusively, link() into place) and destroying one.  The rules are
 * docs/format.md's ("File layout") and docs/security.md's, the ones
 * shmq/_mapping.py follows, so a spool made here is one Python opens, and
 * the other way round.
 *
 * A spool's semaphore prefix is derived from its file's device and inode
 * (the first 12 hex digits of SHA-256("shmq:DEV:INO")), so it can be
 * recomputed from the file whatever its contents: Python's sem_prefix_of.
 */
#include "engine.h"

#include <dirent.h>
#include <libgen.h>

/* ---- SHA-256 (FIPS 180-4), for the semaphore prefix ---- */

static const uint32_t K256[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};

#define ROR(x, n) (((x) >> (n)) | ((x) << (32 - (n))))

static void sha256_block(uint32_t h[8], const unsigned char *p) {
    uint32_t w[64], a[8];
    for (int i = 0; i < 16; i++)
        w[i] = (uint32_t)p[4 * i] << 24 | (uint32_t)p[4 * i + 1] << 16 | (uint32_t)p[4 * i + 2] << 8 | p[4 * i + 3];
    for (int i = 16; i < 64; i++) {
        uint32_t s0 = ROR(w[i - 15], 7) ^ ROR(w[i - 15], 18) ^ (w[i - 15] >> 3);
        uint32_t s1 = ROR(w[i - 2], 17) ^ ROR(w[i - 2], 19) ^ (w[i - 2] >> 10);
        w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    memcpy(a, h, sizeof a);
    for (int i = 0; i < 64; i++) {
        uint32_t t1 = a[7] + (ROR(a[4], 6) ^ ROR(a[4], 11) ^ ROR(a[4], 25)) + ((a[4] & a[5]) ^ (~a[4] & a[6])) +
                      K256[i] + w[i];
        uint32_t t2 = (ROR(a[0], 2) ^ ROR(a[0], 13) ^ ROR(a[0], 22)) + ((a[0] & a[1]) ^ (a[0] & a[2]) ^ (a[1] & a[2]));
        memmove(a + 1, a, 7 * sizeof a[0]);
        a[4] += t1;
        a[0] = t1 + t2;
    }
    for (int i = 0; i < 8; i++) h[i] += a[i];
}

/* The hex SHA-256 of a short message (< 56 bytes: one block), first `hex` digits. */
static void sha256_hex(const char *msg, char *out, int hex) {
    uint32_t h[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
    unsigned char block[128] = {0};
    size_t n = strlen(msg), blocks = n + 9 > 64 ? 2 : 1;
    memcpy(block, msg, n);
    block[n] = 0x80;
    uint64_t bits = (uint64_t)n * 8;
    for (int i = 0; i < 8; i++) block[blocks * 64 - 1 - i] = (unsigned char)(bits >> (8 * i));
    for (size_t b = 0; b < blocks; b++) sha256_block(h, block + 64 * b);
    for (int i = 0; i < hex; i++) out[i] = "0123456789abcdef"[(h[i / 8] >> (28 - 4 * (i % 8))) & 0xF];
    out[hex] = 0;
}

/* The semaphore prefix of the file with this fstat (Python's _mapping.sem_prefix_of). */
void eng_sem_prefix(const struct stat *st, char out[16]) {
    char msg[64];
    snprintf(msg, sizeof msg, "shmq:%llu:%llu", (unsigned long long)st->st_dev, (unsigned long long)st->st_ino);
    sha256_hex(msg, out, SHMQ_SEM_PREFIX_BYTES);
}

void eng_sem_name(const char *prefix, const char *which, char *out, size_t cap) {
    snprintf(out, cap, "/shmq.%s.%s", prefix, which);
}

/* ---- paths and files ---- */

static void default_dir(char *out, size_t cap) { snprintf(out, cap, "/dev/shm/shmq-%u", (unsigned)geteuid()); }

/* A per-user directory: a real directory, ours, not writable by group or others
 * (create: made 0700 first).  0, -ENOENT, or SHMQ_EFORMAT with the reason. */
static int check_private_dir(const char *dir, int create) {
    if (create && mkdir(dir, 0700) != 0 && errno != EEXIST) return eng_fail(-errno, "%s: %s", dir, strerror(errno));
    struct stat st;
    if (lstat(dir, &st) != 0) return eng_fail(-errno, "%s: %s", dir, strerror(errno));
    const char *problem = S_ISLNK(st.st_mode) ? "is a symbolic link"
                          : !S_ISDIR(st.st_mode) ? "is not a directory"
                          : st.st_uid != geteuid() ? "is owned by another user"
                          : st.st_mode & 022 ? "is writable by group or others" : NULL;
    if (problem)
        return eng_fail(SHMQ_EFORMAT, "%s %s: not a safe directory for your spools (another user may have planted "
                        "it); remove it, or use a full path", dir, problem);
    return 0;
}

/* `path` as shmq resolves it: a bare name (no slash) in the private directory. */
int eng_resolve_path(const char *path, char *out, size_t cap, int create_dir) {
    if (!path || !*path) return eng_fail(-EINVAL, "invalid spool path");
    if (strchr(path, '/')) {
        if (path[0] == '/') {
            if (snprintf(out, cap, "%s", path) >= (int)cap) return eng_fail(-ENAMETOOLONG, "spool path too long");
        } else {
            char cwd[PATH_MAX];
            if (!getcwd(cwd, sizeof cwd)) return eng_fail(-errno, "getcwd: %s", strerror(errno));
            if (snprintf(out, cap, "%s/%s", cwd, path) >= (int)cap) return eng_fail(-ENAMETOOLONG, "spool path too long");
        }
        return 0;
    }
    if (!strcmp(path, ".") || !strcmp(path, "..")) return eng_fail(-EINVAL, "invalid spool name %s", path);
    char dir[64];
    default_dir(dir, sizeof dir);
    int rc = check_private_dir(dir, create_dir);
    if (rc < 0 && !(rc == -ENOENT && !create_dir)) return rc;
    if (snprintf(out, cap, "%s/%s", dir, path) >= (int)cap) return eng_fail(-ENAMETOOLONG, "spool path too long");
    return 0;
}

/* Open an existing spool file: never following a link, never blocking (a FIFO
 * planted at the path), regular files only.  The descriptor, or a code. */
int eng_open_file(const char *path, struct stat *st) {
    struct stat lst;
    if (lstat(path, &lst) != 0) return eng_fail(-errno, "%s: %s", path, strerror(errno));
    if (!S_ISREG(lst.st_mode))
        return eng_fail(SHMQ_EFORMAT, "%s: is not a regular file, not a shmq spool; refusing to open it", path);
    int fd = open(path, O_RDWR | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
    if (fd < 0) {
        if (errno == ELOOP || errno == ENXIO || errno == EISDIR)
            return eng_fail(SHMQ_EFORMAT, "%s: is not a regular file, not a shmq spool; refusing to open it", path);
        return eng_fail(-errno, "%s: %s", path, strerror(errno));
    }
    if (fstat(fd, st) != 0 || !S_ISREG(st->st_mode)) {
        close(fd);
        return eng_fail(SHMQ_EFORMAT, "%s: is not a regular file, not a shmq spool; refusing to open it", path);
    }
    return fd;
}

/* ---- geometry ---- */

/* Decode and check the geometry block `raw` of a file of `size` bytes: every
 * offset checked against the file (Python's _format.unpack_geometry).  0, or
 * SHMQ_EFORMAT with what is wrong and what to do. */
int eng_geometry_check(const shmq_geometry *g, uint64_t size, const char *where) {
    if (size < SHMQ_HEADER_BYTES)
        return eng_fail(SHMQ_EFORMAT, "%s: not a shmq spool (file too small: %llu bytes)", where,
                        (unsigned long long)size);
    if (memcmp(g->magic, SHMQ_MAGIC_STRING, 8) != 0)
        return eng_fail(SHMQ_EFORMAT, "%s: not a shmq spool (bad magic); refusing to touch a foreign file", where);
    if (g->version != SHMQ_FORMAT_VERSION)
        return eng_fail(SHMQ_EFORMAT, "%s: spool format version %u, this engine reads version %d only: export it "
                        "with the shmq that wrote it and import it into a spool created by this one", where,
                        g->version, SHMQ_FORMAT_VERSION);
    if (eng_crc(0, (const unsigned char *)g, SHMQ_GEOMETRY_CRC_SPAN) != g->crc)
        return eng_fail(SHMQ_EFORMAT, "%s: spool header is corrupt (checksum mismatch); it cannot be repaired: "
                        "remove it ('shmq rm') and create it again", where);
    int ok = g->header_bytes == SHMQ_HEADER_BYTES && g->slot_bytes == SHMQ_SLOT_BYTES &&
             g->lease_bytes == SHMQ_LEASE_BYTES && g->slot_offset == SHMQ_SLOT_OFFSET && g->slot_count > 0 &&
             g->slot_count <= SHMQ_MAX_SLOTS &&
             g->lease_offset == g->slot_offset + (uint64_t)g->slot_count * g->slot_bytes &&
             g->ring_offset >= g->lease_offset + (uint64_t)g->lease_count * g->lease_bytes &&
             g->ring_offset % SHMQ_PAGE == 0 && g->ring_bytes >= SHMQ_MIN_RING_BYTES &&
             g->ring_bytes % SHMQ_PAGE == 0 && g->ring_bytes < SHMQ_MAX_COUNTER &&
             g->file_bytes == g->ring_offset + g->ring_bytes && g->policy <= SHMQ_POLICY_ERROR;
    for (int i = 0; ok && i < 16; i++) {
        char c = g->sem_prefix[i];
        ok = i < SHMQ_SEM_PREFIX_BYTES ? (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') : c == 0;
    }
    if (!ok) return eng_fail(SHMQ_EFORMAT, "%s: spool header is inconsistent; recreate the spool", where);
    if (size < g->file_bytes)
        return eng_fail(SHMQ_EFORMAT, "%s: truncated spool: the file has %llu bytes, its header says %llu; remove "
                        "it and create it again", where, (unsigned long long)size, (unsigned long long)g->file_bytes);
    return 0;
}

/* The geometry of a new spool, its CRC set. */
static void geometry_pack(shmq_geometry *g, uint64_t ring_bytes, unsigned slots, unsigned leases, int policy,
                          int checksum, const char *prefix) {
    memset(g, 0, sizeof *g);
    memcpy(g->magic, SHMQ_MAGIC_STRING, 8);
    g->version = SHMQ_FORMAT_VERSION;
    g->header_bytes = SHMQ_HEADER_BYTES;
    g->slot_offset = SHMQ_SLOT_OFFSET;
    g->slot_count = slots;
    g->slot_bytes = SHMQ_SLOT_BYTES;
    g->lease_offset = SHMQ_SLOT_OFFSET + (uint64_t)slots * SHMQ_SLOT_BYTES;
    g->lease_count = leases;
    g->lease_bytes = SHMQ_LEASE_BYTES;
    uint64_t end = g->lease_offset + (uint64_t)leases * SHMQ_LEASE_BYTES;
    g->ring_offset = (end + SHMQ_PAGE - 1) / SHMQ_PAGE * SHMQ_PAGE;
    g->ring_bytes = ring_bytes;
    g->file_bytes = g->ring_offset + ring_bytes;
    g->policy = (uint8_t)policy;
    g->checksum = checksum ? 1 : 0;
    g->flags = SHMQ_GEO_FLAG_HANDLE_LOCKS; /* shmq_open holds SHMQ_HANDLE_LOCK_BYTE while mapped */
    memcpy(g->sem_prefix, prefix, SHMQ_SEM_PREFIX_BYTES);
    g->created_ns = now_ns();
    g->crc = eng_crc(0, (const unsigned char *)g, SHMQ_GEOMETRY_CRC_SPAN);
}

/* ---- semaphore names of a prefix ---- */

/* Unlink the semaphores of `prefix`: the fixed ones, `slots` group ones, and
 * any other /dev/shm/sem.shmq.PREFIX.* (a spool whose header is unreadable);
 * only those owned by `owner` (-1: any). */
void eng_unlink_semaphores(const char *prefix, uint64_t slots, long owner) {
    char start[48];
    snprintf(start, sizeof start, "sem.shmq.%s.", prefix);
    DIR *d = opendir("/dev/shm");
    if (!d) return;
    struct dirent *e;
    while ((e = readdir(d))) {
        if (strncmp(e->d_name, start, strlen(start)) != 0) continue;
        if (owner >= 0) {
            struct stat st;
            if (fstatat(dirfd(d), e->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0 || (long)st.st_uid != owner) continue;
        }
        char name[300];
        snprintf(name, sizeof name, "/%s", e->d_name + 4);
        eng_sem_unlink(name);
    }
    closedir(d);
    (void)slots; /* every name of the prefix is in the scan */
}

/* The registry record that keeps `shmq gc` from taking the semaphores of a
 * spool outside /dev/shm itself for orphans (Python's register_spool). */
static void registry_path(const char *prefix, char *out, size_t cap) {
    char dir[64];
    default_dir(dir, sizeof dir);
    snprintf(out, cap, "%s/.spools/%s", dir, prefix);
}

static void register_spool(const char *prefix, const char *path, const char *tmp) {
    char dir[64], reg[128], parent[PATH_MAX];
    snprintf(parent, sizeof parent, "%s", path);
    if (!strcmp(dirname(parent), "/dev/shm")) return;
    default_dir(dir, sizeof dir);
    if (check_private_dir(dir, 1) < 0) return;
    snprintf(reg, sizeof reg, "%s/.spools", dir);
    if (mkdir(reg, 0700) != 0 && errno != EEXIST) return;
    registry_path(prefix, reg, sizeof reg);
    int fd = open(reg, O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0) return; /* best effort: gc then keeps less */
    char text[2 * PATH_MAX + 4];
    int n = snprintf(text, sizeof text, "%s\n%s\n", path, tmp);
    ssize_t w = write(fd, text, (size_t)n);
    (void)w;
    close(fd);
}

static void unregister_spool(const char *prefix) {
    char reg[128];
    registry_path(prefix, reg, sizeof reg);
    if (unlink(reg) == 0) {
        char *slash = strrchr(reg, '/');
        *slash = 0;
        rmdir(reg); /* only when empty */
    }
}

/* ---- create ---- */

/* The temporary name a spool NAME is created under, then linked to NAME: TAG
 * is 12 random hex digits (string literals or printf conversions). */
#define CREATING_NAME(name, tag) "." name "." tag ".creating"

/* Create a spool file at `path` (resolved), fully initialized, appearing only
 * once complete (link), its semaphores created exclusively with its mode.
 * 0, -EEXIST (something is there), or a code. */
int eng_create_file(const char *path, uint64_t ring_bytes, uint64_t start_bytes, int policy, unsigned mode,
                    unsigned slots, unsigned leases, int checksum) {
    if (policy < 0 || policy > SHMQ_POLICY_ERROR || slots < 1 || slots > SHMQ_MAX_SLOTS || leases > (1u << 20) ||
        mode > 07777 || ring_bytes == 0 || ring_bytes >= SHMQ_MAX_COUNTER)
        return eng_fail(-EINVAL, "bad spool options (policy, readers 1..%d, leases, mode or capacity)", SHMQ_MAX_SLOTS);
    ring_bytes = (ring_bytes + SHMQ_PAGE - 1) / SHMQ_PAGE * SHMQ_PAGE;
    if (ring_bytes < SHMQ_MIN_RING_BYTES) ring_bytes = SHMQ_MIN_RING_BYTES;
    uint64_t seg = 0, window = 0;
    if (start_bytes && start_bytes < ring_bytes) { /* growable: whole segments of 64 KiB..4 MiB (growth_plan) */
        seg = (start_bytes + SHMQ_PAGE - 1) / SHMQ_PAGE * SHMQ_PAGE;
        if (seg < SHMQ_MIN_SEGMENT) seg = SHMQ_MIN_SEGMENT;
        if (seg > SHMQ_MAX_SEGMENT) seg = SHMQ_MAX_SEGMENT;
        if (seg > ring_bytes) seg = ring_bytes;
        window = (start_bytes + seg - 1) / seg * seg;
        if (window > ring_bytes) window = ring_bytes;
    }
    char parent[PATH_MAX], base[PATH_MAX], tmp[PATH_MAX + 64];
    snprintf(parent, sizeof parent, "%s", path);
    snprintf(base, sizeof base, "%s", path);
    const char *pdir = dirname(parent), *pbase = basename(base);
    /* Created under CREATING_NAME, then linked to NAME: NAME must leave room. */
    long name_max = pathconf(pdir, _PC_NAME_MAX);
    if (name_max <= 0) name_max = 255;
    size_t extra = strlen(CREATING_NAME("", "")) + 12; /* the tag's 12 hex digits */
    if (strlen(pbase) + extra > (size_t)name_max)
        return eng_fail(-ENAMETOOLONG, "%s: spool file name too long: %zu bytes, at most %ld (a spool is created "
                        "under a temporary name %zu bytes longer)", path, strlen(pbase), name_max - (long)extra, extra);
    unsigned char rnd[6];
    int ufd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
    if (ufd < 0 || read(ufd, rnd, sizeof rnd) != (ssize_t)sizeof rnd) {
        if (ufd >= 0) close(ufd);
        return eng_fail(-EIO, "/dev/urandom: cannot read");
    }
    close(ufd);
    char tag[13];
    snprintf(tag, sizeof tag, "%02x%02x%02x%02x%02x%02x", rnd[0], rnd[1], rnd[2], rnd[3], rnd[4], rnd[5]);
    snprintf(tmp, sizeof tmp, "%s/" CREATING_NAME("%s", "%s"), pdir, pbase, tag);
    int fd = open(tmp, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0) return eng_fail(-errno, "%s: %s", tmp, strerror(errno));
    struct stat st;
    fstat(fd, &st);
    char prefix[16];
    eng_sem_prefix(&st, prefix);
    /* Our semaphores with this prefix can only be debris of a spool removed
     * without destroy whose inode number this file now reuses; another user's
     * are left alone (and make the exclusive creation below fail). */
    eng_unlink_semaphores(prefix, 0, (long)geteuid());
    register_spool(prefix, path, tmp); /* before its semaphores exist: shmq gc keeps them */
    shmq_geometry g;
    geometry_pack(&g, ring_bytes, slots, leases, policy, checksum, prefix);
    int rc = 0, linked = 0;
    if (fchmod(fd, mode) != 0) {
        rc = eng_fail(-errno, "%s: %s", tmp, strerror(errno));
        goto out;
    }
    /* Not sparse: every page reserved now, so a full tmpfs fails here and not
     * as SIGBUS in a put.  A growable ring is sparse past its first segments. */
    uint64_t alloc = window ? g.ring_offset + window : g.file_bytes;
    if (window && ftruncate(fd, (off_t)g.file_bytes) != 0) {
        rc = eng_fail(-errno, "%s: %s", tmp, strerror(errno));
        goto out;
    }
    int fa = posix_fallocate(fd, 0, (off_t)alloc);
    if (fa == ENOSPC) {
        rc = eng_fail(-ENOSPC, "%s: no room for a spool of %llu bytes", pdir, (unsigned long long)alloc);
        goto out;
    }
    if (fa != 0 && ftruncate(fd, (off_t)g.file_bytes) != 0) {
        rc = eng_fail(-errno, "%s: %s", tmp, strerror(errno));
        goto out;
    }
    const char *which[3] = {"w", "r", "f"};
    for (int i = 0; i < 3; i++) {
        char name[64];
        int err = 0;
        eng_sem_name(prefix, which[i], name, sizeof name);
        sem_t *s = eng_sem_open(name, i == 0, mode & 0666, -1, -1, ENG_SEM_CREATE, &err);
        if (s == SEM_FAILED) {
            rc = err;
            goto out;
        }
        sem_close(s);
    }
    if (pwrite(fd, &g, sizeof g, 0) != (ssize_t)sizeof g) {
        rc = eng_fail(-EIO, "%s: cannot write the header", tmp);
        goto out;
    }
    if (window) {
        uint64_t words[2] = {window, window};
        if (pwrite(fd, words, sizeof words, SHMQ_W_ALLOC_MIN * 8) != (ssize_t)sizeof words ||
            pwrite(fd, &seg, 8, SHMQ_W_SEGMENT * 8) != 8) {
            rc = eng_fail(-EIO, "%s: cannot write the header", tmp);
            goto out;
        }
    }
    if (link(tmp, path) != 0) { /* atomic publish; never replaces an existing file */
        rc = eng_fail(-errno, "%s: %s", path, errno == EEXIST ? "a file already exists there" : strerror(errno));
        goto out;
    }
    linked = 1;
out:
    close(fd);
    unlink(tmp);
    if (!linked) {
        eng_unlink_semaphores(prefix, 0, (long)geteuid());
        unregister_spool(prefix);
    }
    return rc;
}

/* ---- destroy ---- */

/* Unlink the spool at `path` (resolved) and its semaphores, whatever state the
 * file is in; a file that is not a spool and has no semaphore of ours is
 * left alone (SHMQ_EFORMAT).  The file goes first, the semaphores after it
 * (Python's destroy_file says why). */
int eng_destroy_file(const char *path) {
    struct stat st;
    int fd = eng_open_file(path, &st);
    if (fd < 0) return fd;
    char derived[16], prefix[16] = {0};
    eng_sem_prefix(&st, derived);
    shmq_geometry g;
    int known = pread(fd, &g, sizeof g, 0) == (ssize_t)sizeof g && eng_geometry_check(&g, (uint64_t)st.st_size, path) == 0;
    if (known) memcpy(prefix, g.sem_prefix, SHMQ_SEM_PREFIX_BYTES);
    if (!known && memcmp(g.magic, SHMQ_MAGIC_STRING, 8) != 0) {
        char name[64];
        eng_sem_name(derived, "w", name, sizeof name);
        char file[96];
        snprintf(file, sizeof file, "/dev/shm/sem.%s", name + 1);
        if (access(file, F_OK) != 0) {
            close(fd);
            return eng_fail(SHMQ_EFORMAT, "%s: not a shmq spool; left alone", path);
        }
    }
    struct stat now;
    if (lstat(path, &now) != 0 || now.st_dev != st.st_dev || now.st_ino != st.st_ino) {
        close(fd);
        return eng_fail(SHMQ_EFORMAT, "%s: was replaced while being destroyed; left alone", path);
    }
    long owner = st.st_uid == geteuid() && (st.st_mode & 022) ? -1 : (long)st.st_uid;
    int rc = unlink(path) == 0 ? 0 : eng_fail(-errno, "%s: %s", path, strerror(errno));
    if (rc == 0) {
        eng_unlink_semaphores(derived, 0, owner);
        if (known && strcmp(prefix, derived)) eng_unlink_semaphores(prefix, 0, owner);
    }
    close(fd);
    if (rc == 0) {
        unregister_spool(derived);
        if (known && strcmp(prefix, derived)) unregister_spool(prefix);
    }
    return rc;
}
