"""Weight sync to remote engines by broadcast over a process group of the trainer and the servers.

Broadcast: the trainer's rank 0 and the engine servers form their own process group
(rank 0 = trainer, ranks 1..n = engines; gloo on CPU, NCCL on GPU), separate from the
trainer's data-parallel group. The weights travel as a stream of flat buckets of at most
``bucket_bytes``: a tensor larger than a bucket is cut into pieces, so the extra memory on
either side is one bucket, whatever the largest tensor is. Both sides derive the same
bucket plan from the manifest (names, dtypes, shapes) the trainer sends over HTTP.

The delta form (only tensors whose bytes changed, each checked by its digest on arrival)
lives in the router, :meth:`strop.engines.router.Router._update_by_delta`.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

DEFAULT_SYNC_BUCKET_BYTES = 64 << 20


@dataclass(frozen=True)
class Piece:
    """Elements [start, stop) of the flattened tensor ``name``, at ``offset`` in its bucket."""

    name: str
    start: int
    stop: int
    offset: int


def bucket_plan(manifest: list[tuple[str, str, tuple[int, ...]]], bucket_bytes: int) -> list[tuple[str, list[Piece]]]:
    """Cut the manifest's tensors, in order and per dtype, into buckets of at most ``bucket_bytes``.

    Returns ``[(dtype, [Piece, ...]), ...]``; a bucket holds elements of one dtype only.
    """
    plan: list[tuple[str, list[Piece]]] = []
    open_bucket: dict[str, tuple[list[Piece], int]] = {}  # dtype -> (pieces, elements used)
    for name, dtype, shape in manifest:
        size = torch.empty((), dtype=getattr(torch, dtype)).element_size()
        capacity = max(bucket_bytes // size, 1)
        numel = 1
        for d in shape:
            numel *= d
        start = 0
        while start < numel:
            pieces, used = open_bucket.get(dtype, ([], 0))
            take = min(numel - start, capacity - used)
            pieces.append(Piece(name, start, start + take, used))
            used += take
            start += take
            if used == capacity:
                plan.append((dtype, pieces))
                open_bucket.pop(dtype, None)
            else:
                open_bucket[dtype] = (pieces, used)
    plan += [(dtype, pieces) for dtype, (pieces, _) in open_bucket.items()]
    return plan


def manifest_of(named: dict[str, torch.Tensor]) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, dtype, shape) of every tensor, skipping names that alias an earlier one (tied weights)."""
    seen, out = set(), []
    for name, t in named.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        if key in seen:
            continue
        seen.add(key)
        out.append((name, str(t.dtype).removeprefix("torch."), tuple(t.shape)))
    return out


def make_group(host: str, port: int, rank: int, world: int, backend: str = "gloo", timeout_s: float = 600.0):
    """A standalone process group (not the default one): rank 0 hosts the store."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, world, is_master=rank == 0, timeout=timeout, wait_for_workers=False)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world, timeout)
    if backend == "nccl":
        return dist.ProcessGroupNCCL(store, rank, world)
    raise ValueError(f"weight sync backend must be 'gloo' or 'nccl', got {backend!r}")


def close_group(group) -> None:
    """Tear down a group made by :func:`make_group` (NCCL: abort; gloo frees its sockets when the last
    reference goes, so the caller drops it too). A group already broken has nothing left to close."""
    teardown = getattr(group, "abort", None) or getattr(group, "shutdown", None)
    try:
        if teardown is not None:
            teardown()
    except RuntimeError:
        pass


def _broadcast(group, buf: torch.Tensor) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([buf], opts).wait()


def send_buckets(group, named: dict[str, torch.Tensor], plan, device) -> int:
    """Trainer side: fill one bucket at a time from ``named`` and broadcast it. Returns bytes sent."""
    sent = 0
    for dtype, pieces in plan:
        n = pieces[-1].offset + (pieces[-1].stop - pieces[-1].start)
        buf = torch.empty(n, dtype=getattr(torch, dtype), device=device)
        for p in pieces:
            buf[p.offset : p.offset + p.stop - p.start] = named[p.name].detach().reshape(-1)[p.start : p.stop]
        _broadcast(group, buf)
        sent += buf.numel() * buf.element_size()
        del buf
    return sent


def receive_buckets(group, params: dict[str, torch.Tensor], plan, device) -> int:
    """Engine side: receive one bucket at a time and copy it into ``params`` (by name, in place)."""
    received = 0
    with torch.no_grad():
        for dtype, pieces in plan:
            n = pieces[-1].offset + (pieces[-1].stop - pieces[-1].start)
            buf = torch.empty(n, dtype=getattr(torch, dtype), device=device)
            _broadcast(group, buf)
            for p in pieces:
                params[p.name].view(-1)[p.start : p.stop].copy_(buf[p.offset : p.offset + p.stop - p.start])
            received += buf.numel() * buf.element_size()
            del buf
    return received


class BroadcastSync:
    """The trainer's side of broadcast sync: a group with the given engines, rebuilt on demand."""

    def __init__(self, bucket_bytes: int = DEFAULT_SYNC_BUCKET_BYTES, backend: str = "gloo", host: str = "127.0.0.1",
                 timeout_s: float = 600.0):
        self.bucket_bytes, self.backend, self.host, self.timeout_s = bucket_bytes, backend, host, timeout_s
        self.group, self.members, self.generation, self.name = None, (), 0, ""

    async def connect(self, engines: list) -> None:
        """A new group of this process (rank 0) and ``engines`` (ranks 1..n); the previous group, if
        any, is torn down on both sides first (an engine that is gone is skipped)."""
        import asyncio

        from strop.parallel.launch import free_port

        await self.disconnect()
        port, world = free_port(), len(engines) + 1
        self.generation += 1
        name = f"strop-sync-{self.generation}"
        own = asyncio.to_thread(make_group, self.host, port, 0, world, self.backend, self.timeout_s)
        joined = await asyncio.gather(own, *(e.join_group(self.host, port, i + 1, world, self.backend, name)
                                             for i, e in enumerate(engines)), return_exceptions=True)
        failed = [r for r in joined if isinstance(r, BaseException)]
        if not isinstance(joined[0], BaseException):
            self.group, self.members, self.name = joined[0], tuple(engines), name
        if failed:
            await self.disconnect()
            raise failed[0]

    async def disconnect(self) -> None:
        """Leave the current group: every member still answering destroys its side, then this side closes."""
        import asyncio

        if self.group is None:
            return
        group, members, name = self.group, self.members, self.name
        self.group, self.members = None, ()
        await asyncio.gather(*(e.leave_group(name) for e in members), return_exceptions=True)  # the dead are skipped
        await asyncio.to_thread(close_group, group)

    async def update(self, engines: list, named: dict[str, torch.Tensor], version: int) -> tuple[int, list[int]]:
        """Broadcast ``named`` to ``engines`` (reconnecting when the set changed). Returns the bytes sent
        and the weight version each engine reports holding afterwards."""
        import asyncio

        if self.group is None or tuple(engines) != self.members:
            await self.connect(engines)
        manifest = manifest_of(named)
        plan = bucket_plan(manifest, self.bucket_bytes)
        device = next(iter(named.values())).device
        results = await asyncio.gather(asyncio.to_thread(send_buckets, self.group, named, plan, device),
                                       *(e.receive_broadcast(manifest, version, self.bucket_bytes, self.name)
                                         for e in engines), return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            await self.disconnect()  # the group is broken: the next update builds a new one
            raise failed[0]
        return results[0], list(results[1:])
