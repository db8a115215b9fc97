"""Create a spool, write frames, read them with an anonymous and a named reader.

Run: python examples/spool_basics.py
"""

import os
import tempfile

import shmq

tmp = tempfile.mkdtemp(dir="/dev/shm")
path = os.path.join(tmp, "basics")
sp = shmq.Spool.create(path, capacity="1MiB", on_full="overwrite")
try:
    first = sp.put(b"hello")
    sp.put_many([b"one", b"atomic", b"batch"])  # all visible at once, consecutive seqs
    print("first seq:", first, "next seq:", sp.next_seq)

    tail = sp.reader()  # anonymous: private cursor, never holds writers back
    for frame in tail.get_many(10):
        print(f"  seq {frame.seq}: {frame.data!r}")

    named = sp.reader("indexer")  # durable: position kept in the spool
    print("named reader got", named.get().data, "- position now", named.position)
    print("stats: puts", sp.stats().puts, "readers", [r.name for r in sp.readers()])
finally:
    sp.close()
    shmq.Spool.destroy(path)
    os.rmdir(tmp)
