"""Weight sync of a LoRA run (``engine.sync='adapter'``): each version's adapter alone is written once, as a peft
adapter folder (a few megabytes where the merged model is hundreds, strop.wire.lora.peft_files), and every
engine loads it as ``policy-v<version>``:

- strop serve merges it over its base weights (strop.serving.routes_lora). Receipt: its checksum of the weights
  it merged equals the trainer's merged weights' (strop.wire.lora.merge on both sides), and the version.
- vLLM and SGLang load it at run time beside the adapters still in use and apply it unmerged; requests name it
  (strop.engines.adapters). Receipt: the adapter each server lists (and, vLLM, the one each completion names),
  and the router's logprob probe after the update.

The newest ``keep`` folders stay on disk: a server reads one again when it has evicted it from its cache."""

from __future__ import annotations

import asyncio

from strop.engines.base import AdapterLoader
from strop.engines.health import HEALTHY
from strop.sync.base import Receipt, WeightSync
from strop.sync.disk import WeightWriter
from strop.wire.digest import state_checksum
from strop.wire.errors import EngineRequestError, EngineUnavailable
from strop.wire.lora import ADAPTER_FILE, CONFIG_FILE, adapter_pairs, peft_files
from strop.wire.weights import nbytes


class AdapterSync(WeightSync):
    """Write the adapter (``writer``), merge it into every healthy engine (a failure marks it down); an engine
    that returns lagging merges the newest adapter before it is re-admitted."""

    def __init__(self, writer: WeightWriter, keep: int = 2):
        """``keep``: the versions an engine may still be serving (``rollout.max_staleness + 2``): their folders
        stay."""
        self.writer = writer
        writer.keep = max(writer.keep, keep)
        self.latest: tuple | None = None  # folder, scale, checksum, version

    async def update(self, weights, version: int) -> Receipt:
        adapter, scaling = getattr(weights, "adapter", None), getattr(weights, "scaling", None)
        if not adapter or scaling is None:
            raise ValueError(
                "engine.sync='adapter' sends a LoRA adapter with one scale: these weights carry none "
                "(model.lora_rank=0, or adapters of several scales)"
            )
        pool = self.pool
        tensors, config = peft_files(adapter_pairs(adapter), scaling)
        path, _ = await asyncio.to_thread(
            self.writer.write, tensors, version, "-adapter", filename=ADAPTER_FILE, beside={CONFIG_FILE: config}
        )
        checksum = None  # (only strop serve, which merges, computes one to compare: vLLM and SGLang do not)
        if any(getattr(e, "require_checksum", False) for e in pool.engines):
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
            pool.mark_down(i, "it cannot load a LoRA adapter (engine.sync='adapter': strop serve, vLLM and SGLang)")
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
