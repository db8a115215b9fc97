"""asyncio: await frames; the event loop watches the spool's inotify fd.

Run: python examples/async_reader.py
"""

import asyncio
import os
import tempfile

import shmq


async def main(path):
    sp = shmq.Spool.open(path)
    r = sp.reader(start="latest")

    async def produce():
        for i in range(3):
            await asyncio.sleep(0.05)
            sp.put(f"tick {i}".encode())

    producer = asyncio.create_task(produce())
    for _ in range(3):
        frame = await r.get_async(timeout=5)
        print("got", frame.data.decode())
    await producer
    sp.close()


tmp = tempfile.mkdtemp(dir="/dev/shm")
path = os.path.join(tmp, "async")
shmq.Spool.create(path, capacity="64KiB").close()
asyncio.run(main(path))
shmq.Spool.destroy(path)
os.rmdir(tmp)
