"""Competing consumers: a group gives each frame to exactly one member.

Run: python examples/group_workers.py
"""

import multiprocessing as mp
import os
import tempfile

import shmq


def worker(path, results):
    sp = shmq.Spool.open(path)
    r = sp.reader("workers", group=True)
    done = []
    try:
        while True:
            done.append(int(r.get(timeout=1.0).data))
    except shmq.Empty:  # idle for a second: the queue is drained
        pass
    results.put((os.getpid(), done))
    sp.close()


if __name__ == "__main__":
    tmp = tempfile.mkdtemp(dir="/dev/shm")
    path = os.path.join(tmp, "jobs")
    # block: writers wait for the group instead of overwriting unconsumed jobs
    sp = shmq.Spool.create(path, capacity="64KiB", on_full="block")
    sp.reader("workers", group=True).close()  # register the group before writing
    results = mp.Queue()
    procs = [mp.Process(target=worker, args=(path, results)) for _ in range(3)]
    for p in procs:
        p.start()
    for job in range(3000):
        sp.put(str(job).encode())
    seen = []
    for _ in procs:
        pid, done = results.get(timeout=60)
        print(f"worker {pid} handled {len(done)} jobs")
        seen += done
    for p in procs:
        p.join(30)
    assert sorted(seen) == list(range(3000)), "every job exactly once"
    print("all 3000 jobs handled exactly once")
    sp.close()
    shmq.Spool.destroy(path)
    os.rmdir(tmp)
