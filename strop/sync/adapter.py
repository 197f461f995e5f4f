"""Weight sync of a LoRA run into strop serve (``engine.sync='adapter'``): each version's adapter alone is
written once (a few megabytes where the merged model is hundreds) and every engine merges it over its base
weights (strop.serving.routes_lora). Receipt: each engine's checksum of the weights it merged equals the
trainer's merged weights' (strop.wire.lora.merge on both sides), and the version it reports."""

from __future__ import annotations

import asyncio

from strop.engines.base import AdapterLoader
from strop.engines.health import HEALTHY
from strop.sync.base import Receipt, WeightSync
from strop.sync.disk import WeightWriter
from strop.wire.digest import state_checksum
from strop.wire.errors import EngineRequestError, EngineUnavailable
from strop.wire.weights import nbytes


class AdapterSync(WeightSync):
    """Write the adapter (``writer``), merge it into every healthy engine (a failure marks it down); an engine
    that returns lagging merges the newest adapter before it is re-admitted."""

    def __init__(self, writer: WeightWriter):
        self.writer = writer
        self.latest: tuple | None = None  # folder, scale, checksum, version

    async def update(self, weights, version: int) -> Receipt:
        adapter, scaling = getattr(weights, "adapter", None), getattr(weights, "scaling", None)
        if not adapter or scaling is None:
            raise ValueError(
                "engine.sync='adapter' sends a LoRA adapter with one scale: these weights carry none "
                "(model.lora_rank=0, or adapters of several scales)"
            )
        pool = self.pool
        path, _ = await asyncio.to_thread(self.writer.write, adapter, version, "-adapter")
        checksum = await asyncio.to_thread(state_checksum, {n: weights[n] for n in weights.merged})
        self.latest, pool.weight_version = (path, scaling, checksum, version), version
        members = pool.members(HEALTHY)
        loaded = await asyncio.gather(*(self.load(i) for i in members))
        sent = sum(nbytes(adapter, n) for n in adapter)
        full = sum(nbytes(weights, n) for n in {id(t): n for n, t in weights.items()}.values())
        return Receipt(version, bytes_sent=sent * sum(loaded), bytes_full=full * len(members))

    async def load(self, i: int) -> bool:
        """Merge the current adapter into engine ``i``; healthy afterwards only at the version it reports."""
        pool = self.pool
        path, scaling, checksum, version = self.latest
        engine, before = pool.engines[i], pool.state[i]
        if not isinstance(engine, AdapterLoader):
            pool.mark_down(i, "it cannot merge a LoRA adapter (engine.sync='adapter' is strop serve's)")
            return False
        try:
            held = await engine.load_adapter(str(path), version, scaling, checksum)
        except (EngineUnavailable, EngineRequestError) as exc:
            pool.mark_down(i, f"adapter load of version {version} failed: {exc}")
            return False
        if pool.state[i] == before:  # (a request that failed on it meanwhile leaves it to the health loop)
            pool.move(i, HEALTHY, "merged the current adapter", held)
        return True

    async def catch_up(self, i: int) -> bool:
        if self.latest is None:
            return False
        return await self.load(i)
