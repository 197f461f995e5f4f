"""Weight sync to remote engines by broadcast over a process group of the trainer and the servers.

Broadcast: the trainer's rank 0 and the engine servers form their own process group
(rank 0 = trainer, ranks 1..n = engines; gloo on CPU, NCCL on GPU), separate from the
trainer's data-parallel group, built as SGLang builds it (:func:`make_group`). The weights
travel in SGLang's format: buckets of whole tensors of at most ``bucket_bytes``, each one
uint8 buffer (``flattened_bucket``), announced by an ``update_weights_from_distributed`` call
carrying its names, dtypes and shapes; a tensor larger than a bucket travels alone, as itself.
The extra memory on either side is one bucket, or that one tensor where it is larger (strop
serve receives a lone tensor straight into its parameter: no extra memory at all).

The delta form (only tensors whose bytes changed, each checked by its digest on arrival)
lives in the router, :meth:`strop.engines.router.Router._update_by_delta`.
"""

from __future__ import annotations

import datetime
import hashlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

DEFAULT_SYNC_BUCKET_BYTES = 64 << 20


@dataclass(frozen=True)
class Bucket:
    """Whole tensors that travel in one broadcast. ``flattened``: their bytes concatenated in order
    into one uint8 buffer (SGLang's ``load_format="flattened_bucket"``); otherwise a single tensor
    larger than a bucket, broadcast as itself (SGLang's per-tensor form)."""

    names: tuple[str, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    flattened: bool

    @property
    def nbytes(self) -> int:
        return sum(_numel(s) * _itemsize(d) for d, s in zip(self.dtypes, self.shapes))

    def payload(self) -> dict:
        """The names, dtypes and shapes as SGLang's update request carries them."""
        return {"names": list(self.names), "dtypes": list(self.dtypes), "shapes": [list(s) for s in self.shapes],
                "load_format": "flattened_bucket" if self.flattened else None}

    @classmethod
    def from_payload(cls, names, dtypes, shapes, load_format) -> "Bucket":
        """A bucket from an update request; unknown dtypes or malformed lists raise ValueError naming them."""
        if not (len(names) == len(dtypes) == len(shapes)) or not names:
            raise ValueError(f"names, dtypes and shapes must be non-empty lists of one length, got {len(names)}, "
                             f"{len(dtypes)}, {len(shapes)}")
        bad = [d for d in dtypes if not isinstance(getattr(torch, str(d), None), torch.dtype)]
        if bad:
            raise ValueError(f"unknown dtype {bad[0]!r}")
        if any(not isinstance(x, int) or x < 0 for s in shapes for x in s):
            raise ValueError(f"shapes must be lists of non-negative integers, got {shapes[:3]}")
        if load_format not in (None, "flattened_bucket"):
            raise ValueError(f"load_format {load_format!r}: only null (one tensor) or 'flattened_bucket'")
        if load_format is None and len(names) != 1:
            raise ValueError(f"without load_format='flattened_bucket' a broadcast carries one tensor, got {len(names)}")
        return cls(tuple(names), tuple(dtypes), tuple(tuple(s) for s in shapes), load_format == "flattened_bucket")


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _itemsize(dtype: str) -> int:
    return torch.empty((), dtype=getattr(torch, dtype)).element_size()


def plan_buckets(manifest: list[tuple[str, str, tuple[int, ...]]], bucket_bytes: int) -> list[Bucket]:
    """Group the manifest's tensors, in order, into flattened buckets of at most ``bucket_bytes``; a
    tensor larger than that travels alone (SGLang and vLLM load whole tensors: there is no smaller unit).
    Each tensor starts at a multiple of its element size in its bucket (SGLang splits the buffer with
    ``view(dtype)`` and refuses an unaligned one): a bucket closes early rather than misalign the next."""
    buckets: list[Bucket] = []
    open_: list[tuple[str, str, tuple[int, ...]]] = []
    used = 0

    def close():
        nonlocal open_, used
        if open_:
            buckets.append(Bucket(*(tuple(x) for x in zip(*open_)), flattened=True))
        open_, used = [], 0

    for name, dtype, shape in manifest:
        size = _numel(shape) * _itemsize(dtype)
        if size > bucket_bytes:
            close()
            buckets.append(Bucket((name,), (dtype,), (tuple(shape),), flattened=False))
            continue
        if used + size > bucket_bytes or used % _itemsize(dtype):  # (SGLang refuses a tensor at an unaligned offset)
            close()
        open_.append((name, dtype, tuple(shape)))
        used += size
    close()
    return buckets


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


def first_mismatch(sent: list[tuple[str, str, tuple[int, ...]]], held: list[tuple[str, str, tuple[int, ...]]],
                   where: str) -> str | None:
    """The first difference between the trainer's manifest and an engine's, in words (None: they agree).
    Checked before any byte moves: a name either side lacks, then a shape, then a dtype."""
    theirs = {n: (d, tuple(s)) for n, d, s in held}
    ours = {n for n, _, _ in sent}
    for name, dtype, shape in sent:
        if name not in theirs:
            return f"{where} has no tensor {name!r} (the trainer's {dtype} {list(shape)})"
        d, s = theirs[name]
        if s != tuple(shape):
            return f"{name!r}: the trainer's shape is {list(shape)}, {where}'s is {list(s)}"
        if d != dtype:
            return (f"{name!r}: the trainer sends {dtype}, {where} holds {d} (set engine.sync_dtype={d!r} to cast "
                    "on the trainer's side)")
    missing = [n for n, _, _ in held if n not in ours]
    if missing:
        return f"{where} holds {missing[0]!r}, which the trainer does not send (it would keep its old weights)"
    return None


class StreamDigest:
    """blake2b over every byte of an update, bucket by bucket in order: what the sender sent and what a
    receiver received hash alike only if every bucket arrived whole and in order."""

    def __init__(self):
        self._h = hashlib.blake2b(digest_size=16)

    def update(self, buf: torch.Tensor) -> None:
        self._h.update(buf.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def make_group(host: str, port: int, rank: int, world: int, backend: str = "gloo", timeout_s: float = 600.0,
               name: str = "weight_update_group"):
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
    group, _ = c10d._new_process_group_helper(world, rank, [], backend, dist.PrefixStore(name, store),
                                              group_name=name, timeout=timeout)
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


def send_bucket(group, bucket: Bucket, named: dict[str, torch.Tensor], device, digest: StreamDigest | None = None,
                dtype: str | None = None) -> int:
    """Trainer side: broadcast one bucket (its buffer filled from ``named``, cast to ``dtype`` when set).
    The extra memory is the bucket's buffer; a lone tensor already contiguous goes without a copy."""
    if not bucket.flattened:
        t = named[bucket.names[0]].detach()
        t = t.to(getattr(torch, dtype)) if dtype else t
        t = t.contiguous()
        _broadcast(group, t)
        if digest is not None:
            digest.update(t)
        return t.numel() * t.element_size()
    buf = torch.empty(bucket.nbytes, dtype=torch.uint8, device=device)
    at = 0
    for name, d in zip(bucket.names, bucket.dtypes):
        t = named[name].detach()
        t = t.to(getattr(torch, d)) if str(t.dtype).removeprefix("torch.") != d else t
        n = t.numel() * t.element_size()
        buf[at:at + n].view(t.dtype).copy_(t.reshape(-1))
        at += n
    _broadcast(group, buf)
    if digest is not None:
        digest.update(buf)
    return bucket.nbytes


def receive_bucket(group, bucket: Bucket, device, into: dict[str, torch.Tensor] | None = None,
                   digest: StreamDigest | None = None) -> list[tuple[str, torch.Tensor]]:
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
        out.append((name, buf[at:at + n].view(dtype).view(shape)))
        at += n
    return out


class EngineReceiptError(RuntimeError):
    """An engine's receipt disagrees with what the trainer sent (version or checksum): it must not serve."""


class BroadcastSync:
    """The trainer's side of broadcast sync, driving each engine through SGLang's update protocol
    (strop serve answers the same routes; vLLM through strop's worker extension):

    check manifests → pause → begin session → per bucket, the engines' update calls and this
    side's broadcast together → end session (version set, cache flushed) → resume → receipt.

    Nothing moves before every engine's manifest matches the trainer's; generation resumes even
    when the update fails; each engine's receipt (its version, and a checksum where it computes
    one strop can compare) must match what was sent, or the update fails naming the engine.
    """

    def __init__(self, bucket_bytes: int = DEFAULT_SYNC_BUCKET_BYTES, backend: str = "gloo", host: str = "127.0.0.1",
                 timeout_s: float = 600.0, pause_mode: str = "abort", dtype: str | None = None):
        self.bucket_bytes, self.backend, self.host, self.timeout_s = bucket_bytes, backend, host, timeout_s
        self.pause_mode, self.dtype = pause_mode, dtype
        self.group, self.members, self.generation, self.name = None, (), 0, ""
        self._inflight = None  # a send left in its collective when an engine refused a bucket

    async def connect(self, engines: list) -> None:
        """A new group of this process (rank 0) and ``engines`` (ranks 1.., each as many as it has workers); the previous group, if
        any, is torn down on both sides first (an engine that is gone is skipped). An engine that
        refuses to join ends the wait at once (this side's rendezvous is left to time out alone)."""
        import asyncio
        import secrets

        from strop.parallel.launch import free_port

        await self.disconnect()
        offsets, world = [], 1  # an engine of several workers (SGLang TP) joins as ranks offset .. offset + n - 1
        for e in engines:
            offsets.append(world)
            world += getattr(e, "group_ranks", 1)
        port = free_port()
        self.generation += 1
        name = f"strop-sync-{self.generation}-{secrets.token_hex(4)}"  # unique: torch refuses a name twice
        own = asyncio.ensure_future(asyncio.to_thread(make_group, self.host, port, 0, world, self.backend,
                                                      self.timeout_s, name))
        joins = [asyncio.ensure_future(e.join_group(self.host, port, offset, world, self.backend, name))
                 for e, offset in zip(engines, offsets)]
        done, pending = await asyncio.wait([own, *joins], return_when=asyncio.FIRST_EXCEPTION)
        failed = next((t.exception() for t in done if t.exception() is not None), None)
        if failed is not None:
            own.add_done_callback(lambda t: t.exception() is None and close_group(t.result()))
            for t in pending:
                if t is not own:
                    t.cancel()
            await asyncio.gather(*(e.leave_group(name) for e in engines), return_exceptions=True)
            raise failed
        self.group, self.members, self.name = own.result(), tuple(engines), name

    async def disconnect(self) -> None:
        """Leave the current group: every member still answering destroys its side, then this side closes."""
        import asyncio

        if self.group is None:
            return
        group, members, name = self.group, self.members, self.name
        self.group, self.members = None, ()
        await asyncio.gather(*(e.leave_group(name) for e in members), return_exceptions=True)  # the dead are skipped
        inflight, self._inflight = self._inflight, None
        if inflight is not None and not inflight.done():  # never torn down under a collective still running on it
            inflight.add_done_callback(lambda _: close_group(group))
        else:
            await asyncio.to_thread(close_group, group)

    async def check(self, engines: list, manifest) -> None:
        """Refuse, before any bytes move, an engine whose tensors differ from the trainer's (naming the first
        difference). An engine that cannot list its tensors (SGLang) checks each bucket as it arrives."""
        import asyncio

        from strop.engines.http import EngineManifestError

        held = await asyncio.gather(*(e.weights_manifest() for e in engines))
        for engine, theirs in zip(engines, held):
            if theirs is not None and (why := first_mismatch(manifest, theirs, repr(engine))) is not None:
                raise EngineManifestError(f"weight broadcast refused before sending: {why}")

    async def update(self, engines: list, named: dict[str, torch.Tensor], version: int) -> tuple[int, list[int]]:
        """Broadcast ``named`` to ``engines`` as ``version`` (reconnecting when the set changed). Returns the
        bytes sent and the version each engine reports holding afterwards (its receipt checked)."""
        import asyncio

        manifest = [(n, self.dtype or d, s) for n, d, s in manifest_of(named)]
        await self.check(engines, manifest)
        if self.group is None or tuple(engines) != self.members:
            await self.connect(engines)
        buckets = plan_buckets(manifest, self.bucket_bytes)
        device = next(iter(named.values())).device
        digest, sent = StreamDigest(), 0
        try:
            await self._all(engines, lambda e: e.pause(self.pause_mode))
            await self._all(engines, lambda e: e.begin_update())
            for k, bucket in enumerate(buckets):
                last = k == len(buckets) - 1
                send = asyncio.ensure_future(asyncio.to_thread(send_bucket, self.group, bucket, named, device, digest,
                                                               self.dtype))
                calls = [asyncio.ensure_future(e.receive_bucket(bucket, self.name, version, last)) for e in engines]
                # an engine that refuses a bucket never joins its broadcast: stop waiting for it at once (the send,
                # stuck in the collective, ends at the group's timeout; the group is rebuilt for the next update)
                done, _ = await asyncio.wait([send, *calls], return_when=asyncio.FIRST_EXCEPTION)
                failed = next((t.exception() for t in done if t.exception() is not None), None)
                if failed is not None:
                    for t in calls:
                        t.cancel()
                    self._inflight = send
                    raise failed
                sent += send.result()
            await self._all(engines, lambda e: e.end_update(version))
        except BaseException:
            await asyncio.gather(*(e.end_update(version) for e in engines), return_exceptions=True)
            await asyncio.gather(*(e.resume() for e in engines), return_exceptions=True)
            await self.disconnect()  # the group may be broken: the next update builds a new one
            raise
        await self._all(engines, lambda e: e.resume())
        return sent * len(engines), await self._receipts(engines, named, version, digest)

    async def _all(self, engines: list, call) -> None:
        import asyncio

        results = await asyncio.gather(*(call(e) for e in engines), return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            raise failed[0]

    async def _receipts(self, engines: list, named, version: int, digest: StreamDigest) -> list[int]:
        """Each engine's version, checked against ``version``, and its checksum against the trainer's."""
        import asyncio

        from strop.engines.http import state_checksum

        receipts = await asyncio.gather(*(e.receipt() for e in engines))
        state = None
        for engine, (held, kind, checksum) in zip(engines, receipts):
            if held != version:
                raise EngineReceiptError(f"{engine!r} reports weight version {held} after the broadcast of {version}")
            if kind == "stream":
                ours = digest.hexdigest()
            elif kind == "state":
                if state is None:
                    unique = {n: named[n] for n, _, _ in manifest_of(named)}
                    cast = (lambda t: t.to(getattr(torch, self.dtype))) if self.dtype else (lambda t: t)
                    state = await asyncio.to_thread(lambda: state_checksum({n: cast(t) for n, t in unique.items()}))
                ours = state
            else:
                continue
            if checksum != ours:
                raise EngineReceiptError(f"{engine!r}: the weights of version {version} arrived with checksum "
                                         f"{checksum}, the trainer sent {ours}")
        return [held for held, _, _ in receipts]
