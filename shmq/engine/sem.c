/*
 * shmq/engine/sem.c: a spool's POSIX named semaphores -- created
 * exclusively with the spool's mode, opened refusing a name another user
 * squatted, unlinked (docs/security.md, "Semaphores").
 *
 * glibc keeps the named semaphore "/NAME" in the file /dev/shm/sem.NAME,
 * created by sem_open with the umask applied, in a directory every user
 * shares.  So after sem_open the file is opened O_NOFOLLOW and fstat-ed:
 * a semaphore is used only if its creator could write the spool anyway
 * (us, the spool's owner, root, a member of the spool's group if the spool
 * is group-writable, anyone if it is world-writable), and our own gets the
 * spool's mode back (fchmod).  They are plain POSIX named semaphores:
 * posix_ipc or any sem_open of the same name operates them.
 */
#include "engine.h"

#include <grp.h>
#include <pwd.h>
#include <sys/stat.h>

#define SEM_DIR "/dev/shm"

static void sem_file(const char *name, char *out, size_t cap) {
    snprintf(out, cap, SEM_DIR "/sem.%s", name[0] == '/' ? name + 1 : name);
}

static const char *kind_of(mode_t m) {
    if (S_ISLNK(m)) return "a symbolic link";
    if (S_ISFIFO(m)) return "a FIFO (named pipe)";
    if (S_ISSOCK(m)) return "a socket";
    if (S_ISCHR(m)) return "a character device";
    if (S_ISBLK(m)) return "a block device";
    if (S_ISDIR(m)) return "a directory";
    return "not a regular file";
}

/* Is uid a member of group gid (primary or listed)? */
static int in_group(uid_t uid, gid_t gid) {
    char buf[16384];
    struct passwd pw, *pwp = NULL;
    if (getpwuid_r(uid, &pw, buf, sizeof buf, &pwp) != 0 || !pwp) return 0;
    if (pw.pw_gid == gid) return 1;
    char gbuf[65536];
    struct group gr, *grp = NULL;
    if (getgrgid_r(gid, &gr, gbuf, sizeof gbuf, &grp) != 0 || !grp) return 0;
    for (char **m = gr.gr_mem; m && *m; m++)
        if (strcmp(*m, pw.pw_name) == 0) return 1;
    return 0;
}

/* Could uid write a spool of this owner, mode and group (-1: none)?  Root could. */
static int could_write(uid_t uid, uid_t owner, unsigned mode, long group) {
    return uid == geteuid() || uid == owner || uid == 0 || (mode & 0002) ||
           ((mode & 0020) && group >= 0 && in_group(uid, (gid_t)group));
}

/* Refuse the semaphore `name` if another user who could not write the spool
 * created it; chmod our own to `mode` (sem_open applied the umask).  0, or
 * SHMQ_ESQUATTED with the message.  A name unlinked meanwhile is fine. */
int eng_sem_check(const char *name, long owner, unsigned mode, long group) {
    char path[320];
    sem_file(name, path, sizeof path);
    int fd = open(path, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
    if (fd < 0) {
        if (errno == EACCES) /* unreadable to us, yet sem_open worked: not ours */
            return eng_fail(SHMQ_ESQUATTED, "semaphore %s (%s) cannot be checked (permission denied); another "
                            "user may have squatted its name: refusing to use it", name, path);
        if (errno == ELOOP)
            return eng_fail(SHMQ_ESQUATTED, "semaphore %s (%s) is a symbolic link: another user may have "
                            "squatted its name; refusing to use it (remove that file, or recreate the spool)",
                            name, path);
        return 0; /* unlinked meanwhile (destroy): nothing to check */
    }
    struct stat st;
    int rc = 0;
    uid_t me = geteuid();
    if (owner < 0) owner = (long)me;
    if (fstat(fd, &st) != 0) {
        rc = -errno;
    } else if (!S_ISREG(st.st_mode)) {
        rc = eng_fail(SHMQ_ESQUATTED, "semaphore %s (%s) is %s: another user may have squatted its name; "
                      "refusing to use it (remove that file, or recreate the spool)", name, path,
                      kind_of(st.st_mode));
    } else if (!could_write(st.st_uid, (uid_t)owner, mode, group)) {
        rc = eng_fail(SHMQ_ESQUATTED, "semaphore %s (%s) belongs to uid %u, who cannot write the spool (you are "
                      "uid %u, its owner uid %ld): another user may have squatted its name; refusing to use it "
                      "(remove that file, or recreate the spool)", name, path, (unsigned)st.st_uid,
                      (unsigned)me, owner);
    } else if (st.st_uid == me && (st.st_mode & 07777) != mode) {
        (void)fchmod(fd, mode); /* best effort: the mode only widens who may lock */
    }
    close(fd);
    return rc;
}

/* Open (or create: a group's on first use, or after a reboot kept a disk
 * spool) the named semaphore `name`, readable and writable by whoever may use
 * a spool of `owner` (-1: us), `mode` and `group` (-1: none); `how`:
 * ENG_SEM_OPEN (open or create), ENG_SEM_CREATE (create exclusively: a
 * spool's own, at its creation), ENG_SEM_EXISTING (open only if it exists,
 * unchecked: fsck reading a value).  The semaphore, or SEM_FAILED with *err:
 * -errno (-EEXIST: a create found the name taken; -ENOENT: not there) or
 * SHMQ_ESQUATTED. */
sem_t *eng_sem_open(const char *name, unsigned initial, unsigned mode, long owner, long group, int how, int *err) {
    int flags = how == ENG_SEM_CREATE ? O_CREAT | O_EXCL : how == ENG_SEM_EXISTING ? 0 : O_CREAT;
    sem_t *s = sem_open(name, flags, (mode_t)mode, initial);
    if (s == SEM_FAILED) {
        *err = -errno;
        eng_fail(*err, "semaphore %s: %s", name, strerror(errno));
        return SEM_FAILED;
    }
    if (how == ENG_SEM_EXISTING) return s;
    int rc = eng_sem_check(name, owner, mode, group);
    if (rc < 0) {
        sem_close(s); /* not ours to unlink */
        *err = rc;
        return SEM_FAILED;
    }
    return s;
}

/* Unlink the named semaphore `name`: 0 (also when it did not exist), or -errno. */
int eng_sem_unlink(const char *name) {
    if (sem_unlink(name) == 0 || errno == ENOENT) return 0;
    return -errno;
}
