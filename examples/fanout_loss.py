"""Fan-out with loss accounting: an overwrite spool never blocks its writer;
a slow reader's skipped frames are counted exactly.

Run: python examples/fanout_loss.py
"""

import os
import tempfile

import shmq

tmp = tempfile.mkdtemp(dir="/dev/shm")
path = os.path.join(tmp, "fanout")
sp = shmq.Spool.create(path, capacity="16KiB", on_full="overwrite")
fast, slow = sp.reader("fast"), sp.reader("slow")
for i in range(2000):
    sp.put(i.to_bytes(8, "little") * 8)
    fast.get()  # keeps up
got = slow.get_many(10_000)  # only now catches up: most frames were overwritten
print(f"fast: lost {fast.lost}; slow: received {len(got)}, lost {slow.lost}, "
      f"total {len(got) + slow.lost}")
assert len(got) + slow.lost == 2000
sp.close()
shmq.Spool.destroy(path)
os.rmdir(tmp)
