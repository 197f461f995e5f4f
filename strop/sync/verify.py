"""``engine.verify_updates``: a corrupt-then-restore check of the weight transport, around the run's first
update ('first') or every one ('every').

1. Each engine that takes the update is paused and its weights are overwritten with noise through a path of
   the engine's own, not the transport's: the embedded engine's own load; strop serve's
   ``/update_weights_from_disk`` of a noise file written into its weights folder (checked by the checksum of
   the file it loaded). What it then holds is read back, a digest per tensor (the embedded engine's own;
   strop serve's ``/weight_checker``), and must be the noise in every tensor: else the check proves nothing.
2. The update runs through the run's own transport, unchanged.
3. Each engine that is healthy after it must hold the trainer's tensors, cast to the dtype it holds them in,
   bit for bit. An update that skipped a tensor, or never arrived, leaves noise there: the step fails with an
   :class:`EngineReceiptError` naming the engine, the transport and the first tensor that differs, and the
   engine is taken down (a router's) so it never serves.

The noise of each tensor is normal draws (integers for integer tensors) from a generator seeded by the
check's seed, the version and the bytes of the trainer's tensor it stands for, so tied names get the same
noise; one equal to the trainer's tensor (as the engine holds it) is drawn again. It is read a bucket at a
time, never whole, like the trainer's weights.

The delta transport sends the tensors that differ from what it believes an engine holds. After the noise the
check tells the transport the engine's weights were overwritten (:meth:`WeightSync.overwritten`): the delta
transport then sends every tensor. One that kept its record would leave noise in every tensor that did not
change since the last update, and the check fails on it.

Cost: two more passes over the trainer's weights (digests), one over the noise, a noise load and two digest
read-backs per engine, and (delta) one full update instead of the changed tensors; strop serve also writes
the noise to disk once (removed after it loaded). Where it runs: the embedded engine and strop serve;
vLLM and SGLang report digests of their own fused or repacked tensors, which the trainer cannot reproduce
(strop.rules refuses the option there)."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import shutil
import time
from collections.abc import Iterator, Mapping

import torch

from strop.engines.base import InProcess, WeightChecked
from strop.engines.health import HEALTHY, REJOINING, EngineHealth
from strop.sync.base import Receipt, WeightSync
from strop.sync.disk import WeightWriter
from strop.wire.buckets import manifest_of
from strop.wire.digest import tensor_digest
from strop.wire.errors import EngineManifestError, EngineReceiptError
from strop.wire.weights import DEFAULT_WRITE_BUCKET_BYTES, describe, in_buckets

log = logging.getLogger(__name__)

RESTORE_FAILED = (
    "a tensor the update skipped, or an update that never arrived, leaves the noise in place; it must not serve"
)
NOISE_FAILED = "the noise did not reach it: the check cannot show what the update restores"
NOISE_SEED = 0x5EED  # the check's seed (with the version and each tensor's bytes: the noise is reproducible)


def noise_seed(seed: int, version: int, digest: str, salt: int = 0) -> int:
    """The seed of one tensor's noise: a hash of the check's ``seed``, the ``version``, the ``digest`` of the
    trainer's tensor it stands for and a ``salt`` (raised when the draw equals the real tensor)."""
    h = hashlib.blake2b(f"{seed}:{version}:{digest}:{salt}".encode(), digest_size=8)
    return int.from_bytes(h.digest(), "little") & (2**63 - 1)


class Noise(Mapping):
    """Noise shaped like ``named`` (every name, dtype and shape), each tensor drawn when it is read, on the CPU,
    from a generator seeded by ``seeds[name]``: the same seed draws the same tensor again."""

    def __init__(self, named: Mapping, seeds: dict[str, int]):
        self.named, self.seeds = named, seeds

    def __getitem__(self, name: str) -> torch.Tensor:
        dtype, shape = describe(self.named, name)
        g = torch.Generator().manual_seed(self.seeds[name])
        if dtype.is_floating_point:
            return torch.randn(shape, generator=g).to(dtype)
        high = 2 if dtype == torch.bool else 127
        return torch.randint(0, high, shape, generator=g).to(dtype)

    def __iter__(self) -> Iterator[str]:
        return iter(self.named)

    def __len__(self) -> int:
        return len(self.named)

    def meta(self, name: str) -> tuple[torch.dtype, tuple[int, ...]]:
        return describe(self.named, name)

    def gather(self, names) -> dict[str, torch.Tensor]:
        return {n: self[n] for n in names}


def _digests(named: Mapping, names: list[str], dtypes: dict[str, str], bucket_bytes: int) -> tuple[dict, dict]:
    """One pass over ``names`` of ``named``, a bucket at a time: each tensor's digest as it is, and (names in
    ``dtypes``) its digest cast to the dtype an engine holds it in."""
    raw, cast = {}, {}
    for part in in_buckets(named, names, bucket_bytes):
        for name, t in part.items():
            raw[name] = tensor_digest(t)
            if name in dtypes:
                held = getattr(torch, dtypes[name])
                cast[name] = raw[name] if t.dtype == held else tensor_digest(t.to(held))
    return raw, cast


def _bare(digests: dict[str, str]) -> dict[str, str]:
    """Digests keyed by tensor name (vLLM's ``/weight_checker`` keys carry a ``dp0:pp0:pcp0:tp0:`` prefix)."""
    return {key.rpartition(":")[2]: d for key, d in digests.items()}


class _Embedded:
    """The embedded engine: noise through its own load (paused: no row decodes on it), digests of its own."""

    name = "the embedded engine"

    def __init__(self, engine):
        self.engine, self.held = engine, False

    async def manifest(self) -> list:
        return manifest_of(self.engine.weights())

    async def pause(self) -> None:
        self.held = self.engine.paused is not None  # (paused by the rollout already, e.g. partial=keep: its own)
        if not self.held:
            await self.engine.pause("wait")  # (rows running finish on the weights that started them)

    async def resume(self) -> None:
        if not self.held:
            self.engine.resume()

    async def corrupt(self, noise: Noise, weights: Mapping, loaded) -> None:
        own = self.engine.weights()
        plain = not hasattr(weights, "gather")  # (sharded weights are never an engine's own)
        if plain and any(n in weights and weights[n].data_ptr() == t.data_ptr() for n, t in own.items()):
            raise ValueError(
                "engine.verify_updates: the embedded engine decodes from the trainer's own tensors "
                "(engine.share_weights): there is no update to verify, and noise would overwrite the trainer's weights"
            )
        await self.engine.update_weights(noise, version=self.engine.weight_version)

    async def digests(self) -> dict[str, str]:
        return _bare(await self.engine.tensor_digests())


class _Server:
    """A strop serve server: noise loaded from a file in its weights folder, digests from ``/weight_checker``."""

    def __init__(self, engine, pause_mode: str):
        self.engine, self.pause_mode, self.name = engine, pause_mode, repr(engine)

    async def manifest(self) -> list:
        return await self.engine.weights_manifest() or []

    async def pause(self) -> None:
        await self.engine.pause(self.pause_mode)  # (other clients' requests: strop's own were drained)

    async def resume(self) -> None:
        await self.engine.resume()

    async def corrupt(self, noise: Noise, weights: Mapping, loaded) -> None:
        path, checksum = await loaded()  # (the noise file, written once for every server)
        held = await self.engine.get_weight_version()  # (its label stays: the update sets the next one)
        await self.engine.load_weights(path, held, checksum)

    async def digests(self) -> dict[str, str]:
        return _bare(await self.engine.tensor_digests())


class VerifiedSync(WeightSync):
    """``transport`` with the corrupt-then-restore check around its first update (``every``: each one); the
    rest is the transport's own. ``name`` names the transport in messages; ``writer`` writes strop serve's
    noise file (into the folder its servers load from); ``pause_mode`` is how each server pauses while it
    holds noise (engine.sync_pause)."""

    def __init__(
        self,
        transport: WeightSync,
        name: str,
        every: bool = False,
        writer: WeightWriter | None = None,
        pause_mode: str = "abort",
        seed: int = NOISE_SEED,
        bucket_bytes: int = DEFAULT_WRITE_BUCKET_BYTES,
    ):
        self.transport, self.name, self.every, self.writer = transport, name, every, writer
        self.pause_mode, self.seed, self.bucket_bytes = pause_mode, seed, bucket_bytes
        self.due = True  # the next update is checked
        self.spoiled: set[int] = set()  # engines taken down holding noise: never re-admitted as they are
        self.seconds = 0.0  # what the last check added to its update

    def __getattr__(self, name):  # what else the transport shows (a broadcast's timings and links)
        if name == "transport":
            raise AttributeError(name)
        return getattr(self.transport, name)

    def connect(self, pool) -> None:
        super().connect(pool)
        self.transport.connect(pool)

    def holds_current(self, i: int) -> bool:
        return i not in self.spoiled and self.transport.holds_current(i)

    @property
    def rejoins(self) -> bool:
        return self.transport.rejoins

    async def forget(self, i: int) -> None:
        await self.transport.forget(i)

    async def overwritten(self, i: int) -> None:
        await self.transport.overwritten(i)

    async def catch_up(self, i: int) -> bool:
        loaded = await self.transport.catch_up(i)
        if loaded:
            self.spoiled.discard(i)
        return loaded

    async def close(self) -> None:
        await self.transport.close()

    async def update(self, weights, version: int) -> Receipt:
        if not self.due:
            receipt = await self.transport.update(weights, version)
            if isinstance(self.pool, EngineHealth):  # a spoiled engine that took a whole update is clean again
                self.spoiled -= set(self.pool.members(HEALTHY))
            return receipt
        self.due = self.every
        t0 = time.perf_counter()
        engines = self._engines()
        noise, real, fake = await self._prepare(weights, version, engines)
        proven: set = set()
        try:
            await asyncio.gather(*(h.pause() for _, h in engines))
            await self._corrupt(engines, noise, weights, version, fake)
            t1 = time.perf_counter()
            receipt = await self.transport.update(weights, version)
            t2 = time.perf_counter()
            healthy = [(i, h) for i, h in engines if i is None or self.pool.state[i] == HEALTHY]
            after = f"the {self.name} update to version {version} that followed noise"
            await self._expect(healthy, real, proven, after, RESTORE_FAILED)
            seconds = time.perf_counter() - t0 - (t2 - t1)  # (the check's own time, not the update's)
        except BaseException as exc:
            self._take_down([(i, h) for i, h in engines if h not in proven], exc)
            raise
        finally:
            await asyncio.gather(*(h.resume() for _, h in engines), return_exceptions=True)
        self.seconds = seconds
        log.info(
            f"strop: engine.verify_updates: {len(engines)} engine(s) overwritten with noise, then restored bit for "
            f"bit by the {self.name} update to version {version} ({len(real)} tensors; the check took {seconds:.2f} s "
            "besides the update)"
        )
        return receipt

    def _engines(self) -> list[tuple[int | None, object]]:
        """(router index, or None for the embedded engine; how to overwrite and read it) of each engine the
        update goes to."""
        pool = self.pool
        if not isinstance(pool, EngineHealth):
            return [(None, self._holder(pool))]
        return [(i, self._holder(pool.engines[i])) for i in pool.members(HEALTHY, REJOINING)]

    def _holder(self, engine):
        if isinstance(engine, InProcess):
            return _Embedded(engine)
        if isinstance(engine, WeightChecked):
            if self.writer is None:
                raise ValueError("engine.verify_updates: a server's noise is loaded from disk: give the check a writer")
            return _Server(engine, self.pause_mode)
        raise ValueError(
            f"engine.verify_updates: {engine!r} reports no digest of the tensors it holds, so no update to it can "
            "be checked bit for bit (the embedded engine and strop serve report one)"
        )

    async def _prepare(self, weights, version: int, engines: list) -> tuple[Noise, dict, dict]:
        """The noise, and the digest each engine must report of every tensor it holds: after the update (the
        trainer's tensors, cast as it holds them) and after the noise."""
        manifests = await asyncio.gather(*(h.manifest() for _, h in engines))
        names, dtypes = sorted(weights), {}
        for (_, h), manifest in zip(engines, manifests):
            for name, dtype, _ in manifest:
                if name not in weights:
                    raise EngineManifestError(
                        f"engine.verify_updates: {h.name} holds {name!r}, which the trainer does not send"
                    )
                if dtypes.setdefault(name, dtype) != dtype:
                    raise EngineManifestError(
                        f"engine.verify_updates: the engines hold {name!r} as {dtypes[name]} and as {dtype}; the "
                        "check compares every engine with one cast of the trainer's tensor"
                    )

        def plan():
            raw, real = _digests(weights, names, dtypes, self.bucket_bytes)
            seeds = {n: noise_seed(self.seed, version, raw[n]) for n in names}  # (tied names: the same seed)
            noise = Noise(weights, seeds)
            _, fake = _digests(noise, sorted(dtypes), dtypes, self.bucket_bytes)
            for name in sorted(dtypes):
                salt = 0
                while fake[name] == real[name] and salt < 16:  # (a tensor of no elements stays equal)
                    salt += 1
                    old, new = seeds[name], noise_seed(self.seed, version, raw[name], salt)
                    seeds.update({n: new for n, s in seeds.items() if s == old})
                    fake[name] = _digests(noise, [name], dtypes, self.bucket_bytes)[1][name]
            return noise, real, fake

        return await asyncio.to_thread(plan)

    async def _corrupt(self, engines: list, noise: Noise, weights, version: int, fake: dict) -> None:
        """Overwrite every engine's weights with ``noise``, through its own path, and require it holds the noise in
        every tensor; the transport is told (its next update sends everything)."""
        written = None

        async def loaded():  # strop serve's noise file, written once for every server that loads it
            nonlocal written
            if written is None:
                written = asyncio.ensure_future(asyncio.to_thread(self.writer.write, noise, version, "-noise"))
            return await written

        try:
            await asyncio.gather(*(h.corrupt(noise, weights, loaded) for _, h in engines))
        finally:
            for i, _ in engines:
                if i is not None:
                    await self.transport.overwritten(i)
            if written is not None and written.done() and not written.exception():
                shutil.rmtree(written.result()[0], ignore_errors=True)  # (loaded: the file is not needed again)
        after = f"the noise sent before the {self.name} update to version {version}"
        await self._expect(engines, fake, set(), after, NOISE_FAILED)

    async def _expect(self, engines: list, want: dict, proven: set, after: str, why: str) -> None:
        """Every engine of ``engines`` must report ``want``'s digest of each tensor it holds; each that does joins
        ``proven``. Raises naming the first engine that does not, the first tensor that differs, and ``why``."""
        got = await asyncio.gather(*(h.digests() for _, h in engines))
        for (_, h), digests in zip(engines, got):
            differ = sorted({n for n in digests if digests[n] != want.get(n)} | (set(want) - set(digests)))
            if differ:
                raise EngineReceiptError(
                    f"engine.verify_updates: {h.name} does not hold what it was sent after {after}: {len(differ)} of "
                    f"{len(digests)} tensors differ, the first {differ[0]!r} ({why})"
                )
            proven.add(h)

    def _take_down(self, engines: list, exc: BaseException) -> None:
        """Each engine of a router that may hold noise goes down, and is re-admitted only after a whole update
        (the embedded engine: the step fails with ``exc``)."""
        for i, _ in engines:
            if i is not None:
                self.spoiled.add(i)
                self.pool.mark_down(i, f"may hold engine.verify_updates' noise: {exc}")
