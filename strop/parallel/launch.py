"""Run a function on N local processes with a gloo (CPU) or NCCL (GPU) group, with a timeout.

Used by the distributed tests and benchmarks: a rank that hangs makes the call
fail after ``timeout`` seconds instead of stalling; every child is ended.

Ranks are forked from a server process that imported torch and ``fn``'s module once (multiprocessing's
"forkserver", where the platform has it): each call's ranks start in a fraction of a second instead of importing torch
again (about 2.7 s of CPU a rank on a 2-core AMD EPYC, and the distributed tests make about a hundred such calls).
The server only imports; each rank is a fresh fork of it and takes the caller's environment and working directory, as
a spawned one would. What only a new process reads (OpenMP's, MKL's and glibc's variables, read when torch or the C
library loads) cannot reach a fork: ranks are spawned instead when the call passes ``env`` (their processes start with
it) or when the caller's such variables differ from the server's, and so is a ``fn`` defined in a script's
``__main__``.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import queue as queue_module
import time
import traceback
from typing import Any, Callable

from strop.process import free_port


PRELOAD = ["torch", "torch.distributed"]  # what the fork server imports before the function's own module
AT_START = ("OMP_", "GOMP_", "KMP_", "MKL_", "MALLOC_", "LD_")  # variables only a new process reads
_server: dict = {}  # "env": the fork server's AT_START variables (it starts with the first forked call)


def _at_start() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith(AT_START)}


def _context(fn, env: dict | None) -> mp.context.BaseContext:
    """The start method for ``fn``'s ranks (see the module's text)."""
    module = getattr(fn, "__module__", None)
    forkable = module not in (None, "__main__") and not env and "forkserver" in mp.get_all_start_methods()
    if not forkable or _server.setdefault("env", _at_start()) != _at_start():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([*PRELOAD, module])  # (read when the server starts: the first call's module)
    return ctx


@contextlib.contextmanager
def _environment(env: dict | None):
    """``env`` in this process's environment while ranks are spawned (they start with it), then as it was."""
    saved = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _worker(fn, rank, world_size, port, backend, env, args, queue, caller, release):
    if caller is not None:  # a fork server's child: the caller's environment and directory, as a spawned rank has
        os.environ.clear()
        os.environ.update(caller[0])
        os.chdir(caller[1])
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    try:
        import torch
        import torch.distributed as dist

        if backend == "nccl":  # one GPU per rank, bound before the group exists
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world_size)
        try:
            # plain pickle: torch's multiprocessing pickler would pass tensors as shared-memory
            # handles, which die with this process before the parent reads them
            answer = (rank, "ok", pickle.dumps(fn(rank, world_size, *args)))
            if rank == 0:  # rank 0 holds the group's store: it answers, then stays until every rank is done
                queue.put(answer)
                release.wait()
        finally:
            dist.destroy_process_group()
        if rank != 0:  # (the others answer once out of the group)
            queue.put(answer)
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))


def run_on_ranks(
    fn: Callable,
    world_size: int = 2,
    *args,
    backend: str = "gloo",
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """``fn(rank, world_size, *args)`` on every rank (a module-level function); returns results by rank."""
    ctx = _context(fn, env)
    queue = ctx.Queue()
    port = free_port()
    caller = (dict(os.environ), os.getcwd()) if ctx.get_start_method() == "forkserver" else None
    release = ctx.Event()  # set once every rank has answered (or the call gave up): rank 0 may end then
    procs = [
        ctx.Process(
            target=_worker,
            args=(fn, r, world_size, port, backend, env or {}, args, queue, caller, release),
            daemon=True,
        )
        for r in range(world_size)
    ]
    with _environment(env if caller is None else None):  # (a spawned rank's process starts with ``env`` in it)
        for p in procs:
            p.start()
    results: dict[int, Any] = {}
    errors = []
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world_size:
            try:
                rank, status, value = queue.get(timeout=0.5)
            except queue_module.Empty:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in results]
                if dead and queue.empty():
                    time.sleep(0.5)  # a result may still be in flight from a rank that just exited
                    if queue.empty():
                        raise RuntimeError(
                            f"rank(s) {dead} exited without a result (exit codes {[procs[r].exitcode for r in dead]})"
                        ) from None
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"distributed run did not finish within {timeout:.0f}s (ranks done: "
                        f"{sorted(results)}); a rank is probably hung in a collective"
                    ) from None
                continue
            if status == "error":
                errors.append(f"rank {rank}:\n{value}")
            results[rank] = pickle.loads(value) if status == "ok" else value
    finally:
        release.set()
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("distributed run failed\n" + "\n".join(errors))
    return [results[r] for r in range(world_size)]
