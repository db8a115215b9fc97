/*
 * shmq/engine/lock.c: the spool's locks -- a POSIX named semaphore taken
 * with a deadline and a holder word recorded the moment it is taken, fcntl
 * OFD region locks, process identity, and the recovery of a lock whose
 * holder died (docs/format.md, "Locks and recovery").  Python's
 * shmq._lock.RecoverableLock and the C API's writers and group readers use
 * the same functions, so a lock held by a dead C process is recovered by
 * Python and the other way round.
 *
 * A holder is one aligned word: pid in the low 32 bits, the low 32 bits of
 * the process's start stamp (eng_process_start) in the high 32, so a
 * recycled pid is not mistaken for the holder.
 */
#include "engine.h"

#include <signal.h>
#include <sys/stat.h>

/* Waits with a deadline on the monotonic clock (sem_clockwait, glibc 2.30);
 * where that is missing (manylinux_2_28's glibc 2.28, RHEL 8), sem_timedwait
 * on the wall clock: a clock step during a lock wait then lengthens or
 * shortens that one wait, which callers bound and retry anyway.
 * -DSHMQ_SEM_TIMEDWAIT asks for the latter anywhere: the ThreadSanitizer
 * build does (gcc 12's libtsan intercepts sem_timedwait, not sem_clockwait,
 * so it would miss the acquire of a contended lock: stress/tsan.py). */
#if !defined(SHMQ_SEM_TIMEDWAIT) && defined(__GLIBC__) && \
    (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 30))
#define SEM_WAIT_CLOCK CLOCK_MONOTONIC
#define SEM_WAIT_UNTIL(s, dl) sem_clockwait((s), CLOCK_MONOTONIC, (dl))
#else
#define SEM_WAIT_CLOCK CLOCK_REALTIME
#define SEM_WAIT_UNTIL(s, dl) sem_timedwait((s), (dl))
#endif

/* The first look at a stuck lock's holder comes this soon (Python's
 * shmq._lock.FIRST_LOOK_S): locks are held for microseconds. */
#define FIRST_LOOK_S 0.05
#define PID_MAX_LIMIT (4 * 1024 * 1024) /* Linux's largest pid (include/linux/threads.h) */

/* Wait for a POSIX semaphore for at most wait_s seconds, the caller's own
 * lock dropped while waiting (hooks).  0: acquired; 1: not within wait_s;
 * SHMQ_ECALLBACK: interrupted (the binding's signal handler raised: nothing
 * is held); SHMQ_ECLOSED: `busy`'s handle was closed meanwhile (nothing held);
 * -errno.  `busy` (a ring, or NULL) is marked busy while waiting, so that a
 * close by another thread meanwhile is deferred and this call fails cleanly
 * instead of touching an unmapped file.
 *
 * `word` (or NULL): the lock's shared holder word, set to `holder` the
 * moment the semaphore is taken, before the caller's lock is taken back.  A
 * lock held with no holder recorded for a whole recovery period is broken
 * as a dead holder's (eng_lock_recover), and taking the GIL back can take
 * that long in a process whose other threads hold it (seen under
 * emulation: one lease granted twice); recording it here leaves only the
 * instant between the wait's return and this store. */
int eng_sem_lock(sem_t *s, double wait_s, const eng_hooks *hooks, eng_ring *busy, uint64_t *word,
                 uint64_t holder) {
    if (sem_trywait(s) == 0) {
        if (word) st_rlx(word, holder);
        return 0;
    }
    if (errno != EAGAIN && errno != EINTR) return -errno;
    if (wait_s <= 0) return 1;
    struct timespec dl;
    clock_gettime(SEM_WAIT_CLOCK, &dl);
    double whole = (double)(long long)wait_s;
    dl.tv_sec += (time_t)whole;
    dl.tv_nsec += (long)((wait_s - whole) * 1e9);
    if (dl.tv_nsec >= 1000000000L) {
        dl.tv_sec += 1;
        dl.tv_nsec -= 1000000000L;
    }
    for (;;) {
        int rc, err;
        if (busy) atomic_fetch_add_explicit(&busy->busy, 1, memory_order_acq_rel);
        void *saved = hooks_unlock(hooks);
        rc = SEM_WAIT_UNTIL(s, &dl);
        err = errno;
        if (rc == 0 && word) st_rlx(word, holder); /* still mapped: `busy` is busy */
        hooks_relock(hooks, saved);
        if (busy) {
            atomic_fetch_sub_explicit(&busy->busy, 1, memory_order_acq_rel);
            if (ring_closing(busy) && rc == 0 && word) st_rlx(word, 0); /* given back just below */
            if (ring_closed_meanwhile(busy, rc == 0, s)) return SHMQ_ECLOSED;
        }
        if (rc == 0) return 0;
        if (err == ETIMEDOUT) return 1;
        if (err == EINTR) {
            if (hooks_interrupted(hooks)) return SHMQ_ECALLBACK; /* e.g. KeyboardInterrupt: we hold nothing */
            continue;
        }
        return -err;
    }
}

/* ---- process identity ---- */

/* Fields of /proc/PID/stat: *state and *start (clock ticks since boot).  0, or -1.
 * Read as "//proc/...": the same file on Linux, and under qemu-user (the
 * emulated aarch64 CI) the kernel's, not qemu's rewrite of a process's own
 * /proc/self/stat, whose start time differs from what every other process
 * reads for it (a live holder would look dead: docs/platforms.md). */
static int proc_stat(int pid, char *state, unsigned long long *start) {
    char path[64], buf[1024];
    snprintf(path, sizeof path, "//proc/%d/stat", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return -1;
    buf[n] = 0;
    char *p = strrchr(buf, ')'); /* the command name may hold spaces and parentheses */
    if (!p || p[1] != ' ') return -1;
    p += 2;
    *state = *p;
    /* field 3 is the state; field 22 the start time: 19 fields on */
    for (int field = 3; field < 22; field++) {
        p = strchr(p, ' ');
        if (!p) return -1;
        p++;
    }
    *start = strtoull(p, NULL, 10);
    return 0;
}

/* This boot's salt: the first 32 bits of the kernel's boot_id (0 if it
 * cannot be read), the same for every process of the host until it reboots. */
static uint64_t boot_salt(void) {
    static _Atomic uint64_t cached; /* the salt | 1 << 32 once read */
    uint64_t c = atomic_load_explicit(&cached, memory_order_relaxed);
    if (c) return c & 0xFFFFFFFFull;
    char buf[9] = {0}, *end = buf;
    uint64_t salt = 0;
    int fd = open("//proc/sys/kernel/random/boot_id", O_RDONLY | O_CLOEXEC);
    if (fd >= 0) {
        if (read(fd, buf, 8) == 8) salt = strtoull(buf, &end, 16); /* "8 hex digits-..." */
        close(fd);
        if (end != buf + 8) salt = 0;
    }
    atomic_store_explicit(&cached, salt | 1ull << 32, memory_order_relaxed);
    return salt;
}

/* Process `pid`'s start stamp (0: unknown): its start time in centiseconds
 * since boot (field 22 of /proc/PID/stat) plus this boot's salt.  Never the
 * wall clock: "btime" in /proc/stat is the wall clock minus the time since
 * boot, and it moves whenever the wall clock is stepped (a VM restored from
 * a snapshot, an NTP step), so two processes that read it on either side of
 * a step would disagree about when a third one started, and a live holder
 * would look dead.  The salt makes a holder recorded in a file that outlives
 * a reboot (a spool on disk) differ from the process that gets its pid and
 * start tick in the next boot. */
uint64_t eng_process_start(int pid) {
    char state;
    unsigned long long ticks;
    if (pid <= 0 || proc_stat(pid, &state, &ticks) < 0) return 0;
    long hz = sysconf(_SC_CLK_TCK);
    if (hz <= 0) hz = 100;
    return boot_salt() + (uint64_t)ticks * 100 / (uint64_t)hz;
}

/* This process's holder word (computed at each call: a fork child has its own). */
uint64_t eng_holder_word(void) {
    int pid = (int)getpid();
    return (uint64_t)(uint32_t)pid | (eng_process_start(pid) & 0xFFFFFFFFull) << 32;
}

/* 1 if process `pid` exists, is not a zombie and (check_start) started at
 * `start` (the low 32 bits of its eng_process_start stamp); 0 if not.  A
 * process whose state cannot be read (another user's, say, in a hardened
 * /proc) is alive: a live lock is never broken. */
int eng_process_alive(int pid, uint64_t start, int check_start) {
    if (pid <= 0 || pid > PID_MAX_LIMIT) return 0; /* a corrupt holder word is not a live process */
    if (kill(pid, 0) != 0 && errno == ESRCH) return 0;
    char state;
    unsigned long long ticks;
    if (proc_stat(pid, &state, &ticks) < 0) {
        char path[64];
        snprintf(path, sizeof path, "//proc/%d", pid);
        struct stat st;
        return stat(path, &st) == 0 || errno != ENOENT; /* gone between kill and here: dead */
    }
    if (state == 'Z' || state == 'X') return 0;
    if (!check_start) return 1;
    return (eng_process_start(pid) & 0xFFFFFFFFull) == (start & 0xFFFFFFFFull);
}

static int holder_alive(uint64_t word) { return eng_process_alive((int)(word & 0xFFFFFFFFu), word >> 32, 1); }

/* ---- fcntl OFD region locks (one byte) ---- */

static int ofd(int fd, int cmd, short type, uint64_t byte) {
    struct flock fl = {0};
    fl.l_type = type;
    fl.l_whence = SEEK_SET;
    fl.l_start = (off_t)byte;
    fl.l_len = 1;
    for (;;) {
        if (fcntl(fd, cmd, &fl) == 0) return cmd == F_OFD_GETLK ? fl.l_type != F_UNLCK : 0;
        if (errno != EINTR || cmd != F_OFD_SETLKW) break;
    }
    return -errno;
}

/* 0: locked; 1: another holder conflicts (not waiting); -errno. */
int eng_ofd_lock(int fd, uint64_t byte, int exclusive, int wait) {
    int rc = ofd(fd, wait ? F_OFD_SETLKW : F_OFD_SETLK, exclusive ? F_WRLCK : F_RDLCK, byte);
    return rc == -EAGAIN || rc == -EACCES ? 1 : rc;
}

int eng_ofd_unlock(int fd, uint64_t byte) { return ofd(fd, F_OFD_SETLK, F_UNLCK, byte); }

/* 1 if another open file description holds any lock on `byte`; 0; -errno. */
int eng_ofd_locked_by_other(int fd, uint64_t byte) { return ofd(fd, F_OFD_GETLK, F_WRLCK, byte); }

static double mono_s(void) { return (double)mono_ns() / 1e9; }

/* ---- the handle lock ---- */

/* Take the handle lock (SHMQ_HANDLE_LOCK_BYTE, shared) on `fd`: every handle,
 * Python's or the C API's, holds it while it has the spool mapped, so an
 * exclusive attempt elsewhere (shmq.anonymous's orphan check) fails while any
 * handle exists.  Never released explicitly: the kernel drops it when the
 * last descriptor of fd's open file description closes (a fork child sharing
 * it keeps it), at the latest when the process dies.
 *
 * Waits only while another process holds it exclusively -- shmq removing an
 * orphaned queue, for the milliseconds its unlinks take -- polling (0.5 ms,
 * doubling to 50 ms) with the caller's lock dropped, for at most wait_s.  A
 * filesystem without fcntl locks (some network mounts) has none to hold: 0.
 * 0: held; 1: still held exclusively after wait_s; SHMQ_ECALLBACK: the
 * caller's interrupt check failed (Ctrl-C); -errno. */
int eng_hold_handle_lock(int fd, double wait_s, const eng_hooks *hooks) {
    double deadline = -1.0;
    long delay_ns = 500000L;
    for (;;) {
        int rc = eng_ofd_lock(fd, SHMQ_HANDLE_LOCK_BYTE, 0, 0);
        if (rc == -ENOLCK || rc == -EINVAL || rc == -EOPNOTSUPP) return 0;
        if (rc <= 0) return rc;
        double now = mono_s();
        if (deadline < 0) deadline = now + wait_s;
        else if (now > deadline) return 1;
        void *saved = hooks_unlock(hooks);
        struct timespec ts = {0, delay_ns};
        nanosleep(&ts, NULL);
        hooks_relock(hooks, saved);
        if (hooks_interrupted(hooks)) return SHMQ_ECALLBACK;
        delay_ns = delay_ns >= 25000000L ? 50000000L : 2 * delay_ns;
    }
}

/* ---- recovering a dead holder's lock ---- */

/* Take over a dead holder's lock (holder word `word` seen): under the
 * recovery byte's OFD lock (one process at a time; the per-handle mutex
 * orders this process's threads, which share the descriptor), re-check that
 * neither the token nor the holder changed and the semaphore is still taken,
 * then record us, bump the token (and the breaks), and repair.  1: broken
 * (we hold it); 0: not (recovered or released meanwhile); < 0: an error. */
static int break_lock(const eng_lock_ref *l, uint64_t word) {
    pthread_mutex_t *mu = l->mu;
    const eng_hooks *hooks = l->hooks;
    uint64_t token = ld_acq(l->token);
    void *saved = hooks_unlock(hooks); /* a recoverer that died holding it is dropped by the kernel */
    if (mu) pthread_mutex_lock(mu);
    int rc = eng_ofd_lock(l->fd, l->recovery_byte, 1, 1);
    hooks_relock(hooks, saved);
    if (rc != 0) {
        if (mu) pthread_mutex_unlock(mu);
        return rc < 0 ? rc : 0;
    }
    int v = 1, broke = 0;
    if (ld_acq(l->token) == token && ld_acq(l->holder) == word && sem_getvalue(l->sem, &v) == 0 && v <= 0) {
        st_rlx(l->holder, l->me);
        st_rel(l->token, token + 1);
        if (l->breaks) st_rlx(l->breaks, ld_rlx(l->breaks) + 1);
        /* The semaphore stays at 0: we inherit the dead holder's acquisition
         * instead of posting and racing for it. */
        broke = 1;
        if (l->on_recover && l->on_recover(l->ctx, (uint32_t)(word & 0xFFFFFFFFu)) < 0) broke = SHMQ_ECALLBACK;
    }
    eng_ofd_unlock(l->fd, l->recovery_byte);
    if (mu) pthread_mutex_unlock(mu);
    return broke;
}

/* Break the lock if its recorded holder is dead; 1 if it was broken (and
 * released again at once: the caller retries), 0 if not, < 0 an error (an
 * on_recover that failed still leaves the lock released).
 *
 * Called after a wait for the lock failed (FIRST_LOOK_S the first time,
 * recovery_timeout after that).  A lock held with no holder recorded is
 * broken only if looks have found it so for at least one whole
 * recovery_timeout (a holder between sem_wait and recording itself, or
 * killed between clearing and sem_post), counting only consecutive looks of
 * one wait (at most a period apart): a look that caught another holder's
 * instant before it recorded itself, in an earlier wait, must not count. */
int eng_lock_recover(const eng_lock_ref *l) {
    uint64_t word = ld_acq(l->holder);
    if (word && holder_alive(word)) {
        *l->unknown_last = -1e9;
        return 0;
    }
    if (!word) {
        double now = mono_s(), rt = l->recovery_timeout;
        if (now - *l->unknown_last > 1.5 * rt + FIRST_LOOK_S) *l->unknown_since = now;
        *l->unknown_last = now;
        if (now - *l->unknown_since < rt) return 0;
    }
    *l->unknown_last = -1e9;
    int broke = break_lock(l, word);
    if (broke == 1 || broke == SHMQ_ECALLBACK) {
        st_rlx(l->holder, 0);
        sem_post(l->sem);
    }
    return broke;
}
