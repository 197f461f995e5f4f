"""The engine-sync role: after each train step, the engine gets the new weights, and a probe checks it computes
with them."""

from __future__ import annotations

import functools
import time

from strop.engines.base import Metered, Probed, Stoppable
from strop.roles.placement import RANK0
from strop.roles.rank0 import Rank0
from strop.roles.rollout import Rollout
from strop.serving.probe import reference_logprobs


class EngineSync:
    """Rank 0 sends the step's weights to the engine (none in a train-only run) and says how long it took."""

    placement = RANK0

    def __init__(self, desk: Rank0, rollout: Rollout):
        self.desk, self.rollout = desk, rollout

    def update(self, step: int, weights: dict, metrics: dict) -> None:
        """The engine gets weight version ``step``; its time (and the probe's verdict, the bytes of a delta
        update) go into ``metrics``."""
        c, loop = self.desk.c, self.desk.loop
        t = time.perf_counter()
        stopped = c.engine.stopped_seconds if isinstance(c.engine, Stoppable) else None  # time it could not decode
        if c.engine is not None:  # (train only has none)
            # (partial=resume: what is generating is aborted around the update and continues after it)
            self.rollout.update_weights(functools.partial(c.weight_update(), weights, version=step), step)
            if isinstance(c.engine, Probed) and c.engine.probe_ids:  # every engine computes with the trainer's weights
                ids = c.engine.probe_ids
                reference = reference_logprobs(c.trainer.model, ids)
                metrics["weight_probe_max_diff"] = loop.run(c.engine.probe(ids, reference, c.engine.probe_tolerance))
        metrics["weight_sync_seconds"] = time.perf_counter() - t
        if stopped is not None:  # what the update cost generation: a pause, or the copy with no row decoding
            metrics["weight_sync_pause_seconds"] = c.engine.stopped_seconds - stopped
        if isinstance(c.engine, Metered) and c.engine.bytes_full:  # the delta form: what moved against a full sync
            metrics["weight_sync_bytes"] = c.engine.bytes_sent
            metrics["weight_sync_fraction"] = c.engine.bytes_sent / c.engine.bytes_full
