"""The distributed runtime: process group from the environment, the controller, sample broadcast.

Rank 0 is the controller: it owns the data, the inference engine, rollout,
evaluation and every output file. Each step it sends the scored samples to all
ranks; every rank computes the same advantages and normalisers from the whole
batch and trains on its share of the micro-batches.
"""

from __future__ import annotations

import os
import subprocess
import sys

import torch
import torch.distributed as dist


def init_from_env() -> tuple[int, int]:
    """Join the process group described by RANK / WORLD_SIZE (torchrun or ``--nproc``); (0, 1) alone."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend)
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def parallel_layout(world: int, context_parallel_size: int) -> tuple[int, int]:
    """(data-parallel size, context-parallel size) for ``world`` processes, or a ValueError that says why not."""
    cp = context_parallel_size
    if world % cp:
        hint = " (run with --nproc N)" if world == 1 else ""
        raise ValueError(f"parallel.context_parallel_size={cp} needs a multiple of {cp} processes, "
                         f"got {world}{hint}")
    return world // cp, cp


def device_mesh_groups(context_parallel_size: int):
    """This rank's (data-parallel, context-parallel) process groups from a 2D device mesh.

    Ranks are laid out row-major over (dp, cp): the CP ranks of one DP rank are
    neighbours (0-1, 2-3, ...), and rank 0, the controller, is DP 0 / CP 0.
    """
    from torch.distributed.device_mesh import init_device_mesh

    dp, cp = parallel_layout(dist.get_world_size(), context_parallel_size)
    mesh = init_device_mesh("cuda" if torch.cuda.is_available() else "cpu", (dp, cp), mesh_dim_names=("dp", "cp"))
    return mesh["dp"].get_group(), mesh["cp"].get_group()


def broadcast_object(obj=None, src: int = 0):
    """Send a picklable object (the step's samples) from ``src`` to every rank."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def launch(nproc: int, argv: list[str]) -> int:
    """``strop train --nproc N``: start N local ranks of ``strop train`` (gloo on CPU) and wait for all."""
    from strop.parallel.launch import free_port

    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(nproc))
    procs = []
    for rank in range(nproc):
        rank_env = dict(env, RANK=str(rank), LOCAL_RANK=str(rank))
        out = None if rank == 0 else subprocess.DEVNULL  # only the controller talks to the user
        procs.append(subprocess.Popen([sys.executable, "-m", "strop.cli", "train", *argv], env=rank_env,
                                      stdout=out, stderr=None if rank == 0 else subprocess.PIPE))
    codes = [None] * nproc
    try:
        while any(c is None for c in codes):
            for i, p in enumerate(procs):
                if codes[i] is None and p.poll() is not None:
                    codes[i] = p.returncode
                    if p.returncode != 0:  # one rank failed: the others would wait forever in a collective
                        for q in procs:
                            if q.poll() is None:
                                q.terminate()
            if any(c is None for c in codes):
                try:
                    procs[[i for i, c in enumerate(codes) if c is None][0]].wait(timeout=1)
                except subprocess.TimeoutExpired:
                    pass
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for rank, (p, code) in enumerate(zip(procs, codes)):
        if code not in (0, None) and rank > 0 and p.stderr is not None:
            tail = p.stderr.read().decode(errors="replace")[-2000:]
            if tail.strip():
                print(f"strop: rank {rank} failed:\n{tail}", file=sys.stderr)
    return next((c for c in codes if c), 0)
