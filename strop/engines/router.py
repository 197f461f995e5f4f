"""A router over several engines that is itself an Engine.

- **Least outstanding requests**: each request goes to the healthy engine with the fewest
  requests in flight (ties: the first).
- **Failover**: an engine that fails a request (:class:`EngineUnavailable`: refused, reset,
  timed out, 5xx after the client's retries) is marked down and the request is re-issued to
  another healthy engine, up to ``max_attempts`` engines; when every attempt failed the request
  ends with finish_reason "abort" (an ABORTED sample: never trained on, never lost, never hanging).
- **Engine health and weight versions**: :class:`strop.engines.health.EngineHealth`, the state
  machine the router keeps; weight updates go through the router's transport (:mod:`strop.sync`).
- **Affinity** (optional): requests with the same ``affinity`` key (the turns of one
  multi-turn sample) stay on one engine while it is healthy.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import OrderedDict

from strop.engines.health import HEALTHY, EngineHealth
from strop.sync.base import WeightSync
from strop.types import Completion, SamplingParams
from strop.wire.errors import EngineRequestError, EngineUnavailable

MAX_STICKY_KEYS = 4096  # affinity keys remembered (least recently used forgotten first: a hint, not a contract)


class Router(EngineHealth):
    """Routes requests over ``engines`` and keeps their health states (see the module docstring)."""

    def __init__(
        self,
        engines: list,
        *,
        sync: WeightSync | None = None,
        max_attempts: int | None = None,
        health_interval_s: float = 2.0,
        affinity: bool = False,
        print_events: bool = True,
        drain_timeout_s: float = 600.0,
    ):
        """``sync``: how weights reach the engines (a transport of :mod:`strop.sync`, chosen by
        :func:`strop.sync.choose.choose_sync`); None: the router takes no weight update."""
        if not engines:
            raise ValueError("a router needs at least one engine")
        super().__init__(engines, sync, health_interval_s, print_events)
        self.max_attempts = max_attempts or len(self.engines)
        self.affinity = affinity
        self.outstanding = [0] * len(self.engines)
        self.drain_timeout_s = drain_timeout_s
        self._sticky: OrderedDict[str, int] = OrderedDict()
        self._started = False  # engines' versions checked (before the first request, or by an update)
        self.bytes_sent = 0  # the last update: bytes that reached engines (all of them together)
        self.bytes_full = 0  # what a full sync to the same engines would have moved (0: not measured)
        self.probe_ids: list[int] | None = None  # the weight probe's tokens, scored after each update (None: off)
        self.probe_tolerance: float | None = None

    async def _drain(self) -> None:
        """Hold new requests and wait for those in flight to finish on the weights that sampled their start
        (rollout.partial=finish; with partial=resume they were aborted already). Bounded by the engines'
        request timeout: a request still running then is aborted by the pause that follows."""
        self._open().clear()
        deadline = asyncio.get_running_loop().time() + self.drain_timeout_s
        while sum(self.outstanding) and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)

    # ---- requests ------------------------------------------------------------------------------------
    def _pick(self, exclude: set[int], key: str | None) -> int | None:
        if key is not None and key in self._sticky:
            i = self._sticky[key]
            self._sticky.move_to_end(key)
            if self.state[i] == HEALTHY and i not in exclude:
                return i
        candidates = [i for i in range(len(self.engines)) if self.state[i] == HEALTHY and i not in exclude]
        if not candidates:
            return None
        i = min(candidates, key=lambda j: self.outstanding[j])  # least outstanding; ties: the first
        if key is not None:
            self._sticky[key] = i
            self._sticky.move_to_end(key)
            while len(self._sticky) > MAX_STICKY_KEYS:
                self._sticky.popitem(last=False)
        return i

    async def _start(self) -> None:
        """Before the first request: each engine must report the router's version (servers reused from
        an earlier run hold its weights). One that does not, or cannot say, starts down; the health
        loop loads the current weights into it once there are some."""
        async with self._lock():
            if self._started:
                return
            for i, engine in enumerate(self.engines):
                try:
                    held = await engine.get_weight_version()
                except (EngineUnavailable, EngineRequestError) as exc:
                    self.mark_down(i, f"its weight version could not be read at start: {exc}")
                    continue
                if held != self.weight_version:
                    self.mark_down(
                        i,
                        f"holds weight version {held} at start (an earlier run's weights?), the "
                        f"router's is {self.weight_version}",
                    )
                else:
                    self.held_version[i] = held
            self._started = True

    async def generate(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        request_id: str | None = None,
        affinity: str | None = None,
    ) -> Completion:
        if not self._started:
            await self._start()
        self._ensure_health_loop()
        tried: set[int] = set()
        rid = request_id or uuid.uuid4().hex
        while len(tried) < self.max_attempts:
            await self._open().wait()  # (no request goes out while weights change)
            i = self._pick(tried, affinity if self.affinity else None)
            if i is None:
                break
            tried.add(i)
            self.outstanding[i] += 1
            try:
                return await self.engines[i].generate(prompt_ids, sampling, request_id=f"{rid}-{len(tried)}")
            except EngineUnavailable as exc:
                self.mark_down(i, str(exc))
                self.counts["failover"] += 1
            finally:
                self.outstanding[i] -= 1
        return Completion([], [], "abort", self.weight_version)  # every engine tried failed: ABORTED, not lost

    # ---- weight updates: under the lock, with requests drained; the transport moves the weights --------
    async def update_weights(self, state_dict, version: int | None = None) -> int:
        """Bring the engines to ``state_dict`` as ``version`` through the router's transport (:mod:`strop.sync`).
        Each engine stays healthy only if it then reports ``version``."""
        if self.sync is None:
            raise ValueError("the router has no weight transport: give it one of strop.sync (e.g. DiskSync)")
        async with self._lock():  # no engine is re-admitted while an update runs
            self._updates += 1
            version = self.weight_version + 1 if version is None else version
            try:
                await self._drain()
                receipt = await self.sync.update(state_dict, version)
            finally:
                self._open().set()
            self.bytes_sent, self.bytes_full = receipt.bytes_sent, receipt.bytes_full
            self._started = True  # every engine that took the update reported its version
        if not any(self.healthy):
            raise EngineUnavailable("no engine is healthy after the weight update")
        return version

    async def probe(self, ids: list[int], reference: list[float], tolerance: float) -> float:
        """Score ``ids`` on every healthy engine against the trainer's ``reference`` logprobs (see
        :func:`check_probe`); raises naming the first engine that differs."""
        from strop.wire.probe import check_probe  # (strop.wire: can move to the top)

        healthy = [e for i, e in enumerate(self.engines) if self.state[i] == HEALTHY]
        return await check_probe(healthy, ids, reference, tolerance, self.weight_version)

    # ---- the rest of the Engine interface ------------------------------------------------------------
    async def abort_all(self) -> None:
        await asyncio.gather(
            *(e.abort_all() for i, e in enumerate(self.engines) if self.state[i] == HEALTHY), return_exceptions=True
        )

    async def health(self) -> bool:
        await self.check_health()
        return any(self.healthy)

    async def close(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            try:
                await self._health_task
            except asyncio.CancelledError:
                pass
        for e in self.engines:
            await e.close()
