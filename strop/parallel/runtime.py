"""The distributed runtime: process group from the environment, the controller, sample broadcast.

Rank 0 is the controller: it owns the data, the inference engine, rollout,
evaluation and every output file. Each step it sends the scored samples to all
ranks; every rank computes the same advantages and normalisers from the whole
batch and trains on its share of the micro-batches.
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist


def init_from_env(device: torch.device | None = None) -> tuple[int, int]:
    """Join the process group described by RANK / WORLD_SIZE (torchrun or ``--nproc``); (0, 1) alone.

    NCCL when this process trains on a GPU, gloo on CPU (whatever the host has).
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(
            "nccl" if device is not None and device.type == "cuda" else "gloo",
            device_id=device if device is not None and device.type == "cuda" else None,
        )
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


@contextlib.contextmanager
def process_group(device: torch.device | None = None):
    """:func:`init_from_env` for the length of the block; a gloo group it created is destroyed as the block
    ends, however it ends (torch's teardown of one left to interpreter exit aborted a rank now and then:
    SIGABRT, "terminate called without an active exception"). Local, no collective. An NCCL group is left
    to torch: destroying one while a collective is pending can block."""
    owned = not dist.is_initialized()
    init_from_env(device)
    try:
        yield
    finally:
        if owned and dist.is_initialized() and dist.get_backend() == "gloo":
            dist.destroy_process_group()


class ControllerError(RuntimeError):
    """Another rank failed; this one stops with its message."""


class Control:
    """Rank 0 (the controller) runs rollout, evaluation and output; every rank runs the same driver.

    Two primitives replace a hand-mirrored worker loop: :meth:`on_controller` runs a function
    on rank 0 only and hands its result, or its failure, to every rank; :meth:`on_every_rank`
    runs it everywhere and fails every rank when any one failed, naming it. Control messages
    travel on their own gloo group whose timeout is ``timeout_s`` (workers wait there while
    rank 0 generates, which may take much longer than the default collective timeout).
    """

    def __init__(self, timeout_s: float = 6 * 3600):
        import datetime

        self.on = dist.is_initialized() and dist.get_world_size() > 1
        self.rank = dist.get_rank() if self.on else 0
        self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s)) if self.on else None

    def on_controller(self, fn, *args, share: bool = True, serving=None):
        """``fn(*args)`` on rank 0; every rank returns its result (``share``) or None, or raises its failure.
        ``serving``: sharded weights (strop.parallel.gather) that ``fn`` may read: the other ranks serve
        their gathers until ``fn`` ends, however it ends."""
        if not self.on:
            return fn(*args)
        serving = serving if hasattr(serving, "serve") else None  # (whole weights in a dict need no one)
        box, error, result = [None], None, None
        if serving is not None and self.rank != 0:
            serving.serve(self.group)
        if self.rank == 0:
            try:
                if serving is not None:
                    serving.open(self.group)
                try:
                    result = fn(*args)
                finally:
                    if serving is not None:
                        serving.close()
                box = [("ok", result if share else None)]
            except BaseException as exc:
                error, box = exc, [("error", f"rank 0: {type(exc).__name__}: {exc}")]
        dist.broadcast_object_list(box, src=0, group=self.group)
        if error is not None:
            raise error
        if self.rank == 0:
            return result
        status, value = box[0]
        if status == "error":
            raise ControllerError(value)
        return value

    def on_every_rank(self, fn, *args):
        if not self.on:
            return fn(*args)
        result, error = None, None
        try:
            result = fn(*args)
        except BaseException as exc:
            error = exc
        found = [None] * dist.get_world_size()
        dist.all_gather_object(found, None if error is None else f"{type(error).__name__}: {error}", group=self.group)
        if error is not None:
            raise error
        failed = [(r, e) for r, e in enumerate(found) if e is not None]
        if failed:
            raise ControllerError("; ".join(f"rank {r}: {e}" for r, e in failed))
        return result
