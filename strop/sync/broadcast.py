"""Weight sync to remote engines by broadcast over a process group of the trainer and the servers.

Broadcast: the trainer's rank 0 and the engine servers form their own process group
(rank 0 = trainer, ranks 1..n = engines; gloo on CPU, NCCL on GPU), separate from the
trainer's data-parallel group, built as SGLang builds it (:func:`make_group`). The weights
travel in SGLang's format: buckets of whole tensors of at most ``bucket_bytes``, each one
uint8 buffer (``flattened_bucket``), announced by an ``update_weights_from_distributed`` call
carrying its names, dtypes and shapes; a tensor larger than a bucket travels alone, as itself.
The extra memory on either side is one bucket, or that one tensor where it is larger (strop
serve receives a lone tensor straight into its parameter: no extra memory at all).
"""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass

import torch

from strop.engines.base import GroupMember
from strop.engines.health import HEALTHY, REJOINING
from strop.process import free_port
from strop.sync.base import Receipt, WeightSync
from strop.wire.buckets import Bucket, fill_bucket, first_mismatch, manifest_of, plan_buckets
from strop.wire.digest import StreamDigest
from strop.wire.errors import EngineManifestError, EngineReceiptError, EngineUnavailable
from strop.wire.group import _broadcast, close_group, make_group

DEFAULT_SYNC_BUCKET_BYTES = 64 << 20
SEND_GRACE_S = 5.0  # how long a send may trail its receiver's answer (it cannot: the receiver has every byte)


@dataclass
class _Link:
    """The trainer's group with one engine, and a send left in its collective when the engine failed."""

    group: object
    name: str
    inflight: object = None


class BroadcastSync(WeightSync):
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

    def __init__(
        self,
        bucket_bytes: int = DEFAULT_SYNC_BUCKET_BYTES,
        backend: str = "gloo",
        host: str = "127.0.0.1",
        timeout_s: float = 600.0,
        pause_mode: str = "abort",
        dtype: str | None = None,
    ):
        self.bucket_bytes, self.backend, self.host, self.timeout_s = bucket_bytes, backend, host, timeout_s
        self.pause_mode, self.dtype = pause_mode, dtype
        self.links: dict = {}  # engine -> _Link
        self.generation = 0
        self.timings: dict[str, float] = {}  # the last update's phases: prepare, buckets, finish, receipt

    async def _connect(self, engine) -> _Link:
        """A new group of this process (rank 0) and ``engine`` (ranks 1 .. its workers). An engine that refuses
        to join ends the wait at once (this side's rendezvous is left to time out alone, then closed)."""
        port, world = free_port(), 1 + (engine.group_ranks if isinstance(engine, GroupMember) else 1)
        self.generation += 1
        name = f"strop-sync-{self.generation}-{secrets.token_hex(4)}"  # unique: torch refuses a name twice
        own = asyncio.ensure_future(
            asyncio.to_thread(make_group, self.host, port, 0, world, self.backend, self.timeout_s, name)
        )
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

    async def close(self) -> None:
        """Leave every engine's group."""
        await asyncio.gather(*(self.drop(e) for e in list(self.links)))

    async def check(self, engines: list, manifest) -> None:
        """Refuse, before any bytes move, an engine whose tensors differ from the trainer's (naming the first
        difference). An engine that cannot list its tensors (SGLang) checks each bucket as it arrives."""
        held = await asyncio.gather(*(e.weights_manifest() for e in engines))
        for engine, theirs in zip(engines, held):
            if theirs is not None and (why := first_mismatch(manifest, theirs, repr(engine))) is not None:
                raise EngineManifestError(f"weight broadcast refused before sending: {why}")

    async def update(self, weights, version: int) -> Receipt:
        """Broadcast to every healthy engine and every engine waiting to rejoin, in one pass: one that fails
        leaves the update (down if it no longer answers, else rejoining: it serves again only after a whole
        update), the others complete it. A receipt that disagrees with what was sent fails the step."""
        pool = self.pool
        members = pool.members(HEALTHY, REJOINING)
        if not members:
            raise EngineUnavailable("no engine is healthy to receive the weights")
        sent, results = await self.send([pool.engines[i] for i in members], weights, version)
        pool.weight_version = version
        wrong = None
        for i, result in zip(members, results):
            if not isinstance(result, BaseException):  # healthy only at the version its receipt shows
                pool.move(i, HEALTHY, "received the broadcast", result)
            elif not await pool.engines[i].health():
                pool.mark_down(i, f"weight broadcast of version {version} failed: {result}")
            else:
                pool.move(i, REJOINING, f"weight broadcast of version {version} failed: {result}")
                if isinstance(result, EngineReceiptError):
                    wrong = wrong or result
        if wrong is not None:  # an engine that took the bytes but holds something else: never silently served
            raise wrong
        return Receipt(version, sent)

    rejoins = True

    async def forget(self, i: int) -> None:
        await self.drop(self.pool.engines[i])  # a group joined before it went down is gone with its old process

    async def send(
        self, engines: list, named: dict[str, torch.Tensor], version: int
    ) -> tuple[int, list[int | BaseException]]:
        """Broadcast ``named`` to ``engines`` as ``version``. Returns the bytes that reached engines and, per
        engine, the version its receipt shows, or the error that took it out of this update."""
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
        receipts = await asyncio.gather(*(self._receipt(e, version, digest) for e in live), return_exceptions=True)
        lap("receipt")
        outcome |= {e: r for e, r in zip(live, receipts)}
        for engine, result in outcome.items():
            if isinstance(result, BaseException):
                await self.drop(engine)  # the link may be broken: the next update builds a new one
        return sent, [outcome[e] for e in engines]

    async def _send(self, engine, buf: torch.Tensor, bucket: Bucket, version: int, last: bool) -> None:
        """One bucket to one engine: its update call and this side's broadcast of ``buf`` together. If the call
        fails first (refused, or the engine died), the send may stay in its collective: it is not waited for."""
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
                        "(a group other than the trainer's?): nothing it holds is trusted"
                    )
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
            raise EngineReceiptError(
                f"{engine!r}: the update to version {version} arrived as {checksum}, the "
                f"trainer sent {digest.hexdigest()}"
            )
        return held
