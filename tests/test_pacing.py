"""Pacing in async mode (``rollout.stale_groups='wait'``): steps take groups earliest deadline first and
wait for the ones due, so nothing is dropped for staleness; the four diagnostics (trainer starved,
generation blocked, queue against its bound, staleness) and the straggler warning. Scripted engine,
every wait with a timeout."""

import asyncio
import logging

import pytest

from strop.rollout.schedulers import staleness
from tests.test_rollout_manager import ScriptedEngine, StaleEngine, _drive, _manager


class StragglerEngine(ScriptedEngine):
    """Requests for prompts ``3 + i % 5 == 3`` (about one group in five) decode ``slow`` times slower:
    groups started before faster ones finish after them."""

    def __init__(self, slow=15, **kw):
        super().__init__(**kw)
        self.base, self.slow = self.delay, slow

    async def generate(self, prompt_ids, sampling):
        self.delay = self.base * (self.slow if prompt_ids[-1] == 3 else 1)
        return await super().generate(prompt_ids, sampling)


def _run(stale_groups, partial="finish", max_staleness=1, seed=0, train_seconds=0.02, **engine):
    engine = StragglerEngine(delay=0.002, seed=seed, **engine)
    manager, _ = _manager(engine, mode="async", max_staleness=max_staleness, stale_groups=stale_groups, partial=partial)
    seen, accounts = asyncio.run(_drive(manager, engine, steps=6, train_seconds=train_seconds))
    return manager, seen, accounts


@pytest.mark.timeout(120)
@pytest.mark.parametrize("partial", ["finish", "resume"])
@pytest.mark.parametrize("max_staleness", [1, 2])
def test_waiting_for_due_groups_drops_none_where_finishing_order_drops_some(partial, max_staleness):
    """The same stragglers, the same seeds: taken in finishing order they turn stale and are dropped;
    paced, none is, every step is full, and no token is staler than the bound."""
    dropped = {"drop": 0, "wait": 0}
    for seed in range(3):
        for mode in ("drop", "wait"):
            manager, seen, accounts = _run(mode, partial, max_staleness, seed)
            dropped[mode] += manager.dropped["stale"]
            assert accounts["trained"] == 6 * 4 * 4
            for step, groups, metrics in seen:
                assert len(groups) == 4 and metrics["staleness_max"] <= max_staleness
                assert all(0 <= st <= max_staleness for g in groups for s in g for st in staleness(s, step))
    assert dropped["wait"] == 0
    assert dropped["drop"] > 0  # (the scenario does make groups stale: the check can fail)


@pytest.mark.timeout(60)
def test_the_four_diagnostics_say_which_side_waits():
    """Generation fast and training slow: generation is blocked by the bound, the trainer barely waits,
    the queue is full. Generation slow and training fast: the reverse. Every step reports all of them,
    with the queue never above its bound."""
    keys = {
        "rollout_wait_seconds",
        "rollout_backpressure_seconds",
        "rollout_queue_groups",
        "rollout_inflight_groups",
        "rollout_max_inflight",
        "staleness_mean",
        "staleness_max",
    }

    def sums(delay, train_seconds):
        engine = ScriptedEngine(delay=delay)
        manager, _ = _manager(engine, mode="async", max_staleness=1)
        seen, _ = asyncio.run(_drive(manager, engine, steps=6, train_seconds=train_seconds))
        for _, _, m in seen:
            assert keys <= set(m)
            assert m["rollout_queue_groups"] + m["rollout_inflight_groups"] <= m["rollout_max_inflight"]
        later = [m for _, _, m in seen[1:]]  # (step 1 waits for the first groups in every case)
        return sum(m["rollout_wait_seconds"] for m in later), sum(m["rollout_backpressure_seconds"] for m in later)

    wait, blocked = sums(delay=0.0002, train_seconds=0.2)  # generation outruns training
    assert blocked > 0.5 and wait < blocked / 4, (wait, blocked)
    wait, blocked = sums(delay=0.02, train_seconds=0.001)  # training outruns generation
    assert wait > 0.5 and blocked < wait / 4, (wait, blocked)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("bound,warned", [(0.05, True), (30.0, False)])
def test_a_step_waiting_on_a_straggler_past_the_bound_says_so(caplog, bound, warned):
    engine = StragglerEngine(delay=0.002, slow=200)  # a straggler group takes up to ~5 s
    manager, _ = _manager(engine, mode="async", max_staleness=1, straggler_warning_seconds=bound)

    with caplog.at_level(logging.WARNING, logger="strop.rollout.schedulers"):
        seen, _ = asyncio.run(_drive(manager, engine, steps=4))
    lines = [r.getMessage() for r in caplog.records if "still generating" in r.getMessage()]
    assert bool(lines) == warned, lines
    if warned:
        assert "that it is the last step able to train" in lines[0] and "straggler_warning_seconds=0.05" in lines[0]
        assert max(m["rollout_straggler_wait_seconds"] for _, _, m in seen) > bound
    assert manager.dropped["stale"] == 0


@pytest.mark.timeout(60)
def test_paced_async_still_stops_on_an_engine_that_serves_old_weights():
    """Waiting never hides an engine that did not take the new weights: its groups come back stale
    whatever the order, and the step stops naming the versions."""
    engine = StaleEngine()
    manager, _ = _manager(engine, mode="async", max_staleness=1)

    async def main():
        for step in range(1, 7):
            await asyncio.wait_for(manager.batch(step), timeout=30)
            await manager.update_weights(lambda: engine.update_weights(None, version=step), step)

    try:
        with pytest.raises(RuntimeError, match=r"dropped as stale \(tokens of weight versions \[0\]"):
            asyncio.run(main())
    finally:
        asyncio.run(asyncio.wait_for(manager.close(), 20)) if manager.tasks else None
