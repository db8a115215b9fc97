"""Replacing multiprocessing.Queue with shmq.Queue: change the import, nothing else.

Run: python examples/queue_migration.py
"""

import multiprocessing as mp
import time

import numpy as np

import shmq  # was: from multiprocessing import Queue, JoinableQueue


def worker(tasks, results):
    for item in iter(tasks.get, None):  # the stdlib idiom works unchanged
        results.put((item["id"], float(item["data"].sum())))
        tasks.task_done()
    tasks.task_done()


if __name__ == "__main__":
    tasks = shmq.JoinableQueue()  # was: multiprocessing.JoinableQueue()
    results = shmq.Queue()  # was: multiprocessing.Queue()
    procs = [mp.Process(target=worker, args=(tasks, results)) for _ in range(2)]
    for p in procs:
        p.start()
    t = time.perf_counter()
    for i in range(200):  # numpy arrays travel out-of-band: one copy in, one copy out
        tasks.put({"id": i, "data": np.full(10_000, i, dtype=np.float64)})
    for _ in procs:
        tasks.put(None)
    tasks.join()  # every task_done() arrived
    sums = dict(results.get(timeout=10) for _ in range(200))
    for p in procs:
        p.join(30)
    assert all(sums[i] == i * 10_000 for i in range(200))
    print(f"200 tasks of 80 kB through 2 workers in {time.perf_counter() - t:.2f} s; all sums correct")
    # beyond the stdlib: atomic batches
    results.put_many(range(5))
    print("get_many:", results.get_many(10))
    tasks.close()
    results.close()  # the creator's close removes the queue's file and semaphores
