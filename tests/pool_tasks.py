"""Tasks for tests/test_pool.py (importable in spawned workers), and the parent programs
its crash tests run in a process of their own: ``python pool_tasks.py SCENARIO METHOD DIR``."""

import glob
import os
import pickle
import signal
import sys
import time


def square(x):
    return x * x


def add(x, y=0):
    return x + y


def pid_of(_x=None):
    return os.getpid()


def raise_value_error(x):
    raise ValueError("bad", x)


def kill_self(sig=signal.SIGKILL):
    os.kill(os.getpid(), sig)
    time.sleep(60)


def segfault():
    import faulthandler

    faulthandler.disable()
    faulthandler._sigsegv()


def exit_with(code):
    os._exit(code)


def kill_once(marker, x):
    """SIGKILL our worker the first time (``marker`` does not exist yet), then return ``x``."""
    if not os.path.exists(marker):
        with open(marker, "w"):
            pass
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
    return x


def double(a):
    return a * 2


def double_in_place(a):
    a *= 2  # the worker's arguments are its own, writable (as with the stdlib)
    return a


def arrow_sum(batch):
    import pyarrow.compute as pc

    return pc.sum(batch.column(0)).as_py()


def init_global(value):
    global INITIALIZED
    INITIALIZED = value


def get_global(_x=None):
    return globals().get("INITIALIZED")


def init_fails():
    raise RuntimeError("initializer says no")


class FailsToUnpickle:
    """Pickles fine; unpickling raises (in whichever process loads it)."""

    def __reduce__(self):
        return (_unpickle_fails, ())


def _unpickle_fails():
    raise pickle.UnpicklingError("this object refuses to be loaded")


class ExitsWhenUnpickled:
    """Pickles fine; the process that unpickles it exits at once (code 3), as a
    spawned worker does whose main module exits or fails when it is imported."""

    def __reduce__(self):
        return (os._exit, (3,))


def takes(_arg):
    pass


class FailsToPickle:
    def __reduce__(self):
        raise pickle.PicklingError("this object refuses to be pickled")


def returns(obj):
    return obj


def fails_to_unpickle():
    """A result that pickles here and cannot be unpickled by the parent."""
    return FailsToUnpickle()


def touch_and_sleep(directory, seconds):
    """Show the test we run (a file named after our pid), then sleep."""
    with open(os.path.join(directory, str(os.getpid())), "w"):
        pass
    time.sleep(seconds)
    return os.getpid()


# -- parent programs for the crash tests --------------------------------------------------

def _wait_for_files(directory, n, limit=60.0):
    end = time.monotonic() + limit
    while len(os.listdir(directory)) < n and time.monotonic() < end:
        time.sleep(0.01)


def busy_pool(method, directory, face):
    """Start a pool of 2 workers busy for 600 s, say ``ready`` with our pid, then wait."""
    import shmq

    if face == "executor":
        pool = shmq.ProcessPoolExecutor(2, mp_context=method)
        futures = [pool.submit(touch_and_sleep, directory, 600) for _ in range(4)]
    else:
        pool = shmq.Pool(2, context=method)
        futures = [pool.apply_async(touch_and_sleep, (directory, 600)) for _ in range(4)]
    _wait_for_files(directory, 2)
    print("ready", os.getpid(), flush=True)
    return pool, futures


def main(argv):
    scenario, method, directory = argv[1:4]
    if scenario in ("wait", "ctrl-c"):  # busy pool, then block on a result until killed
        _pool, futures = busy_pool(method, directory, argv[4] if len(argv) > 4 else "executor")
        futures[0].result() if hasattr(futures[0], "result") else futures[0].get()
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")


def queues_of(pid):
    """The anonymous queue files process ``pid`` created (their names carry its pid)."""
    return glob.glob(f"/dev/shm/shmq-q-{pid}-*")


if __name__ == "__main__":
    main(sys.argv)
