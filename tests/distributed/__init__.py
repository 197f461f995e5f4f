"""Distributed tests: 2+ processes, gloo on CPU; NCCL and one GPU per rank where two GPUs exist."""

import torch

GPUS = torch.cuda.device_count()
BACKEND = "nccl" if GPUS >= 2 else "gloo"


def rank_device(rank: int, world: int = 2) -> str:
    """The device a rank's trainer uses in these tests (the one switch for processes, like the
    ``device`` fixture): its own GPU when every rank of a ``world``-process run has one."""
    return f"cuda:{rank}" if GPUS >= max(world, 2) else "cpu"
