"""The router over real `strop serve` processes: an engine killed mid-rollout, re-admission, all down."""

import asyncio

import pytest

from strop.engines.router import Router
from strop.engines.sglang import SGLangEngine
from strop.process import free_port
from strop.sync.disk import DiskSync, WeightWriter
from strop.types import SamplingParams

pytestmark = pytest.mark.timeout(300)


def _client(url, writer):
    return SGLangEngine(url, timeout_s=60, retries=1, backoff_s=0.1, writer=writer)


def test_an_engine_killed_mid_rollout_loses_nothing_and_is_readmitted(start_server, tmp_path):
    from tests.tiny import make_tiny_model

    # small batches: 64 long requests keep both servers busy for several seconds
    a, b = start_server(None, "--max-batch-size=4"), start_server(None, "--max-batch-size=4")
    writer = WeightWriter(tmp_path / "weights")
    router = Router([_client(a.url, writer), _client(b.url, writer)], sync=DiskSync(writer), health_interval_s=0.3)
    port_b = b.port

    async def main():
        sp = SamplingParams(temperature=1.0, max_new_tokens=120, stop_token_ids=[-1])
        tasks = [asyncio.ensure_future(router.generate([3 + i, 9, 11], sp)) for i in range(64)]
        await asyncio.sleep(1.0)
        b.kill()  # SIGKILL while requests are in flight on it
        outs = await asyncio.wait_for(asyncio.gather(*tasks), 240)
        down_after_kill = list(router.healthy)
        # a new weight version while b is down: only a loads it
        await router.update_weights(make_tiny_model(seed=3).state_dict(), version=1)
        start_server(port_b, "--max-batch-size=4")  # b comes back (version 0) on the same port
        for _ in range(100):
            await asyncio.sleep(0.2)  # the health loop loads version 1 into it, then re-admits it
            if all(router.healthy):
                break
        b_version = await router.engines[1].get_weight_version()
        late = await router.generate([5, 6, 7], SamplingParams(max_new_tokens=3, stop_token_ids=[-1]))
        await router.close()
        return outs, down_after_kill, b_version, late

    outs, down_after_kill, b_version, late = asyncio.run(main())
    assert len(outs) == 64  # every request answered: none lost, none hanging
    assert all(o.finish_reason in ("stop", "length", "abort") for o in outs)
    assert router.failovers > 0, "the kill happened after every request finished: the test did not test failover"
    assert sum(o.finish_reason == "abort" for o in outs) == 0  # a was alive: every re-issued request completed
    assert down_after_kill == [True, False]
    assert b_version == 1 and all(router.healthy) and late.weight_version == 1
    assert any(e.startswith("re-admitted") for e in router.events)


def test_with_every_engine_down_a_request_aborts_instead_of_hanging():
    dead = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    router = Router([SGLangEngine(u, retries=1, backoff_s=0.05, timeout_s=5) for u in dead])

    async def main():
        out = await asyncio.wait_for(router.generate([1, 2, 3], SamplingParams(max_new_tokens=4)), 30)
        await router.close()
        return out

    out = asyncio.run(main())
    assert out.finish_reason == "abort" and out.token_ids == []
    assert router.healthy == [False, False] and len(router.events) == 2


def test_affinity_keeps_one_samples_turns_on_one_engine(start_server):
    a, b = start_server(), start_server()
    router = Router([SGLangEngine(a.url), SGLangEngine(b.url)], affinity=True)

    async def main():
        sp = SamplingParams(max_new_tokens=2)
        picks = []
        for turn in range(4):
            await router.generate([4, 5, turn + 6], sp, affinity="sample-7")
            picks.append(router._sticky["sample-7"])
        await router.close()
        return picks

    picks = asyncio.run(main())
    assert len(set(picks)) == 1
