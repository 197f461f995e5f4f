"""Weight sync of only what changed: each engine gets the tensors whose bytes differ from those it holds,
written to disk once per set of changed tensors, and checks each by its digest as it loads it."""

from __future__ import annotations

import asyncio

from strop.engines.health import DOWN, HEALTHY, REJOINING
from strop.sync.base import Receipt, WeightSync
from strop.sync.disk import WeightWriter
from strop.wire.buckets import manifest_of
from strop.wire.digest import tensor_digest
from strop.wire.errors import EngineRequestError, EngineUnavailable
from strop.wire.weights import Subset, in_buckets, nbytes


class DeltaSync(WeightSync):
    """Send each healthy or rejoining engine the tensors it does not hold yet (by digest); an engine restarted
    since its last load holds its initial tensors and gets them all. An engine that returns lagging rejoins
    at the next update."""

    def __init__(self, writer: WeightWriter):
        self.writer = writer
        self.held: list[dict[str, str]] = []  # digest of each tensor an engine holds, per engine
        self.digests: dict[str, str] = {}  # the digests of the current version

    def connect(self, pool) -> None:
        super().connect(pool)
        self.held = [{} for _ in pool.engines]

    def holds_current(self, i: int) -> bool:
        return self.held[i] == self.digests

    rejoins = True

    async def forget(self, i: int) -> None:
        self.held[i] = {}  # a restarted engine holds its initial weights: everything is sent

    async def overwritten(self, i: int) -> None:
        self.held[i] = {}  # (engine.verify_updates' noise: every tensor differs from what it was sent)

    async def update(self, weights, version: int) -> Receipt:
        pool = self.pool
        unique = [name for name, _, _ in manifest_of(weights)]

        def digest_all():  # a bucket at a time (sharded weights: gathered as read, never whole)
            return {n: tensor_digest(t) for part in in_buckets(weights, unique) for n, t in part.items()}

        digests = await asyncio.to_thread(digest_all)
        sizes = {name: nbytes(weights, name) for name in unique}
        members = pool.members(HEALTHY, REJOINING)
        for i in members:  # an engine restarted since its last load holds its initial tensors: it gets them all
            try:
                if await pool.engines[i].get_weight_version() != pool.held_version[i]:
                    self.held[i] = {}
            except (EngineUnavailable, EngineRequestError):
                self.held[i] = {}
        by_change: dict[frozenset, list[int]] = {}
        for i in members:  # engines holding the same tensors get the same file
            changed = frozenset(n for n, d in digests.items() if self.held[i].get(n) != d)
            by_change.setdefault(changed, []).append(i)
        receipt = Receipt(version, 0, len(members) * sum(sizes.values()))
        pool.weight_version, self.digests = version, digests
        for k, (changed, engines) in enumerate(by_change.items()):
            path, _ = await asyncio.to_thread(
                self.writer.write, Subset(weights, sorted(changed)), version, f"-delta{k}"
            )
            sent = {n: digests[n] for n in changed}

            async def load(i):
                try:
                    held = await pool.engines[i].load_weights(path, version, digests=sent)
                except (EngineUnavailable, EngineRequestError) as exc:
                    pool.mark_down(i, f"delta weight load of version {version} failed: {exc}")
                    self.held[i] = {}
                    return
                self.held[i] = dict(digests)
                receipt.bytes_sent += sum(sizes[n] for n in changed)
                if pool.state[i] != DOWN:  # (a request that failed on it meanwhile leaves it to the health loop)
                    pool.move(i, HEALTHY, "loaded the changed tensors", held)

            await asyncio.gather(*(load(i) for i in engines))
        return receipt
