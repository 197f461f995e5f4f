"""A router over several engines that is itself an Engine.

- **Least outstanding requests**: each request goes to the healthy engine with the fewest
  requests in flight (ties: the first).
- **Failover**: an engine that fails a request (:class:`EngineUnavailable`: refused, reset,
  timed out, 5xx after the client's retries) is marked down and the request is re-issued to
  another healthy engine, up to ``max_attempts`` engines; when every attempt failed the request
  ends with finish_reason "abort" (an ABORTED sample: never trained on, never lost, never hanging).
- **Health checks** every ``health_interval_s``: a down engine that answers ``/health`` again
  is re-admitted once it holds the current weight version (the router loads the newest
  weights into it first when it lags).
- **Affinity** (optional): requests with the same ``affinity`` key (the turns of one
  multi-turn sample) stay on one engine while it is healthy.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

from strop.engines.http import EngineRequestError, EngineUnavailable, WeightWriter
from strop.types import Completion, SamplingParams


class Router:
    def __init__(self, engines: list, *, writer: WeightWriter | None = None, max_attempts: int | None = None,
                 health_interval_s: float = 2.0, affinity: bool = False, broadcast=None, delta: bool = False):
        """``writer``: weights go through disk; ``delta``: only the tensors an engine does not hold yet,
        each checked by its digest; ``broadcast`` (a :class:`strop.engines.sync.BroadcastSync`): they
        are broadcast over a process group with the engines instead."""
        if not engines:
            raise ValueError("a router needs at least one engine")
        self.engines = list(engines)
        self.writer = writer
        self.max_attempts = max_attempts or len(self.engines)
        self.health_interval_s, self.affinity = health_interval_s, affinity
        self.healthy = [True] * len(self.engines)
        self.outstanding = [0] * len(self.engines)
        self.weight_version = 0
        self.latest: tuple[Path, str] | None = None  # where the current weights are on disk, and their checksum
        self.events: list[str] = []  # down / re-admitted, for logs and tests
        self.failovers = 0
        self._sticky: dict[str, int] = {}
        self._health_task: asyncio.Task | None = None
        self.broadcast = broadcast
        self.rejoining: set[int] = set()  # broadcast / delta sync: back up, gets the weights at the next update
        self.bytes_sent = 0  # the last update: bytes that reached engines (all of them together)
        self.bytes_full = 0  # what a full sync to the same engines would have moved
        self.delta = delta
        self.held: list[dict[str, str]] = [{} for _ in self.engines]  # delta: digest of each tensor an engine holds

    def _pick(self, exclude: set[int], key: str | None) -> int | None:
        if key is not None and key in self._sticky:
            i = self._sticky[key]
            if self.healthy[i] and i not in exclude:
                return i
        candidates = [i for i in range(len(self.engines)) if self.healthy[i] and i not in exclude]
        if not candidates:
            return None
        i = min(candidates, key=lambda j: self.outstanding[j])
        if key is not None:
            self._sticky[key] = i
        return i

    def _mark_down(self, i: int, why: str) -> None:
        if self.healthy[i]:
            self.healthy[i] = False
            self.events.append(f"down {self.engines[i]!r}: {why}")

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams, request_id: str | None = None,
                       affinity: str | None = None) -> Completion:
        self._ensure_health_loop()
        tried: set[int] = set()
        rid = request_id or uuid.uuid4().hex
        while len(tried) < self.max_attempts:
            i = self._pick(tried, affinity if self.affinity else None)
            if i is None:
                break
            tried.add(i)
            self.outstanding[i] += 1
            try:
                return await self.engines[i].generate(prompt_ids, sampling, request_id=f"{rid}-{len(tried)}")
            except EngineUnavailable as exc:
                self._mark_down(i, str(exc))
                self.failovers += 1
            finally:
                self.outstanding[i] -= 1
        return Completion([], [], "abort", self.weight_version)  # every engine tried failed: ABORTED, not lost

    async def update_weights(self, state_dict, version: int | None = None) -> int:
        """Write the weights once, load them into every healthy engine (a failure marks it down);
        or broadcast them to every healthy engine and every engine waiting to rejoin."""
        version = self.weight_version + 1 if version is None else version
        if self.broadcast is not None:
            return await self._update_by_broadcast(state_dict, version)
        if self.writer is None:
            raise ValueError("the router syncs weights through disk: give it a WeightWriter")
        if self.delta:
            return await self._update_by_delta(state_dict, version)
        self.latest = self.writer.write(state_dict, version)
        await asyncio.gather(*(self._load(i, version) for i in range(len(self.engines)) if self.healthy[i]))
        self.weight_version = version
        if not any(self.healthy):
            raise EngineUnavailable("no engine is healthy after the weight update")
        return version

    async def _update_by_broadcast(self, state_dict, version: int) -> int:
        for attempt in range(2):
            members = [i for i in range(len(self.engines)) if self.healthy[i] or i in self.rejoining]
            if not members:
                raise EngineUnavailable("no engine is healthy to receive the weights")
            try:
                self.bytes_sent = await self.broadcast.update([self.engines[i] for i in members], state_dict, version)
            except (EngineUnavailable, EngineRequestError, RuntimeError) as exc:
                for i in members:  # whoever does not answer now leaves the group; the rest try again
                    if not await self.engines[i].health():
                        self._mark_down(i, f"weight broadcast failed: {exc}")
                        self.rejoining.discard(i)
                if attempt:
                    raise
                continue
            for i in self.rejoining:
                self.healthy[i] = True
                self.events.append(f"re-admitted {self.engines[i]!r} at weight version {version}")
            self.rejoining.clear()
            self.weight_version = version
            return version
        raise AssertionError("unreachable")

    async def _update_by_delta(self, state_dict, version: int) -> int:
        from strop.engines.http import tensor_digest
        from strop.engines.sync import manifest_of

        unique = {name: state_dict[name] for name, _, _ in manifest_of(state_dict)}
        digests = {name: tensor_digest(t) for name, t in unique.items()}
        sizes = {name: t.numel() * t.element_size() for name, t in unique.items()}
        members = [i for i in range(len(self.engines)) if self.healthy[i] or i in self.rejoining]
        by_change: dict[frozenset, list[int]] = {}
        for i in members:  # engines holding the same tensors get the same file
            changed = frozenset(n for n, d in digests.items() if self.held[i].get(n) != d)
            by_change.setdefault(changed, []).append(i)
        self.bytes_sent, self.bytes_full = 0, len(members) * sum(sizes.values())
        for k, (changed, engines) in enumerate(by_change.items()):
            path, _ = self.writer.write({n: unique[n] for n in sorted(changed)}, version, tag=f"-delta{k}")
            sent = {n: digests[n] for n in changed}

            async def load(i):
                try:
                    await self.engines[i].load_weights(path, version, digests=sent)
                except (EngineUnavailable, EngineRequestError) as exc:
                    self._mark_down(i, f"delta weight load failed: {exc}")
                    self.rejoining.discard(i)
                    self.held[i] = {}
                    return
                self.held[i] = dict(digests)
                self.bytes_sent += sum(sizes[n] for n in changed)
                if i in self.rejoining:
                    self.rejoining.discard(i)
                    self.healthy[i] = True
                    self.events.append(f"re-admitted {self.engines[i]!r} at weight version {version}")
            await asyncio.gather(*(load(i) for i in engines))
        self.weight_version = version
        if not any(self.healthy):
            raise EngineUnavailable("no engine is healthy after the weight update")
        return version

    async def _load(self, i: int, version: int) -> None:
        path, checksum = self.latest
        try:
            await self.engines[i].load_weights(path, version, checksum)
        except (EngineUnavailable, EngineRequestError) as exc:
            self._mark_down(i, f"weight load failed: {exc}")

    async def abort_all(self) -> None:
        await asyncio.gather(*(e.abort_all() for i, e in enumerate(self.engines) if self.healthy[i]),
                             return_exceptions=True)

    async def health(self) -> bool:
        await self.check_health()
        return any(self.healthy)

    async def check_health(self) -> None:
        """Probe every down engine; re-admit one that answers and holds (or now loads) the current weights."""
        for i, engine in enumerate(self.engines):
            if self.healthy[i] or i in self.rejoining or not await engine.health():
                continue
            if self.broadcast is not None or self.delta:  # it gets the weights (and is re-admitted) at the next update
                self.held[i] = {}  # a restarted engine holds its initial weights: everything is sent
                if self.weight_version:
                    self.rejoining.add(i)
                else:
                    self.healthy[i] = True
                continue
            try:
                if self.weight_version and await engine.get_weight_version() != self.weight_version:
                    if self.latest is None:
                        continue
                    # raises unless the engine loaded them and reports the trainer's checksum
                    await engine.load_weights(self.latest[0], self.weight_version, self.latest[1])
                self.healthy[i] = True
                self.events.append(f"re-admitted {engine!r} at weight version {self.weight_version}")
            except (EngineUnavailable, EngineRequestError):
                continue

    def _ensure_health_loop(self) -> None:
        if self._health_task is None or self._health_task.done():
            self._health_task = asyncio.ensure_future(self._health_loop())

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            if not all(self.healthy):
                await self.check_health()

    async def close(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            try:
                await self._health_task
            except asyncio.CancelledError:
                pass
        for e in self.engines:
            await e.close()
