"""Process utilities every layer shares (the ground floor: imports no strop module): free ports, the device a
process is bound to, children that cannot outlive the process that started them (Linux), and SIGTERM / SIGHUP
turned into an orderly end of a run."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(parent: int, sig: int = signal.SIGKILL) -> None:
    """Have the kernel send ``sig`` (SIGKILL) to this process when its parent dies; exit now if it already has.
    (Call it in the child: the signal fires when the thread that started the child ends.)"""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:  # the parent died before the signal was armed
        os._exit(1)


class Terminated(SystemExit):
    """SIGTERM or SIGHUP, turned into an orderly end of the run (exit status 128 + the signal)."""

    def __init__(self, signum: int):
        super().__init__(128 + signum)
        self.signum = signum

    def __str__(self) -> str:
        return f"stopped by {signal.Signals(self.signum).name}"


@contextlib.contextmanager
def stop_on_signals():
    """SIGTERM and SIGHUP raise :class:`Terminated` in the driver, so the run ends as after an error:
    summary written, launched servers stopped. Yields ``closing()``: from then on a signal waits until
    the context exits (shutting down is never cut short). Only the main thread can take signals; a
    driver in another thread leaves them alone."""
    if threading.current_thread() is not threading.main_thread():
        yield lambda: None
        return
    pending: list[int] = []
    closing = threading.Event()

    def handler(signum, frame):
        if closing.is_set():
            pending.append(signum)
        else:
            raise Terminated(signum)

    previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield closing.set
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    if pending:
        raise Terminated(pending[0])


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def resolve_device(name: str = "auto") -> "torch.device":
    """``run.device`` as a torch device bound to this process: cuda:<LOCAL_RANK> on a GPU, else cpu.

    Binds the CUDA device (``torch.cuda.set_device``) before any process group exists,
    so NCCL's collectives and every ``.to(device)`` use this rank's own GPU.
    """
    import torch  # (only here: the ground floor loads without torch)

    if name not in ("auto", "cpu", "cuda"):
        raise ValueError(f"run.device must be 'auto', 'cpu' or 'cuda', got {name!r}")
    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(
            f"run.device='cuda' but this torch ({torch.__version__}) sees no CUDA device; "
            "use run.device=cpu or install a CUDA build of torch"
        )
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if local_rank >= torch.cuda.device_count():
        raise ValueError(f"local rank {local_rank} has no GPU: this host has {torch.cuda.device_count()}")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)
