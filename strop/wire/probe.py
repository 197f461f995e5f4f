"""The trainer's side of the weight probe: a fixed short token sequence scored by each engine after a weight
update, compared with the trainer's own logprobs of it (the engine side, and the reference computed on the
trainer's model, are :mod:`strop.serving.probe`'s). Checksums prove bytes arrived where an engine computes
one strop can reproduce; the probe proves the engine *computes* with the trainer's weights, whatever it is."""

from __future__ import annotations

import asyncio

from strop.wire.errors import EngineReceiptError


async def check_probe(engines: list, ids: list[int], reference: list[float], tolerance: float, version: int) -> float:
    """Score ``ids`` on every engine; raise naming the first whose logprobs differ from ``reference`` by
    more than ``tolerance``. Returns the largest difference seen."""
    scored = await asyncio.gather(*(e.score(ids) for e in engines))
    worst = 0.0
    for engine, got in zip(engines, scored):
        diff = max((abs(a - b) for a, b in zip(got, reference)), default=0.0)
        if diff > tolerance:
            raise EngineReceiptError(
                f"{engine!r} at weight version {version}: its logprobs of the probe differ from the trainer's by "
                f"{diff:.2e} > engine.sync_probe_tolerance={tolerance} (a stale or partly updated engine? a "
                "bfloat16 engine of an fp32 trainer needs a larger tolerance, e.g. 0.05)"
            )
        worst = max(worst, diff)
    return worst
