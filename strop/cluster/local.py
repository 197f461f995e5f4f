"""The local launcher: ``strop train --nproc N`` starts N ranks of ``strop train`` on this machine."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from strop.cluster.process import free_port


def launch(nproc: int, argv: list[str], command: list[str] | None = None, poll_s: float = 0.5) -> int:
    """``strop train --nproc N``: start N local ranks of ``strop train`` and wait for all.

    Worker stderr goes to files that are read while the ranks run (a pipe nobody drains
    blocks a worker that writes more than its buffer). When a rank exits with an error,
    every other rank is terminated (then killed), and the failed ranks' stderr tails are
    printed. ``command`` replaces ``python -m strop.cli train`` (tests).
    """
    import tempfile

    command = command or [sys.executable, "-m", "strop.cli", "train"]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(nproc))
    procs, logs = [], []
    with tempfile.TemporaryDirectory(prefix="strop-ranks-") as tmp:
        for rank in range(nproc):
            rank_env = dict(env, RANK=str(rank), LOCAL_RANK=str(rank))
            err = None if rank == 0 else open(os.path.join(tmp, f"rank{rank}.stderr"), "wb")
            logs.append(err)
            procs.append(subprocess.Popen([*command, *argv], env=rank_env, stderr=err,
                                          stdout=None if rank == 0 else subprocess.DEVNULL))  # only rank 0 talks
        codes: list[int | None] = [None] * nproc
        stopped = []
        try:
            while any(c is None for c in codes):
                for i, p in enumerate(procs):
                    codes[i] = p.poll() if codes[i] is None else codes[i]
                failed = [i for i, c in enumerate(codes) if c not in (0, None)]
                if failed:  # the others would wait forever in a collective
                    stopped = [i for i, c in enumerate(codes) if c is None]
                    _stop([procs[i] for i in stopped])
                    codes = [p.returncode for p in procs]
                    break
                time.sleep(poll_s)
        finally:
            _stop([p for p in procs if p.poll() is None])
            for f in logs:
                if f is not None:
                    f.close()
        for rank, code in enumerate(codes):
            if rank > 0 and code not in (0, None) and rank not in stopped:
                tail = open(os.path.join(tmp, f"rank{rank}.stderr"), "rb").read()[-3000:].decode(errors="replace")
                print(f"strop: rank {rank} failed (exit code {code}):\n{tail}", file=sys.stderr)
        if stopped:
            print(f"strop: stopped rank(s) {stopped} after rank(s) "
                  f"{[i for i, c in enumerate(codes) if i not in stopped and c]} failed", file=sys.stderr)
    return next((c for i, c in enumerate(codes) if c and i not in stopped), 0)  # the rank that failed first


def _stop(procs, grace_s: float = 5.0) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
