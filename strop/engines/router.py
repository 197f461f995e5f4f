"""A router over several engines that is itself an Engine.

- **Least outstanding requests**: each request goes to the healthy engine with the fewest
  requests in flight (ties: the first).
- **Failover**: an engine that fails a request (:class:`EngineUnavailable`: refused, reset,
  timed out, 5xx after the client's retries) is marked down and the request is re-issued to
  another healthy engine, up to ``max_attempts`` engines; when every attempt failed the request
  ends with finish_reason "abort" (an ABORTED sample: never trained on, never lost, never hanging).
- **Weight versions**: an engine is healthy only at a version it was shown to hold, the
  router's own: the version it reports (after a load, a broadcast, or a probe), never a count
  the router keeps for it. Every change of an engine's state goes through :meth:`Router._move`
  (down → rejoining → healthy), and weight updates and re-admissions hold one lock, so a
  returning engine is never admitted against an update it missed.
- **Health checks** every ``health_interval_s``: a down engine that answers ``/health`` again
  is re-admitted once it holds the current weight version (the router loads the newest
  weights into it first when it lags; under broadcast or delta sync it rejoins at the next
  update). A healthy engine whose reported version changed behind the router's back (it
  restarted) is taken out and re-admitted the same way.
- **Events** (down, rejoining, re-admitted, failover) are printed as they happen and counted;
  :meth:`Router.take_counts` hands the counts since the last call to the step's metrics.
- **Affinity** (optional): requests with the same ``affinity`` key (the turns of one
  multi-turn sample) stay on one engine while it is healthy.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter, OrderedDict, deque
from pathlib import Path

from strop.wire.errors import EngineReceiptError, EngineRequestError, EngineUnavailable
from strop.engines.http import WeightWriter
from strop.types import Completion, SamplingParams

DOWN, REJOINING, HEALTHY = "down", "rejoining", "healthy"
MAX_STICKY_KEYS = 4096  # affinity keys remembered (least recently used forgotten first: a hint, not a contract)


class Router:
    def __init__(self, engines: list, *, writer: WeightWriter | None = None, max_attempts: int | None = None,
                 health_interval_s: float = 2.0, affinity: bool = False, broadcast=None, delta: bool = False,
                 print_events: bool = True, drain_timeout_s: float = 600.0):
        """``writer``: weights go through disk; ``delta``: only the tensors an engine does not hold yet,
        each checked by its digest; ``broadcast`` (a :class:`strop.engines.sync.BroadcastSync`): they
        are broadcast over a process group with the engines instead."""
        if not engines:
            raise ValueError("a router needs at least one engine")
        self.engines = list(engines)
        self.writer = writer
        self.max_attempts = max_attempts or len(self.engines)
        self.health_interval_s, self.affinity = health_interval_s, affinity
        self.state = [HEALTHY] * len(self.engines)  # changed only by _move
        self.held_version = [0] * len(self.engines)  # the version each engine last reported holding
        self.outstanding = [0] * len(self.engines)
        self.weight_version = 0
        self.latest: tuple[Path, str, int] | None = None  # the current weights on disk: folder, checksum, version
        self.events: deque[str] = deque(maxlen=1000)  # down / rejoining / re-admitted, newest last
        self.counts: Counter = Counter()  # every event and failover since the start
        self._taken: Counter = Counter()  # what take_counts() last handed out
        self.print_events = print_events
        self.drain_timeout_s = drain_timeout_s
        self._sticky: OrderedDict[str, int] = OrderedDict()
        self._health_task: asyncio.Task | None = None
        self._locks: dict = {}  # event loop -> the lock of weight updates and re-admissions
        self._updates = 0  # weight updates begun (a version probe that spanned one is not believed)
        self._started = False  # engines' versions checked (before the first request, or by an update)
        self.broadcast = broadcast
        self.bytes_sent = 0  # the last update: bytes that reached engines (all of them together)
        self.bytes_full = 0  # what a full sync to the same engines would have moved
        self.delta = delta
        self.held: list[dict[str, str]] = [{} for _ in self.engines]  # delta: digest of each tensor an engine holds
        self._digests: dict[str, str] = {}  # delta: the digests of the current version

    # ---- engine states: the one place they change -------------------------------------------------
    @property
    def healthy(self) -> list[bool]:
        return [s == HEALTHY for s in self.state]

    @property
    def rejoining(self) -> set[int]:
        return {i for i, s in enumerate(self.state) if s == REJOINING}

    @property
    def failovers(self) -> int:
        return self.counts["failover"]

    def _move(self, i: int, to: str, why: str, version: int | None = None) -> None:
        """Move engine ``i`` to ``to``. Healthy only with ``version``, the version it reported holding,
        equal to the router's; otherwise it goes down instead."""
        if to == HEALTHY:
            if version != self.weight_version:
                to, why = DOWN, f"reports weight version {version}, the router's is {self.weight_version}"
            else:
                self.held_version[i] = version
        if self.state[i] != to:
            before, self.state[i] = self.state[i], to
            if to == HEALTHY:
                self._event("re-admitted", f"re-admitted {self.engines[i]!r} at weight version {version} ({why}; "
                            f"was {before})")
            else:
                self._event("down" if to == DOWN else "rejoining", f"{to} {self.engines[i]!r}: {why}")

    def _mark_down(self, i: int, why: str) -> None:
        self._move(i, DOWN, why)

    def _event(self, kind: str, text: str) -> None:
        self.events.append(text)
        self.counts[kind] += 1
        if self.print_events:
            print(f"strop: router: {text}", flush=True)

    def take_counts(self) -> dict[str, int]:
        """Failovers and engine events since the last call, and how many engines are healthy now."""
        new = self.counts - self._taken
        self._taken = Counter(self.counts)
        return {"engine_failovers": new["failover"], "engine_down": new["down"],
                "engine_readmitted": new["re-admitted"], "engines_healthy": sum(self.healthy)}

    def _lock(self) -> asyncio.Lock:
        """Weight updates and re-admissions run one at a time (a lock per event loop)."""
        return self._loop_state()[0]

    def _open(self) -> asyncio.Event:
        """Set while requests may go out; cleared while a weight update drains and runs."""
        return self._loop_state()[1]

    def _loop_state(self) -> tuple[asyncio.Lock, asyncio.Event]:
        loop = asyncio.get_running_loop()
        if loop not in self._locks:
            self._locks = {loop: (asyncio.Lock(), asyncio.Event())}
            self._locks[loop][1].set()
        return self._locks[loop]

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
                    self._mark_down(i, f"its weight version could not be read at start: {exc}")
                    continue
                if held != self.weight_version:
                    self._mark_down(i, f"holds weight version {held} at start (an earlier run's weights?), the "
                                    f"router's is {self.weight_version}")
                else:
                    self.held_version[i] = held
            self._started = True

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams, request_id: str | None = None,
                       affinity: str | None = None) -> Completion:
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
                self._mark_down(i, str(exc))
                self.counts["failover"] += 1
            finally:
                self.outstanding[i] -= 1
        return Completion([], [], "abort", self.weight_version)  # every engine tried failed: ABORTED, not lost

    # ---- weight updates ------------------------------------------------------------------------------
    async def update_weights(self, state_dict, version: int | None = None) -> int:
        """Write the weights once, load them into every healthy engine (a failure marks it down);
        or broadcast them to every healthy engine and every engine waiting to rejoin. Each engine
        stays healthy only if it then reports ``version``."""
        if self.broadcast is None and self.writer is None:
            raise ValueError("the router syncs weights through disk: give it a WeightWriter")
        async with self._lock():  # no engine is re-admitted while an update runs
            self._updates += 1
            version = self.weight_version + 1 if version is None else version
            try:
                await self._drain()
                if self.broadcast is not None:
                    await self._update_by_broadcast(state_dict, version)
                elif self.delta:
                    await self._update_by_delta(state_dict, version)
                else:
                    await self._update_by_disk(state_dict, version)
            finally:
                self._open().set()
            self._started = True  # every engine that took the update reported its version
        if not any(self.healthy):
            raise EngineUnavailable("no engine is healthy after the weight update")
        return version

    async def _update_by_disk(self, state_dict, version: int) -> None:
        path, checksum = await asyncio.to_thread(self.writer.write, state_dict, version)  # off the event loop
        self.latest, self.weight_version = (path, checksum, version), version  # together: no await between
        await asyncio.gather(*(self._load(i) for i in range(len(self.engines)) if self.state[i] == HEALTHY))

    async def _load(self, i: int) -> None:
        """Load the current weights into engine ``i``; healthy afterwards only at the version it reports."""
        path, checksum, version = self.latest
        before = self.state[i]
        try:
            held = await self.engines[i].load_weights(path, version, checksum)
        except (EngineUnavailable, EngineRequestError) as exc:
            self._mark_down(i, f"weight load of version {version} failed: {exc}")
            return
        if self.state[i] == before:  # (a request that failed on it meanwhile leaves it to the health loop)
            self._move(i, HEALTHY, "loaded the current weights", held)

    async def _update_by_broadcast(self, state_dict, version: int) -> None:
        """Broadcast to every healthy engine and every engine waiting to rejoin, in one pass: one that fails
        leaves the update (down if it no longer answers, else rejoining: it serves again only after a whole
        update), the others complete it. A receipt that disagrees with what was sent fails the step."""
        members = [i for i in range(len(self.engines)) if self.state[i] in (HEALTHY, REJOINING)]
        if not members:
            raise EngineUnavailable("no engine is healthy to receive the weights")
        self.bytes_sent, results = await self.broadcast.update([self.engines[i] for i in members], state_dict, version)
        self.weight_version = version
        wrong = None
        for i, result in zip(members, results):
            if not isinstance(result, BaseException):  # healthy only at the version its receipt shows
                self._move(i, HEALTHY, "received the broadcast", result)
            elif not await self.engines[i].health():
                self._mark_down(i, f"weight broadcast of version {version} failed: {result}")
            else:
                self._move(i, REJOINING, f"weight broadcast of version {version} failed: {result}")
                if isinstance(result, EngineReceiptError):
                    wrong = wrong or result
        if wrong is not None:  # an engine that took the bytes but holds something else: never silently served
            raise wrong

    async def _update_by_delta(self, state_dict, version: int) -> None:
        from strop.wire.digest import tensor_digest
        from strop.wire.buckets import manifest_of
        from strop.wire.weights import Subset, in_buckets, nbytes

        unique = [name for name, _, _ in manifest_of(state_dict)]

        def digest_all():  # a bucket at a time (sharded weights: gathered as read, never whole)
            return {n: tensor_digest(t) for part in in_buckets(state_dict, unique) for n, t in part.items()}
        digests = await asyncio.to_thread(digest_all)
        sizes = {name: nbytes(state_dict, name) for name in unique}
        members = [i for i in range(len(self.engines)) if self.state[i] in (HEALTHY, REJOINING)]
        for i in members:  # an engine restarted since its last load holds its initial tensors: it gets them all
            try:
                if await self.engines[i].get_weight_version() != self.held_version[i]:
                    self.held[i] = {}
            except (EngineUnavailable, EngineRequestError):
                self.held[i] = {}
        by_change: dict[frozenset, list[int]] = {}
        for i in members:  # engines holding the same tensors get the same file
            changed = frozenset(n for n, d in digests.items() if self.held[i].get(n) != d)
            by_change.setdefault(changed, []).append(i)
        self.bytes_sent, self.bytes_full = 0, len(members) * sum(sizes.values())
        self.weight_version, self._digests = version, digests
        for k, (changed, engines) in enumerate(by_change.items()):
            path, _ = await asyncio.to_thread(self.writer.write, Subset(state_dict, sorted(changed)), version,
                                              f"-delta{k}")
            sent = {n: digests[n] for n in changed}

            async def load(i):
                try:
                    held = await self.engines[i].load_weights(path, version, digests=sent)
                except (EngineUnavailable, EngineRequestError) as exc:
                    self._mark_down(i, f"delta weight load of version {version} failed: {exc}")
                    self.held[i] = {}
                    return
                self.held[i] = dict(digests)
                self.bytes_sent += sum(sizes[n] for n in changed)
                if self.state[i] != DOWN:  # (a request that failed on it meanwhile leaves it to the health loop)
                    self._move(i, HEALTHY, "loaded the changed tensors", held)
            await asyncio.gather(*(load(i) for i in engines))

    async def probe(self, ids: list[int], reference: list[float], tolerance: float) -> float:
        """Score ``ids`` on every healthy engine against the trainer's ``reference`` logprobs (see
        :mod:`strop.serving.probe`); raises naming the first engine that differs."""
        from strop.serving.probe import check_probe

        healthy = [e for i, e in enumerate(self.engines) if self.state[i] == HEALTHY]
        return await check_probe(healthy, ids, reference, tolerance, self.weight_version)

    # ---- health and re-admission ---------------------------------------------------------------------
    async def abort_all(self) -> None:
        await asyncio.gather(*(e.abort_all() for i, e in enumerate(self.engines) if self.state[i] == HEALTHY),
                             return_exceptions=True)

    async def health(self) -> bool:
        await self.check_health()
        return any(self.healthy)

    async def check_health(self) -> None:
        """Probe every engine that is down; re-admit one that answers and holds (or now loads) the
        current weights. Probe the healthy ones' versions: one that changed (a restart) or cannot be
        read goes down, and comes back only through re-admission."""
        for i in range(len(self.engines)):
            try:
                await self._check_one(i)
            except Exception as exc:  # one engine's broken answer never stops the others' checks
                self._note(i, f"health check failed: {type(exc).__name__}: {exc}")

    async def _check_one(self, i: int) -> None:
        engine = self.engines[i]
        if self.state[i] == DOWN:
            if await engine.health():
                async with self._lock():  # never while an update runs: it would miss that update
                    if self.state[i] == DOWN:
                        await self._readmit(i)
            return
        if self.state[i] != HEALTHY or self._lock().locked():
            return
        updates = self._updates
        try:
            held = await engine.get_weight_version()
        except (EngineUnavailable, EngineRequestError) as exc:  # gone, or an answer strop cannot read
            if updates == self._updates and self.state[i] == HEALTHY:
                self._mark_down(i, f"weight version probe: {exc}")
            return
        if held != self.held_version[i] and updates == self._updates and not self._lock().locked():
            self._mark_down(i, f"now reports weight version {held}, held {self.held_version[i]} (restarted?)")

    async def _readmit(self, i: int) -> None:
        engine = self.engines[i]
        try:
            held = await engine.get_weight_version()
        except (EngineUnavailable, EngineRequestError) as exc:
            self._note(i, f"answers /health but its weight version cannot be read: {exc}")
            return
        if held == self.weight_version and (not self.delta or self.held[i] == self._digests):
            self._move(i, HEALTHY, "reports the current weights", held)
        elif self.broadcast is not None or self.delta:  # it gets the weights (and is re-admitted) at the next update
            self.held[i] = {}  # a restarted engine holds its initial weights: everything is sent
            if self.broadcast is not None:  # a group joined before it went down is gone with its old process
                await self.broadcast.drop(engine)
            self._move(i, REJOINING, f"holds weight version {held}; gets version {self.weight_version} at the "
                       "next update")
        elif self.latest is None:
            self._note(i, f"holds weight version {held}, the router's is {self.weight_version}, and no weights "
                       "were written to load")
        else:
            await self._load(i)

    def _note(self, i: int, why: str) -> None:
        """Why a down engine stays down (recorded once per reason, not at every probe)."""
        text = f"still down {self.engines[i]!r}: {why}"
        if not self.events or self.events[-1] != text:
            self._event("still-down", text)

    def _ensure_health_loop(self) -> None:
        if self._health_task is None or self._health_task.done():
            self._health_task = asyncio.ensure_future(self._health_loop())

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            await self.check_health()  # (never raises: each engine's failure is caught and noted)

    async def close(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            try:
                await self._health_task
            except asyncio.CancelledError:
                pass
        for e in self.engines:
            await e.close()
