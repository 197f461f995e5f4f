"""Weight sync to an engine in this process (the embedded engine): the trainer's tensors are copied into
the engine's model between its batches, device to device where both share one. Nothing is written or
sent; the receipt is the version the engine then holds."""

from __future__ import annotations

from strop.sync.base import Receipt, WeightSync


class InProcessSync(WeightSync):
    """``connect(engine)``: the engine of this process; ``update`` is its own ``update_weights``."""

    async def update(self, weights, version: int) -> Receipt:
        return Receipt(await self.pool.update_weights(weights, version=version))
