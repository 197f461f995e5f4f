"""The weight-update process group of the trainer (rank 0) and the engines, built as SGLang builds it, and
a bucket sent or received over it."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from strop.wire.buckets import Bucket, _itemsize, _numel, fill_bucket
from strop.wire.digest import StreamDigest


def make_group(
    host: str,
    port: int,
    rank: int,
    world: int,
    backend: str = "gloo",
    timeout_s: float = 600.0,
    name: str = "weight_update_group",
):
    """A process group of the trainer (rank 0, hosting the store) and the engines, built as SGLang
    builds its side for ``/init_weights_update_group``: a TCP rendezvous, the store prefixed with the
    group's name, then torch's group helper. Both sides must build it alike or they never meet (a
    plain ``init_process_group`` uses other store keys and waits until the timeout)."""
    from torch.distributed import distributed_c10d as c10d

    if backend not in ("gloo", "nccl"):
        raise ValueError(f"weight sync backend must be 'gloo' or 'nccl', got {backend!r}")
    timeout = datetime.timedelta(seconds=timeout_s)
    store, rank, world = next(dist.rendezvous(f"tcp://{host}:{port}", rank, world, timeout=timeout))
    store.set_timeout(timeout)
    group, _ = c10d._new_process_group_helper(
        world, rank, [], backend, dist.PrefixStore(name, store), group_name=name, timeout=timeout
    )
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world)}
    return group


def close_group(group) -> None:
    """Tear down a group made by :func:`make_group`; one already broken has nothing left to close."""
    try:
        dist.destroy_process_group(group)
    except (RuntimeError, ValueError, KeyError, AssertionError):
        pass


def _broadcast(group, buf: torch.Tensor) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([buf], opts).wait()


def send_bucket(
    group,
    bucket: Bucket,
    named: dict[str, torch.Tensor],
    device,
    digest: StreamDigest | None = None,
    dtype: str | None = None,
) -> int:
    """Trainer side: broadcast one bucket to one group (:func:`fill_bucket`, then the collective)."""
    buf = fill_bucket(bucket, named, device, dtype)
    _broadcast(group, buf)
    if digest is not None:
        digest.update(buf)
    return buf.numel() * buf.element_size()


def receive_bucket(
    group, bucket: Bucket, device, into: dict[str, torch.Tensor] | None = None, digest: StreamDigest | None = None
) -> list[tuple[str, torch.Tensor]]:
    """Engine side: receive one bucket; returns its tensors as views of the received buffer. With
    ``into`` (the model's own tensors, by name) a lone tensor of matching dtype is received in place,
    with no extra memory at all."""
    if not bucket.flattened:
        name, dtype, shape = bucket.names[0], getattr(torch, bucket.dtypes[0]), bucket.shapes[0]
        target = into.get(name) if into is not None else None
        if target is not None and target.dtype == dtype and target.is_contiguous() and tuple(target.shape) == shape:
            t = target.data
        else:
            t = torch.empty(shape, dtype=dtype, device=device)
        _broadcast(group, t)
        if digest is not None:
            digest.update(t)
        return [(name, t)]
    buf = torch.empty(bucket.nbytes, dtype=torch.uint8, device=device)
    _broadcast(group, buf)
    if digest is not None:
        digest.update(buf)
    out, at = [], 0
    for name, d, shape in zip(bucket.names, bucket.dtypes, bucket.shapes):
        dtype = getattr(torch, d)
        n = _numel(shape) * _itemsize(d)
        out.append((name, buf[at : at + n].view(dtype).view(shape)))
        at += n
    return out
