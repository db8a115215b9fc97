"""A program (run by tests/test_anonymous.py with ``python -W error``): a child
creates an anonymous queue and is SIGKILLed; this process then creates a new
Queue, which reclaims the dead child's queue.  Its exit must be silent: what
shmq removed, it took out of the resource tracker too (the tracker prints to
this process's stderr when it finds a registered name gone at exit).

    python -W error tests/killed_creator_exit.py fork|spawn|forkserver

Exit status 0 when the new Queue() removed the queue, 3 when another process
of this user removed it first (then the run shows nothing: the caller retries).
"""

import multiprocessing as mp
import os
import signal
import sys
import time

import shmq
import shmq.anonymous

WAIT_S = 60.0


def create(conn):
    q = shmq.Queue()
    q.put("left behind")
    conn.send(q.path)
    conn.recv()  # until SIGKILLed


def main(method):
    ctx = mp.get_context(method)
    first = shmq.Queue()  # this program's own queue: it uses the resource tracker first
    mine, theirs = ctx.Pipe()
    creator = ctx.Process(target=create, args=(theirs,))
    creator.start()
    if not mine.poll(WAIT_S):
        creator.kill()
        sys.exit("the creator did not report")
    path = mine.recv()
    # Held while the creator dies, so that no other process of this user (another
    # test run's Queue(), shmq gc) can reclaim it before this one does.
    hold = shmq.Spool.open(path)
    os.kill(creator.pid, signal.SIGKILL)
    creator.join(WAIT_S)
    hold.close()

    outcomes = {}
    probe = shmq.anonymous._reclaim_one

    def observed(p, creator):  # watched, not changed: did this process remove it?
        result = probe(p, creator)
        outcomes[p] = result[0]
        return result

    # A new Queue() reclaims the dead creator's queue.  Another process of this user may
    # hold a handle to it for a moment (another test's `shmq top -a` or sweep opens every
    # anonymous queue): then it is in use, rightly kept, and the next Queue() reclaims it.
    shmq.anonymous._reclaim_one = observed
    end = time.monotonic() + WAIT_S
    while True:
        second = shmq.Queue()
        if not os.path.exists(path) or outcomes.get(path) != shmq.anonymous.IN_USE or time.monotonic() > end:
            break
        second.close()
        time.sleep(0.05)  # (a retry: the other process's handle is not ours to wait on)
    shmq.anonymous._reclaim_one = probe
    if os.path.exists(path):
        sys.exit(f"{path} is still there after a new Queue() (last outcome {outcomes.get(path)})")
    second.close()
    first.close()
    return 0 if outcomes.get(path) == shmq.anonymous.REMOVED else 3


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
