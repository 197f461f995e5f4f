"""The health state machine of a router's engines: down → rejoining → healthy.

An engine is healthy only at a version it was shown to hold, the router's own: the version it reports
(after a load, a broadcast, or a probe), never a count kept for it. Every change of an engine's state goes
through :meth:`EngineHealth.move`, and weight updates and re-admissions hold one lock, so a returning engine
is never admitted against an update it missed. Health checks every ``health_interval_s``: a down engine that
answers ``/health`` again is re-admitted once it holds the current weight version (its transport loads the
newest weights into it first when it lags; under broadcast or delta sync it rejoins at the next update). A
healthy engine whose reported version changed behind the router's back (it restarted) is taken out and
re-admitted the same way. Events (down, rejoining, re-admitted, failover) are printed as they happen and
counted; :meth:`EngineHealth.take_counts` hands the counts since the last call to the step's metrics.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter, deque

from strop.observe.logs import console
from strop.sync.base import WeightSync
from strop.wire.errors import EngineRequestError, EngineUnavailable

log = logging.getLogger(__name__)

DOWN, REJOINING, HEALTHY = "down", "rejoining", "healthy"


class EngineHealth:
    """The states of ``engines`` and what moves them: health checks, re-admission, and the transport ``sync``
    (:mod:`strop.sync`) each update goes through."""

    def __init__(self, engines: list, sync: WeightSync | None, health_interval_s: float, print_events: bool):
        self.engines = list(engines)
        self.health_interval_s = health_interval_s
        self.state = [HEALTHY] * len(self.engines)  # changed only by move
        self.held_version = [0] * len(self.engines)  # the version each engine last reported holding
        self.weight_version = 0
        self.events: deque[str] = deque(maxlen=1000)  # down / rejoining / re-admitted, newest last
        self.counts: Counter = Counter()  # every event and failover since the start
        self._taken: Counter = Counter()  # what take_counts() last handed out
        self.print_events = print_events
        self._health_task: asyncio.Task | None = None
        self._locks: dict = {}  # event loop -> the lock of weight updates and re-admissions
        self._updates = 0  # weight updates begun (a version probe that spanned one is not believed)
        self.sync = sync
        if sync is not None:
            sync.connect(self)

    # ---- the one place states change ------------------------------------------------------------------
    @property
    def healthy(self) -> list[bool]:
        return [s == HEALTHY for s in self.state]

    @property
    def rejoining(self) -> set[int]:
        return {i for i, s in enumerate(self.state) if s == REJOINING}

    @property
    def failovers(self) -> int:
        return self.counts["failover"]

    def members(self, *states: str) -> list[int]:
        """The engines in one of ``states`` now (who takes an update)."""
        return [i for i in range(len(self.engines)) if self.state[i] in states]

    def move(self, i: int, to: str, why: str, version: int | None = None) -> None:
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
                self._event(
                    "re-admitted", f"re-admitted {self.engines[i]!r} at weight version {version} ({why}; was {before})"
                )
            else:
                self._event("down" if to == DOWN else "rejoining", f"{to} {self.engines[i]!r}: {why}")

    def mark_down(self, i: int, why: str) -> None:
        self.move(i, DOWN, why)

    def _event(self, kind: str, text: str) -> None:
        self.events.append(text)
        self.counts[kind] += 1
        if self.print_events:
            console()  # shown even where nothing set up strop's logging (a router used on its own)
            log.info(f"strop: router: {text}")

    def take_counts(self) -> dict[str, int]:
        """Failovers and engine events since the last call, and how many engines are healthy now."""
        new = self.counts - self._taken
        self._taken = Counter(self.counts)
        return {
            "engine_failovers": new["failover"],
            "engine_down": new["down"],
            "engine_readmitted": new["re-admitted"],
            "engines_healthy": sum(self.healthy),
        }

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

    # ---- health checks and re-admission -------------------------------------------------------------
    async def check_health(self) -> None:
        """Probe every engine that is down; re-admit one that answers and holds (or now loads) the
        current weights. Probe the healthy ones' versions: one that changed (a restart) or cannot be
        read goes down, and comes back only through re-admission."""
        for i in range(len(self.engines)):
            try:
                await self._check_one(i)
            except Exception as exc:  # one engine's broken answer never stops the others' checks
                self.note(i, f"health check failed: {type(exc).__name__}: {exc}")

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
                self.mark_down(i, f"weight version probe: {exc}")
            return
        if held != self.held_version[i] and updates == self._updates and not self._lock().locked():
            self.mark_down(i, f"now reports weight version {held}, held {self.held_version[i]} (restarted?)")

    async def _readmit(self, i: int) -> None:
        engine = self.engines[i]
        try:
            held = await engine.get_weight_version()
        except (EngineUnavailable, EngineRequestError) as exc:
            self.note(i, f"answers /health but its weight version cannot be read: {exc}")
            return
        if held == self.weight_version and (self.sync is None or self.sync.holds_current(i)):
            self.move(i, HEALTHY, "reports the current weights", held)
        elif self.sync is not None and self.sync.rejoins:  # it gets the weights (and is re-admitted) at the next update
            await self.sync.forget(i)
            self.move(
                i, REJOINING, f"holds weight version {held}; gets version {self.weight_version} at the next update"
            )
        elif self.sync is None or not await self.sync.catch_up(i):
            self.note(
                i,
                f"holds weight version {held}, the router's is {self.weight_version}, and no weights "
                "were written to load",
            )

    def note(self, i: int, why: str) -> None:
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
