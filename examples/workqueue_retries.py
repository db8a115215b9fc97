"""A reliable work queue: leases, retries, dead letters, dedup by key, delays.

Run: python examples/workqueue_retries.py
"""

import multiprocessing as mp
import os
import tempfile

import shmq


def consumer(path, results):
    wq = shmq.WorkQueue(path)
    done = []
    try:
        while True:
            msg = wq.get(timeout=1.0, lease=10.0)  # leased: redelivered if we die
            if msg.body == "poison":
                msg.nack(error=ValueError("cannot process poison"))  # retried, then dead-lettered
                continue
            done.append(msg.body)
            msg.ack()
    except shmq.Empty:
        pass
    results.put(done)
    wq.close()


if __name__ == "__main__":
    tmp = tempfile.mkdtemp(dir="/dev/shm")
    path = os.path.join(tmp, "jobs")
    wq = shmq.WorkQueue(path, max_attempts=3)
    wq.put("profile v1", key="user:42")
    wq.put("profile v2", key="user:42")  # replaces v1: it was not delivered yet
    wq.put("reminder", delay=0.5)  # not before half a second, without blocking the rest
    wq.put("poison")
    wq.put_many([f"job {i}" for i in range(6)])
    results = mp.Queue()
    procs = [mp.Process(target=consumer, args=(path, results)) for _ in range(2)]
    for p in procs:
        p.start()
    done = sorted(x for _ in procs for x in results.get(timeout=60))
    for p in procs:
        p.join(30)
    print("processed:", done)
    assert "profile v1" not in done and "profile v2" in done and "reminder" in done
    for dl in wq.dead_letters():
        print(f"dead letter: {dl.body!r} after {dl.attempts} attempts: "
              f"{dl.error['type']}: {dl.error['message']}")
    print("stats:", wq.stats())
    wq.close()
    shmq.WorkQueue.destroy(path)
    os.rmdir(tmp)
