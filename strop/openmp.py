"""One busy OpenMP team at a time on a CPU.

torch's CPU wheels run parallel ops on GNU OpenMP (libgomp), which gives every thread that runs one
a pool of worker threads of its own, kept for the thread's life. Once a process holds more such
threads than the machine has CPUs, libgomp stops spinning between parallel regions (its
"throttled" spin count, at most 1000 iterations), so every one of the hundreds of small ops of a
decode step waits for sleeping workers to be woken. A run has two torch threads that take turns:
the trainer's and the embedded engine's. Whichever is about to wait for the other frees its pool
(``omp_pause_resource_all``, OpenMP 5.0; libgomp starts a new pool at the thread's next parallel
op), so the one working keeps a team that spins.

Measured on 2 cores (bench/rollout_path.py): a 64-row rollout decoded while a second, idle pool
was alive spent 4.5-6.5 s of CPU idle per rollout and ran 1.17-1.34x longer; with that pool
freed, 0.2 s idle, as with no second pool at all.
"""

from __future__ import annotations

import ctypes
import functools
from concurrent.futures import ThreadPoolExecutor

_lib: ctypes.CDLL | None | bool = None  # None: not looked for yet; False: looked for, none usable


def _libgomp() -> ctypes.CDLL | None:
    """The libgomp this process loaded (torch's own copy), or None (another OpenMP runtime, or not
    Linux). Looked for once: it is called after every piece of handed-off work."""
    global _lib
    if _lib is None:
        _lib = False
        try:
            with open("/proc/self/maps") as f:
                paths = sorted({line.split()[-1] for line in f if "/libgomp" in line})
        except OSError:  # not Linux: nothing to do
            paths = []
        for path in paths:
            try:
                lib = ctypes.CDLL(path)  # already loaded: the same handle
            except OSError:
                continue
            if hasattr(lib, "omp_pause_resource_all"):
                _lib = lib
                break
    return _lib or None


def release_threads() -> bool:
    """Free the calling thread's OpenMP worker threads (they come back at its next parallel op).
    Returns False where there is nothing to free this way (no libgomp loaded, or one without
    ``omp_pause_resource_all``)."""
    lib = _libgomp()
    return lib is not None and lib.omp_pause_resource_all(1) == 0  # omp_pause_soft


def releasing(fn):
    """``fn`` that frees its thread's OpenMP pool when it returns: for torch work handed to a thread
    that then waits (a pool thread of an event loop), so its pool does not stay beside the working one."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        finally:
            release_threads()

    return run


class ReleasingThreadPool(ThreadPoolExecutor):
    """A thread pool whose threads free their OpenMP pool after every piece of work: the run's event
    loop's default executor, where ``asyncio.to_thread`` hands off torch work (filling weight buckets,
    writing and hashing weights) that would otherwise leave a pool alive per thread."""

    def submit(self, fn, /, *args, **kwargs):
        return super().submit(releasing(fn), *args, **kwargs)
