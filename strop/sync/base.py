"""The one interface of a weight transport (as slime's ``update_weight/``): ``connect`` the engines,
``update(weights, version) -> Receipt``, ``close``.

A transport serves a router (:class:`strop.engines.router.Router`): the router holds the engines, their
health states and the lock and drain around an update; the transport moves the weights to the engines
that take them, checks each engine's receipt and moves that engine's state by it (healthy at the version
it reports, down, or rejoining). An engine that answers again after missing updates catches up through
its transport: now (:meth:`WeightSync.catch_up`), or at the next update (``rejoins``)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass


@dataclass
class Receipt:
    """What one update did: the version sent, the bytes that reached engines (all of them together), and
    what a full sync of the same engines would have moved (0: not measured)."""

    version: int
    bytes_sent: int = 0
    bytes_full: int = 0


class WeightSync(ABC):
    """One way weights reach a router's engines."""

    pool = None  # the router it serves (connect)

    def connect(self, pool) -> None:
        """Serve ``pool``, a router: its engines, and the health states each engine's result moves."""
        self.pool = pool

    @abstractmethod
    async def update(self, weights, version: int) -> Receipt:
        """Bring the engines that take updates to ``weights`` as ``version`` (under the router's update lock,
        with requests drained); each stays healthy only at the version it then reports."""

    def holds_current(self, i: int) -> bool:
        """Whether engine ``i``, which reports the current version, holds every tensor of it."""
        return True

    rejoins = False  # an engine that lags waits for the next update (which sends it everything) to serve again

    async def forget(self, i: int) -> None:
        """Engine ``i`` restarted (it answers again lagging): what it held, and any link to it, is gone."""

    async def overwritten(self, i: int) -> None:
        """Engine ``i``'s weights were overwritten outside this transport (engine.verify_updates' noise): it
        holds nothing this transport sent it, and the next update must send it every tensor."""

    async def catch_up(self, i: int) -> bool:
        """Load the current weights into engine ``i``, which lags, now. False: there are none to load yet."""
        return False

    async def close(self) -> None:
        """Release what the transport holds with the engines (process groups)."""
