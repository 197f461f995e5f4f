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
import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from strop.engines.http import EngineManifestError, EngineReceiptError
from strop.engines.weights import take

DEFAULT_SYNC_BUCKET_BYTES = 64 << 20
SEND_GRACE_S = 5.0  # how long a send may trail its receiver's answer (it cannot: the receiver has every byte)


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
    """(name, dtype, shape) of every tensor, skipping names that alias an earlier one (tied weights).
    Sharded weights (strop.parallel.gather) describe themselves without a gather."""
    if hasattr(named, "manifest"):
        return named.manifest()
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
    """A CRC-32 over every byte of an update, bucket by bucket in order, and the count of bytes: what the
    sender sent and what a receiver received agree only if every bucket arrived whole and in order. It
    catches a skipped, truncated, reordered or corrupted transfer (a wrong one passes with odds of 2^-32);
    it is no proof against a server that lies, and costs ~0.25 s per GB (blake2b: ~1.2 s)."""

    def __init__(self):
        self._crc, self._bytes = 0, 0

    def update(self, buf: torch.Tensor) -> None:
        data = buf.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        self._crc = zlib.crc32(data, self._crc)  # (releases the GIL: hashing in a thread leaves others running)
        self._bytes += data.nbytes

    def hexdigest(self) -> str:
        return f"crc32:{self._crc:08x}:{self._bytes}"


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


def fill_bucket(bucket: Bucket, named: dict[str, torch.Tensor], device, dtype: str | None = None) -> torch.Tensor:
    """Trainer side: the tensor one bucket travels as. Flattened: a new uint8 buffer holding the tensors'
    bytes in order (cast to their bucket dtype); a lone tensor: itself (cast to ``dtype`` when set), with
    no copy when it is already contiguous. The extra memory is the bucket's buffer."""
    named = take(named, bucket.names)  # (sharded weights: this bucket's tensors gathered, no others)
    if not bucket.flattened:
        t = named[bucket.names[0]].detach()
        return (t.to(getattr(torch, dtype)) if dtype else t).contiguous()
    buf = torch.empty(bucket.nbytes, dtype=torch.uint8, device=device)
    at = 0
    for name, d in zip(bucket.names, bucket.dtypes):
        t = named[name].detach()
        t = t.to(getattr(torch, d)) if str(t.dtype).removeprefix("torch.") != d else t
        n = t.numel() * t.element_size()
        buf[at:at + n].view(t.dtype).copy_(t.reshape(-1))
        at += n
    return buf


def send_bucket(group, bucket: Bucket, named: dict[str, torch.Tensor], device, digest: StreamDigest | None = None,
                dtype: str | None = None) -> int:
    """Trainer side: broadcast one bucket to one group (:func:`fill_bucket`, then the collective)."""
    buf = fill_bucket(bucket, named, device, dtype)
    _broadcast(group, buf)
    if digest is not None:
        digest.update(buf)
    return buf.numel() * buf.element_size()


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


@dataclass
class _Link:
    """The trainer's group with one engine, and a send left in its collective when the engine failed."""

    group: object
    name: str
    inflight: object = None


class BroadcastSync:
    """The trainer's side of broadcast sync, driving each engine through SGLang's update protocol
    (strop serve answers the same routes; vLLM through strop's worker extension):

    check manifests → pause → begin session → per bucket, the engines' update calls and this
    side's broadcast together → end session (version set, cache flushed) → resume → receipt.

    Each engine has a group of its own with the trainer (rank 0; the engine's workers ranks 1..n),
    so an engine that dies or fails mid-update breaks only its own link: the others complete the
    update in the same pass (in one shared group a dead member stalls the rest in their receives
    until the group's timeout). Each bucket is filled once and sent to every engine from it.

    Nothing moves before every engine's manifest matches the trainer's; every engine that paused is
    resumed, whatever failed; each engine's receipt (its version, and a checksum where it computes
    one strop can compare) must match what was sent.
    """

    def __init__(self, bucket_bytes: int = DEFAULT_SYNC_BUCKET_BYTES, backend: str = "gloo", host: str = "127.0.0.1",
                 timeout_s: float = 600.0, pause_mode: str = "abort", dtype: str | None = None):
        self.bucket_bytes, self.backend, self.host, self.timeout_s = bucket_bytes, backend, host, timeout_s
        self.pause_mode, self.dtype = pause_mode, dtype
        self.links: dict = {}  # engine -> _Link
        self.generation = 0
        self.timings: dict[str, float] = {}  # the last update's phases: prepare, buckets, finish, receipt

    async def _connect(self, engine) -> _Link:
        """A new group of this process (rank 0) and ``engine`` (ranks 1 .. its workers). An engine that refuses
        to join ends the wait at once (this side's rendezvous is left to time out alone, then closed)."""
        import asyncio
        import secrets

        from strop.cluster.process import free_port

        port, world = free_port(), 1 + getattr(engine, "group_ranks", 1)
        self.generation += 1
        name = f"strop-sync-{self.generation}-{secrets.token_hex(4)}"  # unique: torch refuses a name twice
        own = asyncio.ensure_future(asyncio.to_thread(make_group, self.host, port, 0, world, self.backend,
                                                      self.timeout_s, name))
        join = asyncio.ensure_future(engine.join_group(self.host, port, 1, world, self.backend, name))
        done, _ = await asyncio.wait([own, join], return_when=asyncio.FIRST_EXCEPTION)
        failed = next((t.exception() for t in done if t.exception() is not None), None)
        if failed is not None:
            own.add_done_callback(lambda t: t.exception() is None and close_group(t.result()))
            join.cancel()
            await asyncio.gather(engine.leave_group(name), return_exceptions=True)
            raise failed
        self.links[engine] = _Link(own.result(), name)
        return self.links[engine]

    async def drop(self, engine, grace_s: float = 10.0) -> None:
        """Close the link to ``engine``: this side first (an engine blocked in a receive from it fails at once),
        then the engine's side, if it still answers. A send still in its collective gets ``grace_s`` to fail (as
        it does once a dead peer's connection is gone); a group is never torn down under a running collective:
        then it closes when that send ends, at the group's timeout."""
        import asyncio

        link = self.links.pop(engine, None)
        if link is None:
            return
        if link.inflight is not None and not link.inflight.done():
            await asyncio.wait([link.inflight], timeout=grace_s)
        if link.inflight is not None and not link.inflight.done():
            link.inflight.add_done_callback(lambda _: close_group(link.group))
        else:
            await asyncio.to_thread(close_group, link.group)
        await asyncio.gather(engine.leave_group(link.name), return_exceptions=True)

    async def disconnect(self) -> None:
        import asyncio

        await asyncio.gather(*(self.drop(e) for e in list(self.links)))

    async def check(self, engines: list, manifest) -> None:
        """Refuse, before any bytes move, an engine whose tensors differ from the trainer's (naming the first
        difference). An engine that cannot list its tensors (SGLang) checks each bucket as it arrives."""
        import asyncio

        held = await asyncio.gather(*(e.weights_manifest() for e in engines))
        for engine, theirs in zip(engines, held):
            if theirs is not None and (why := first_mismatch(manifest, theirs, repr(engine))) is not None:
                raise EngineManifestError(f"weight broadcast refused before sending: {why}")

    async def update(self, engines: list, named: dict[str, torch.Tensor],
                     version: int) -> tuple[int, list[int | BaseException]]:
        """Broadcast ``named`` to ``engines`` as ``version``. Returns the bytes that reached engines and, per
        engine, the version its receipt shows, or the error that took it out of this update."""
        import asyncio

        import time

        clock = [time.perf_counter()]

        def lap(phase):  # seconds per phase of the last update (bench/sync.py prints them)
            clock.append(time.perf_counter())
            self.timings[phase] = clock[-1] - clock[-2]

        manifest = [(n, self.dtype or d, s) for n, d, s in manifest_of(named)]
        await self.check(engines, manifest)  # (raises: nothing was sent to anyone)
        for engine in list(self.links):  # engines no longer in the set leave their groups
            if engine not in engines:
                await self.drop(engine)
        outcome: dict = {}  # engine -> the error that ended its update
        live = list(engines)

        async def each(call, who):
            """``call(engine)`` on every live engine; one that fails leaves the update."""
            results = await asyncio.gather(*(call(e) for e in who), return_exceptions=True)
            for e, r in zip(who, results):
                if isinstance(r, BaseException) and e not in outcome:
                    outcome[e] = r
            live[:] = [e for e in live if e not in outcome]

        await each(lambda e: self._connect(e) if e not in self.links else asyncio.sleep(0), list(live))
        paused = list(live)
        await each(lambda e: e.pause(self.pause_mode), paused)
        await each(lambda e: e.begin_update(), list(live))
        lap("prepare")
        buckets = plan_buckets(manifest, self.bucket_bytes)
        device = getattr(named, "device", None) or next(iter(named.values())).device
        digest, sent = StreamDigest(), 0
        try:
            for k, bucket in enumerate(buckets):
                if not live:
                    break
                last = k == len(buckets) - 1
                buf = await asyncio.to_thread(fill_bucket, bucket, named, device, self.dtype)
                hashing = asyncio.ensure_future(asyncio.to_thread(digest.update, buf))  # beside the sends
                await each(lambda e: self._send(e, buf, bucket, version, last), list(live))
                await hashing
                sent += buf.numel() * buf.element_size() * len(live)
                buf = None  # (freed before the next bucket is filled)
            lap("buckets")
            await each(lambda e: e.end_update(version), list(live))
        finally:  # every engine that paused resumes, whatever failed
            await asyncio.gather(*(e.end_update(version) for e in paused if e in outcome), return_exceptions=True)
            await asyncio.gather(*(e.resume() for e in paused), return_exceptions=True)
        lap("finish")
        receipts = await asyncio.gather(*(self._receipt(e, version, digest) for e in live),
                                        return_exceptions=True)
        lap("receipt")
        outcome |= {e: r for e, r in zip(live, receipts)}
        for engine, result in outcome.items():
            if isinstance(result, BaseException):
                await self.drop(engine)  # the link may be broken: the next update builds a new one
        return sent, [outcome[e] for e in engines]

    async def _send(self, engine, buf: torch.Tensor, bucket: Bucket, version: int, last: bool) -> None:
        """One bucket to one engine: its update call and this side's broadcast of ``buf`` together. If the call
        fails first (refused, or the engine died), the send may stay in its collective: it is not waited for."""
        import asyncio

        link = self.links[engine]
        send = asyncio.ensure_future(asyncio.to_thread(_broadcast, link.group, buf))
        call = asyncio.ensure_future(engine.receive_bucket(bucket, link.name, version, last))
        try:
            await asyncio.wait([send, call], return_when=asyncio.FIRST_COMPLETED)
            if send.done():
                send.result()  # (this side's collective failed: the engine's link is broken)
                await call
            else:
                await call  # the engine answered: it has every byte, so this side's send is all but done
                await asyncio.wait([send], timeout=SEND_GRACE_S)
                if not send.done():
                    raise EngineReceiptError(
                        f"{engine!r} answered the update of {list(bucket.names)[:3]} without taking its broadcast "
                        "(a group other than the trainer's?): nothing it holds is trusted")
                send.result()
        except BaseException:
            call.cancel()
            link.inflight = send
            raise

    async def _receipt(self, engine, version: int, digest: StreamDigest) -> int:
        """The version ``engine`` reports, checked against ``version``, and its digest of the update against
        this side's (where it computes one)."""
        held, kind, checksum = await engine.receipt()
        if held != version:
            raise EngineReceiptError(f"{engine!r} reports weight version {held} after the broadcast of {version}")
        if kind == "stream" and checksum != digest.hexdigest():
            raise EngineReceiptError(f"{engine!r}: the update to version {version} arrived as {checksum}, the "
                                     f"trainer sent {digest.hexdigest()}")
        return held
