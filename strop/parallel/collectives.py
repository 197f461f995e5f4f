"""Chunked, coalesced all-reduce: every gradient reduction strop performs itself goes through here.

Reducing many tensors one by one costs one collective each; flattening them all
into one buffer costs one collective but one allocation as large as all of them
together (12.43 GiB for the gradients of a 750B model in slime's case, which
OOMed under a fragmented allocator). :func:`all_reduce_coalesced` packs the
tensors greedily, in order, into flat buffers of at most ``bucket_bytes``
(a tensor larger than the budget travels alone, reduced in place), reduces
each buffer, and copies the results back in place. Summation is elementwise,
so the result is bitwise equal to reducing one flat buffer.

Memory contract: at most one bucket is alive at a time, so the extra memory is
at most ``bucket_bytes`` (a lone oversize tensor is reduced in place and
allocates nothing); the bound stated to users is ``bucket_bytes`` plus the
largest single tensor, which also covers backends that stage a copy.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

MIN_BUCKET_BYTES = 1 << 20  # 1 MiB
DEFAULT_BUCKET_BYTES = 1 << 30  # 1 GiB
ENV_BUCKET_BYTES = "STROP_GRAD_REDUCE_BUCKET_BYTES"


def resolve_bucket_bytes(configured: int | None = None) -> int:
    """The budget: ``STROP_GRAD_REDUCE_BUCKET_BYTES`` if set, else the config value, else 1 GiB."""
    raw = os.environ.get(ENV_BUCKET_BYTES)
    source = f"environment variable {ENV_BUCKET_BYTES}"
    if raw is not None:
        try:
            value = int(raw)
        except ValueError:
            raise ValueError(f"{source}={raw!r} is not an integer number of bytes") from None
    else:
        value, source = (
            (configured if configured is not None else DEFAULT_BUCKET_BYTES),
            "parallel.grad_reduce_bucket_bytes",
        )
    if value < MIN_BUCKET_BYTES:
        raise ValueError(
            f"{source}={value} is below the 1 MiB minimum ({MIN_BUCKET_BYTES} bytes): buckets that small turn one "
            "reduction into thousands of collectives, each paying the network latency, for no memory benefit"
        )
    return value


def split_into_buckets(tensors: list[torch.Tensor], bucket_bytes: int) -> list[list[int]]:
    """Greedy, in order: indices of tensors per bucket; each bucket's bytes <= bucket_bytes,
    except a tensor larger than the budget, which forms a bucket of its own."""
    buckets: list[list[int]] = []
    current: list[int] = []
    current_bytes = 0
    for i, t in enumerate(tensors):
        size = t.numel() * t.element_size()
        if current and (current_bytes + size > bucket_bytes or t.dtype != tensors[current[0]].dtype):
            buckets.append(current)
            current, current_bytes = [], 0
        current.append(i)
        current_bytes += size
    if current:
        buckets.append(current)
    return buckets


def all_reduce_coalesced(
    tensors: list[torch.Tensor], *, op: str = "sum", bucket_bytes: int = DEFAULT_BUCKET_BYTES, group=None
) -> None:
    """All-reduce ``tensors`` in place through flat buffers of at most ``bucket_bytes``.

    ``op`` is "sum" or "avg" (the average divides the reduced sum by the group
    size, so SUM and AVG lists must be reduced in separate calls). Tensors of
    different dtypes never share a bucket.
    """
    if op not in ("sum", "avg"):
        raise ValueError(f"op must be 'sum' or 'avg', got {op!r}")
    if not tensors:
        return
    world = dist.get_world_size(group)
    for bucket in split_into_buckets(tensors, bucket_bytes):
        members = [tensors[i] for i in bucket]
        if len(members) == 1 and members[0].is_contiguous():
            flat = members[0]  # alone (oversize or last): reduce in place, no extra allocation
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
            if op == "avg":
                flat.div_(world)
            continue
        flat = torch.cat([t.reshape(-1) for t in members])  # (sum of numels,): the only allocation
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        if op == "avg":
            flat.div_(world)
        offset = 0
        for t in members:
            n = t.numel()
            t.copy_(flat[offset : offset + n].view_as(t))
            offset += n
        del flat  # the bucket dies before the next one is built


def all_reduce_grads(params, *, bucket_bytes: int, group=None, op: str = "avg") -> None:
    """Average (or sum) the ``.grad`` of ``params`` across ``group`` with the chunked reduction."""
    grads = [p.grad for p in params if p.grad is not None]
    all_reduce_coalesced(grads, op=op, bucket_bytes=bucket_bytes, group=group)
