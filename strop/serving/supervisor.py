"""The process a launched server runs under: ``python -m strop.serving.supervisor PARENT_PID MODE ...``, started
by strop.engines.launch.LocalServer, which hands it the program to run. No server outlives the run that
started it: the kernel SIGKILLs (or SIGTERMs) this process when its parent dies (``PR_SET_PDEATHSIG``).

Modes:

- ``run PROGRAM...``: become the program (``exec``; the parent-death signal stays armed across it): strop serve,
  one process;
- ``exec PROGRAM...``: run the program in this process's group and end the whole group with the parent (vLLM
  starts processes of its own);
- ``guard HOST PORT UPSTREAM PROGRAM...``: the same, behind strop's token guard (strop.serving.guard) on
  HOST:PORT, token in ``$STROP_GUARD_TOKEN`` (strop.wire.auth.GUARD_TOKEN_ENV).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

from strop.process import die_with_parent
from strop.serving import guard as token_guard
from strop.wire.auth import GUARD_TOKEN_ENV


def supervise_group(parent: int, command: list[str], guard: tuple[str, int, str] | None = None) -> int:
    """Run ``command`` in this process's group (LocalServer made it a session of its own) and end the whole
    group, the command's own children included, when ``parent`` dies or this process is told to stop: a
    parent-death signal reaches only a direct child, and vLLM's engine and worker processes would outlive it.
    Under Ray, an actor's death also SIGKILLs its direct children (this process); a watchdog that is not
    its child then ends the group. ``guard``: (host, port, upstream): strop's token guard (token in
    $STROP_GUARD_TOKEN) serves host:port in a thread of this process, forwarding to ``command`` at
    ``upstream``; if it stops, the group is ended (an engine nobody can reach must not look alive)."""
    signal.signal(signal.SIGTERM, lambda *_: os.killpg(0, signal.SIGKILL))
    die_with_parent(parent, signal.SIGTERM)
    if guard is not None:
        token = os.environ.pop(GUARD_TOKEN_ENV)  # (the command has its own copy where it needs one)
        sock = token_guard.bind(guard[0], guard[1])

        def serve():
            try:
                token_guard.serve(sock, token, guard[2])
            finally:
                os.killpg(0, signal.SIGKILL)

        threading.Thread(target=serve, name="strop-engine-guard", daemon=True).start()
    child = subprocess.Popen(command)
    _watch(parent)
    code = child.wait()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.killpg(0, signal.SIGTERM)  # whatever the command left behind, and the watchdog (this process ignores it)
    return code


def _watch(parent: int, every_s: float = 0.5) -> None:
    """A grandchild of this process, in its group, re-parented away from it: once ``parent`` is gone, it
    SIGKILLs the group (itself included). Only the fork made here is waited for: a wait for any child could
    reap the command first, and its exit code would be lost. SIGTERM stays blocked until the grandchild has its
    own default action: with this process's handler it would SIGKILL the group, this process included."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    pid = os.fork()
    if pid == 0:
        if os.fork() == 0:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
            while True:
                time.sleep(every_s)
                try:
                    os.kill(parent, 0)
                except ProcessLookupError:
                    os.killpg(0, signal.SIGKILL)
        os._exit(0)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    os.waitpid(pid, 0)


def main(argv: list[str]) -> int:
    """``PARENT_PID run|exec|guard ...``: the program of ``argv``, tied to the parent (see the module's doc)."""
    parent, mode = int(argv[0]), argv[1]
    if mode == "exec":  # another program, which may start processes of its own (vLLM does)
        return supervise_group(parent, argv[2:])
    if mode == "guard":  # ... guard HOST PORT UPSTREAM COMMAND...: the same, behind strop's token guard
        return supervise_group(parent, argv[5:], (argv[2], int(argv[3]), argv[4]))
    if mode != "run":
        raise SystemExit(f"strop.serving.supervisor: unknown mode {mode!r}")
    die_with_parent(parent)
    os.execv(argv[2], argv[2:])  # the parent-death signal survives exec (not set-user-ID)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
