"""A two-stage pipeline on shmq.Dispatcher: "fetch" -> "resize", chained by correlation id.

Run: python examples/dispatcher_pipeline.py

Each "fetch" message (an image URL) is handled in a worker process, which
publishes one "resize" message per thumbnail size with ``ctx.publish``: the
resizes carry the fetch's correlation id.  One resize fails on its first
attempt (a simulated transient error) and is retried; one message has a type
nobody handles and is dead-lettered.  Handlers report to a results spool;
the main process prints the chains and the dispatcher's metrics.

Handlers live at module level: worker processes import them by name.
"""

import json
import os
import shutil
import tempfile
import time

import shmq
from shmq.dispatch import Dispatcher, format_status

SIZES = (64, 256)
_spools = {}


def report(path, **record):
    sp = _spools.get(path) or _spools.setdefault(path, shmq.Spool.open(path))
    sp.put(json.dumps(record).encode())


def fetch(ctx, job):
    time.sleep(0.02)  # "download" the image
    for size in SIZES:
        ctx.publish("resize", {"results": job["results"], "url": job["url"], "size": size})
    report(job["results"], stage="fetch", url=job["url"], id=ctx.message_id,
           correlation_id=ctx.correlation_id, parent_id=ctx.parent_id, pid=os.getpid())


class Resizer:
    """scope="worker": one instance per worker process (think: a loaded model)."""

    def __init__(self):
        self.done = 0

    def handle(self, ctx, job):
        if job["url"].endswith("flaky.png") and job["size"] == 256 and ctx.attempt == 1:
            raise ConnectionError("image store hiccup")  # nacked, retried after retry_delay
        time.sleep(0.03)  # "resize"
        self.done += 1
        ctx.logger.info("resized %s to %d px", job["url"], job["size"])
        report(job["results"], stage="resize", url=job["url"], size=job["size"],
               id=ctx.message_id, correlation_id=ctx.correlation_id, parent_id=ctx.parent_id,
               attempt=ctx.attempt, pid=os.getpid(), done_by_this_instance=self.done)


def main():
    tmp = tempfile.mkdtemp(prefix="shmq-example-", dir="/dev/shm")
    path = os.path.join(tmp, "jobs")
    results = shmq.Spool.create(os.path.join(tmp, "results"), capacity="1MiB")
    reader = results.reader()
    d = Dispatcher(path, capacity="4MiB", dead_capacity="1MiB", max_attempts=2, grace=5.0)
    d.register("fetch", fetch, parallelism=2, timeout=10.0)
    d.register("resize", Resizer, scope="worker", parallelism=3, timeout=10.0,
               max_attempts=3, retry_delay=0.1)
    try:
        t0 = time.monotonic()
        d.start()
        print(f"started {d.workers()} in {time.monotonic() - t0:.2f} s")
        urls = [f"https://example.com/img/{name}.png" for name in ("cat", "dog", "flaky")]
        roots = {d.publish("fetch", {"url": u, "results": results.path}): u for u in urls}
        d.publish("crop", {"url": urls[0]})  # no handler: dead-lettered after 2 attempts
        expect = len(urls) * (1 + len(SIZES))
        got = []
        deadline = time.monotonic() + 60
        while len(got) < expect:
            got.append(json.loads(reader.get(timeout=max(0.0, deadline - time.monotonic())).data))
        print(f"{expect} handler runs in {time.monotonic() - t0:.2f} s\n")
        for root, url in roots.items():
            chain = [r for r in got if r["correlation_id"] == root]
            print(f"correlation id {root} ({url}):")
            for r in sorted(chain, key=lambda r: (r["stage"], r.get("size", 0))):
                what = r["stage"] + (f" {r['size']}px" if "size" in r else "")
                print(f"  {what:12} message {r['id']:>2}  parent {str(r['parent_id']):>4}  "
                      f"attempt {r.get('attempt', 1)}  pid {r['pid']}")
            assert len(chain) == 1 + len(SIZES)
        d.stop()  # every worker has exited: the counters below are final
        print()
        print(format_status(d.status()))
        with shmq.WorkQueue.open(path) as ingress:
            for dl in ingress.dead_letters():
                print(f"\ndead letter: {dl.headers['type']!r} message {dl.message_id} after "
                      f"{dl.attempts} attempts: {dl.error['type']}: {dl.error['message']}")
    finally:
        d.close()
        Dispatcher.destroy(path)
        results.close()
        shmq.Spool.destroy(results.path)
        shutil.rmtree(tmp)
    print(f"\nremoved {tmp}")


if __name__ == "__main__":
    main()
