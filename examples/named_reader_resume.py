"""A named reader resumes where it left off, across processes and restarts.

Run: python examples/named_reader_resume.py
"""

import multiprocessing as mp
import os
import tempfile

import shmq


def consume(path, n):
    sp = shmq.Spool.open(path)
    r = sp.reader("billing")  # resumes from the committed position
    seqs = [r.get(timeout=5).seq for _ in range(n)]
    print(f"pid {os.getpid()} read seqs {seqs}")
    sp.close()


if __name__ == "__main__":
    tmp = tempfile.mkdtemp(dir="/dev/shm")
    path = os.path.join(tmp, "resume")
    sp = shmq.Spool.create(path, capacity="1MiB")
    for i in range(6):
        sp.put(f"invoice {i}".encode())
    for _ in range(2):  # two consumer "restarts", each picks up where the last stopped
        p = mp.Process(target=consume, args=(path, 3))
        p.start()
        p.join(30)
        assert p.exitcode == 0
    print("committed position:", [r.position for r in sp.readers()])
    sp.close()
    shmq.Spool.destroy(path)
    os.rmdir(tmp)
