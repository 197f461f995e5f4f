"""Reward plugins that kill one of a Ray run's actors from inside the run (rank 0 computes rewards), at a
known point: the actors are named in the run's namespace (strop.cluster.ray_cluster)."""

import json
import os
import signal
import time

from tests.plugins import even_token_reward

_state = {"killed": False}


def _kill(name: str) -> dict:
    import ray

    before = ray.get(ray.get_actor(name).where.remote())
    os.kill(before["pid"], signal.SIGKILL)
    return before


async def kill_engine_0_in_step_2(ctx, sample, sampling):
    """A generate hook: strop's own generate, but at step 2's first call, once its request is out, engine 0's
    actor is SIGKILLed (its requests in flight fail over); then wait until Ray has restarted it (another pid,
    serving again) and the router has seen it, and write the old and new pids to ./engine_kill.json."""
    import asyncio

    import ray

    from strop.rollout.generate import generate

    if ctx.step != 2 or _state["killed"]:
        return await generate(ctx, sample, sampling)
    _state["killed"] = True
    own = asyncio.ensure_future(generate(ctx, sample, sampling))
    await asyncio.sleep(0.05)  # this step's requests wait on both engines (their batches start after 200 ms)
    before, deadline = await asyncio.to_thread(_kill, "engine0"), time.monotonic() + 120
    result = await own
    while time.monotonic() < deadline:
        try:
            after = await asyncio.to_thread(ray.get, ray.get_actor("engine0").where.remote(), timeout=10)
            if after["pid"] != before["pid"]:
                break
        except Exception:  # restarting
            await asyncio.sleep(0.5)
    else:
        raise TimeoutError("engine 0 was not restarted within 120 s")
    # the step's weight update comes once this rollout returns: wait (at most 30 s) until the router's health loop
    # has seen the restarted engine, so that update takes it in and it is back for step 3 (else which of the two
    # comes first is a race between the health interval and the step's speed)
    deadline = time.monotonic() + 30
    while ctx.engine.state[0] == "down" and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    with open("engine_kill.json", "w") as f:
        json.dump({"before": before, "after": after}, f)
    return result


def kill_rank_1_at_step_3(sample) -> float:
    """At step 3's first reward (trained weights of step 2 sampled it): SIGKILL rank 1's actor once
    (./rank_kill.json marks it done, so a resumed run is not killed again)."""
    if (
        sample.group_id >= 0
        and sample.weight_versions
        and sample.weight_versions[0] == 2  # (not step 2's eval)
        and not os.path.exists("rank_kill.json")
    ):
        with open("rank_kill.json", "w") as f:
            json.dump(_kill("rank1"), f)
        time.sleep(2)  # rank 0 then meets the dead rank in its next collective
    return even_token_reward(sample)
