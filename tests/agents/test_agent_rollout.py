"""Agent programs (plugins.agent) in real runs on a tiny model: sessions become samples of their group."""

import asyncio
import json
import threading
import time

import pytest

from strop.config import ConfigError, build_config
from strop.loop import rollout_only, train
from tests.test_e2e import tiny_overrides

pytestmark = pytest.mark.timeout(240)


def agent_overrides(model_dir, run_dir, program, **extra):
    cfg = tiny_overrides(model_dir, run_dir, **extra)
    cfg["plugins"] = {"agent": f"tests.agents.agents:{program}"}
    cfg["rollout"] = {**cfg["rollout"], "max_new_tokens": 48}
    cfg["agent"] = {"concurrency": 8, **cfg.get("agent", {})}
    return cfg


def read_samples(path):
    return [json.loads(line) for line in open(path).read().splitlines()[1:]]


def metrics_of(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_an_agent_trains_through_the_proxy(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    summary = train(
        build_config(
            overrides=agent_overrides(tiny_model_dir, run_dir, "two_calls", train={"steps": 2}, eval={"every": 1})
        )
    )
    assert summary["steps"] == 2
    steps = [r for r in metrics_of(run_dir) if "reward_mean" in r]
    for r in steps:
        assert r["samples_trained"] == 8 and r["agent_sessions_ended"] == 8
        assert r["agent_calls_per_session"] == 2 and r["agent_forks"] == 0
        assert r["agent_sessions/completed"] == 8
        assert r["train_rollout_logprob_abs_diff"] < 1e-3  # the recorded logprobs are the trainer's
        assert 0 <= r["reward_mean"] <= 1
    assert all(
        "eval_accuracy" in r for r in metrics_of(run_dir) if r.get("step") in (0, 1, 2) and "eval_reward_mean" in r
    )


def test_forked_sessions_join_their_group_sharing_the_reward(tiny_model_dir, tmp_path):
    cfg = build_config(overrides=agent_overrides(tiny_model_dir, tmp_path / "run", "compacts", train={"steps": 1}))
    samples = read_samples(rollout_only(cfg))
    assert len(samples) == 2 * 4 * 2  # 2 prompts x 4 sessions x 2 segments
    by_session = {}
    for s in samples:
        by_session.setdefault(s["metadata"]["agent_session"], []).append(s)
    assert len(by_session) == 8
    for segs in by_session.values():
        assert sorted(s["metadata"]["segment"] for s in segs) == [0, 1]
        assert len({s["group_id"] for s in segs}) == 1 and len({s["reward"] for s in segs}) == 1
        assert all(s["status"] == "completed" or s["status"] == "truncated" for s in segs)
        second = next(s for s in segs if s["metadata"]["segment"] == 1)
        assert second["prompt_ids"] != next(s for s in segs if s["metadata"]["segment"] == 0)["prompt_ids"]


@pytest.mark.parametrize("agent", ["posts_reward", "async_two_calls"])
def test_posted_and_async_rewards(tiny_model_dir, tmp_path, agent):
    cfg = build_config(overrides=agent_overrides(tiny_model_dir, tmp_path / "run", agent, train={"steps": 1}))
    samples = read_samples(rollout_only(cfg))
    assert len(samples) == 8 and all(s["status"] in ("completed", "truncated") for s in samples)
    for s in samples:  # the reward each agent computed from the tokens it was given
        ids = [t for t, m in zip(s["response_ids"], s["loss_mask"]) if m]
        assert s["reward"] == pytest.approx(sum(t % 2 == 0 for t in ids) / len(ids))


def test_a_session_without_a_reward_is_failed_not_zero(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    overrides = agent_overrides(tiny_model_dir, run_dir, "silent", train={"steps": 1})
    overrides["rollout"] |= {"sample_retries": 1, "filter_max_rounds": 1}
    with pytest.raises(RuntimeError, match="no trainable sample"):  # not a step of zeros
        rollout_only(build_config(overrides=overrides))
    records = [json.loads(line) for line in (run_dir / "failed_samples.jsonl").read_text().splitlines()]
    # the held-out evaluation's 4 sessions, then the step's 8, each tried twice (a fresh session the second time)
    assert len(records) == 2 * (4 + 8)
    assert sorted(r["attempt"] for r in records) == [1] * 12 + [2] * 12
    assert all(r["stage"] == "reward" and "without a reward" in r["error"] for r in records)


def test_the_reward_hook_scores_the_last_answer(tiny_model_dir, tmp_path):
    cfg = build_config(
        overrides=agent_overrides(
            tiny_model_dir, tmp_path / "run", "silent", train={"steps": 1}, agent={"reward": "hook"}
        )
    )
    samples = read_samples(rollout_only(cfg))
    assert all(s["status"] in ("completed", "truncated") for s in samples)
    for s in samples:  # tests.plugins:even_token_reward on the response
        assert s["reward"] == pytest.approx(sum(t % 2 == 0 for t in s["response_ids"]) / len(s["response_ids"]))


def test_an_agent_that_raises_is_run_again_and_its_group_trains_whole_or_not_at_all(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    overrides = agent_overrides(tiny_model_dir, run_dir, "fails_every_other", train={"steps": 1}, eval={"every": 0})
    overrides["rollout"] |= {"prompts_per_step": 4, "n_samples_per_prompt": 2, "sample_retries": 1}
    trained = read_samples(rollout_only(build_config(overrides=overrides)))  # (the trainable ones)
    records = [json.loads(line) for line in (run_dir / "failed_samples.jsonl").read_text().splitlines()]
    step = [r for r in records if r["step"] == 1]
    assert step and all(r["stage"] == "agent" and "broke" in r["error"] for r in records)
    members = {}
    for s in trained:
        members.setdefault(s["group_id"], []).append(s["index"])
    assert members and all(sorted(i) == [0, 1] for i in members.values())  # never a group with a member missing
    retried = [s for s in trained if s["metadata"].get("retried")]
    assert retried  # an agent that raised ran again, in a fresh session, and its sample trains
    row = next(r for r in metrics_of(run_dir) if "samples_retried" in r)
    assert row["samples_retried"] == sum(r["attempt"] == 1 for r in step)
    assert row["sample_failures/agent/ValueError"] == len(step)


def test_agents_in_worker_processes(tiny_model_dir, tmp_path):
    cfg = build_config(
        overrides=agent_overrides(
            tiny_model_dir,
            tmp_path / "run",
            "two_calls",
            train={"steps": 1},
            agent={"workers": "processes", "concurrency": 2},
        )
    )
    samples = read_samples(rollout_only(cfg))
    assert len(samples) == 8 and all(s["metadata"]["session_calls"] == 2 for s in samples)


def test_agent_refusals(tiny_model_dir, tmp_path):
    base = agent_overrides(tiny_model_dir, tmp_path / "run", "two_calls")
    with pytest.raises(ValueError, match="use one of them"):
        build_config(overrides={**base, "tools": {"enabled": ["calculator"]}})
    with pytest.raises(ValueError, match="use one of them"):
        build_config(overrides={**base, "plugins": {**base["plugins"], "generate": "tests.plugins:x"}})
    with pytest.raises(ValueError, match="restarts clean"):
        build_config(
            overrides={
                **base,
                "rollout": {**base["rollout"], "mode": "one_step_off", "partial": "resume"},
                "algo": {"off_policy_correction": "none"},
            }
        )
    with pytest.raises(ValueError, match="below agent.concurrency"):
        build_config(overrides={**base, "agent": {"concurrency": 64, "max_calls_in_flight": 8}})
    with pytest.raises(ValueError, match="overlong_buffer"):
        build_config(overrides={**base, "algo": {"overlong_buffer": 8}})
    with pytest.raises((ConfigError, ValueError), match="scores whole groups"):
        train(
            build_config(
                overrides={
                    **base,
                    "agent": {"reward": "hook"},
                    "rollout": {**base["rollout"], "reward": "tests.plugins:group_even_token_reward"},
                }
            )
        )


def test_an_agent_that_gives_up_on_429s_is_aborted_not_failed(tiny_model_dir, tmp_path):
    """Backpressure is the proxy's doing: a sample whose agent stopped on it is never FAILED."""
    run_dir = tmp_path / "run"
    cfg = build_config(
        overrides=agent_overrides(
            tiny_model_dir,
            run_dir,
            "gives_up_on_429",
            train={"steps": 1},
            data={"eval_size": 0},
            agent={"concurrency": 1, "max_calls_in_flight": 1},
        )
    )
    trained = read_samples(rollout_only(cfg))
    rows = metrics_of(run_dir)
    step = next(r for r in rows if r.get("step") == 1 and "reward_mean" in r)
    assert step["agent_calls_rejected_busy"] >= 1 and step["agent_sessions_gave_up_on_429"] >= 1
    assert step["failed_fraction"] == 0 and step["aborted_fraction"] > 0
    assert all(s["metadata"]["session_state"] == "completed" for s in trained)  # (those that got no 429)
    assert not (run_dir / "failed_samples.jsonl").exists()


def test_agents_in_an_off_policy_run_wait_out_the_weight_updates(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    cfg = build_config(
        overrides=agent_overrides(
            tiny_model_dir,
            run_dir,
            "two_calls",
            train={"steps": 3},
            data={"eval_size": 0},
            rollout={"mode": "async", "max_staleness": 1},
            algo={"off_policy_correction": "icepop"},
        )
    )
    assert train(cfg)["steps"] == 3
    steps = [r for r in metrics_of(run_dir) if "reward_mean" in r]
    assert all(r["samples_trained"] == 8 and r["staleness_max"] <= 1 for r in steps)


def test_an_agent_trains_through_the_router_over_launched_servers(tiny_model_dir, tmp_path):
    """The proxy in front of strop serve processes behind the router (any engine kind takes the
    same path): recorded tokens and logprobs are the servers'; the trainer agrees with them."""
    run_dir = tmp_path / "run"
    cfg = build_config(
        overrides=agent_overrides(
            tiny_model_dir,
            run_dir,
            "two_calls",
            train={"steps": 2},
            data={"eval_size": 0},
            engine={"kind": "strop", "launch": 1, "launch_args": ["--threads=1"], "affinity": True},
        )
    )
    assert train(cfg)["steps"] == 2
    steps = [r for r in metrics_of(run_dir) if "reward_mean" in r]
    assert all(r["agent_calls_per_session"] == 2 and r["samples_trained"] == 8 for r in steps)
    assert all(r["train_rollout_logprob_abs_diff"] < 1e-3 for r in steps)


def test_over_sampled_agent_steps_keep_their_accounts(tiny_model_dir, tmp_path):
    """rollout.over_sample: sessions the full step no longer needs end; every sample is counted."""
    run_dir = tmp_path / "run"
    cfg = build_config(
        overrides=agent_overrides(
            tiny_model_dir, run_dir, "compacts", train={"steps": 2}, data={"eval_size": 0}, rollout={"over_sample": 2.0}
        )
    )
    assert train(cfg)["steps"] == 2  # (the manager checks its accounts every step: forks included)
    steps = [r for r in metrics_of(run_dir) if "reward_mean" in r]
    for r in steps:
        assert r["groups_drawn"] == 4 and r["samples_trained"] == 2 * 4 * 2  # 2 groups of 4 sessions x 2 segments
        assert r["samples_dropped"] > 0


def test_agent_metrics_count_forks_and_endings():
    from strop.observe.metrics import agent_metrics
    from strop.types import Sample

    def s(session, segment, segments, state, calls):
        return Sample(
            prompt="p",
            prompt_ids=[1],
            metadata={
                "agent_session": session,
                "segment": segment,
                "segments": segments,
                "session_state": state,
                "session_calls": calls,
            },
        )

    samples = [
        s("a", 0, 2, "completed", 3),
        s("a", 1, 2, "completed", 3),
        s("b", 0, 1, "capped", 2),
        s("c", 0, 0, "timeout", 0),
    ]  # c made no call: no segment, no fork
    m = agent_metrics(samples)
    assert m["agent_sessions_ended"] == 3 and m["agent_forks"] == 1
    assert m["agent_forked_session_fraction"] == pytest.approx(1 / 3)
    assert m["agent_calls_per_session"] == pytest.approx(5 / 3)
    assert (m["agent_sessions/completed"], m["agent_sessions/capped"], m["agent_sessions/timeout"]) == (1, 1, 1)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie is gone: nobody may be left to reap it)."""
    from tests.proctree import _start_time

    return _start_time(pid) is not None


@pytest.mark.timeout(180)
@pytest.mark.parametrize("workers", ["threads", "processes"])
def test_a_hung_agent_is_stopped_at_its_timeout_and_the_next_one_runs(tiny_model_dir, tmp_path, monkeypatch, workers):
    """agent.timeout_s with one agent at a time: the first agent blocks for good. Its session ends
    as timeout (aborted, counted); in processes its worker and the child it started are killed, in
    threads its thread is counted as left running and its later calls are refused; the next agent
    starts at once and the step trains the other seven sessions."""
    from tests.agents import agents

    timeout_s = 5.0  # (room for the other sessions, and a worker process's start, on a loaded machine)
    monkeypatch.setenv("STROP_TEST_HANG_DIR", str(tmp_path))
    agents.RELEASE.clear()
    agents.AFTER_RELEASE.clear()
    agents.HUNG.clear()
    run_dir = tmp_path / "run"
    cfg = build_config(
        overrides=agent_overrides(
            tiny_model_dir,
            run_dir,
            "hangs_first",
            train={"steps": 1},
            data={"eval_size": 0},
            agent={"workers": workers, "concurrency": 1, "timeout_s": timeout_s},
        )
    )
    try:
        trained = read_samples(rollout_only(cfg))
        step = next(r for r in metrics_of(run_dir) if r.get("step") == 1 and "reward_mean" in r)
        assert len(trained) == 7 and all(s["metadata"]["session_calls"] == 2 for s in trained)
        assert step["agent_sessions_timed_out"] == 1 and step["aborted_fraction"] == pytest.approx(1 / 8)
        starts = sorted(float(t) for t in (tmp_path / "starts").read_text().split())
        assert len(starts) == 8
        assert starts[1] - starts[0] < timeout_s + 10  # the next agent did not wait for the hung one
        hung, child = (int(p) for p in (tmp_path / "pids").read_text().split())
        if workers == "processes":
            assert step["agent_workers_killed"] == 1
            assert not _alive(hung) and not _alive(child)  # the worker's process group went with it
        else:
            assert step["agent_threads_abandoned"] == 1 and step["agent_threads_abandoned_running"] == 1
            assert len(agents.AFTER_RELEASE) == 1 and 400 <= agents.AFTER_RELEASE[0] < 500  # its session is closed
            assert len(agents.HUNG) == 1 and agents.HUNG[0].is_alive()  # (what agent_threads_abandoned_running counts)
            agents.RELEASE.set()
            agents.HUNG[0].join(30)
            assert not agents.HUNG[0].is_alive()
    finally:
        agents.RELEASE.set()  # (a thread left behind by a failed check ends too)


def _hung(release: threading.Event):
    def agent(base_url, api_key, row):
        release.wait(30)
        return 1.0

    return agent


def test_abandoned_agent_threads_are_bounded():
    """Threads cannot be stopped: up to agent.concurrency of them may still run past their session;
    with more, a new agent waits for one to end, and the run stops after agent.timeout_s of waiting."""
    from strop.agents.runners import ThreadRunner
    from strop.plugins import PluginError

    release = threading.Event()
    runner = ThreadRunner(_hung(release), "tests.agents:hung", concurrency=1)

    async def scenario():
        for _ in range(2):  # two agents whose sessions ended while they ran
            worker = await runner.ready(timeout_s=1.0)
            runner.abandon(runner.submit(worker, "http://127.0.0.1:9/v1", "key", {}))
        assert runner.take_counts() == {"agent_threads_abandoned": 2, "agent_threads_abandoned_running": 2}
        t0 = time.monotonic()
        with pytest.raises(PluginError, match="agent.timeout_s.*agent.workers=processes"):
            await runner.ready(timeout_s=0.5)
        assert time.monotonic() - t0 >= 0.5
        asyncio.get_running_loop().call_later(0.2, release.set)
        t0 = time.monotonic()
        worker = await runner.ready(timeout_s=10.0)  # one of them ended: room again
        assert time.monotonic() - t0 < 5
        future = runner.submit(worker, "http://127.0.0.1:9/v1", "key", {})
        assert await asyncio.wait_for(future, 5) == 1.0
        for _ in range(100):
            if runner.take_counts()["agent_threads_abandoned_running"] == 0:
                break
            await asyncio.sleep(0.05)
        assert runner.take_counts()["agent_threads_abandoned_running"] == 0

    try:
        asyncio.run(asyncio.wait_for(scenario(), 30))
    finally:
        release.set()
        runner.close()


def test_a_timed_out_async_agent_is_cancelled():
    """An async agent is stopped for real: its thread ends, nothing is left running."""
    from strop.agents.runners import ThreadRunner
    from tests.agents.agents import hangs_async

    runner = ThreadRunner(hangs_async, "tests.agents.agents:hangs_async", concurrency=1)

    async def scenario():
        worker = await runner.ready(timeout_s=1.0)
        future = runner.submit(worker, "http://127.0.0.1:9/v1", "key", {})
        await asyncio.sleep(0.3)  # it is waiting in its own event loop
        assert not future.done()  # (still running when abandoned: else nothing below would be shown)
        runner.abandon(future)
        assert runner.take_counts()["agent_threads_abandoned"] == 1
        for _ in range(100):
            if runner.take_counts()["agent_threads_abandoned_running"] == 0:
                return
            await asyncio.sleep(0.05)
        raise AssertionError("the cancelled agent's thread still runs")

    try:
        asyncio.run(asyncio.wait_for(scenario(), 30))
    finally:
        runner.close()


def test_an_agent_that_ends_as_soon_as_it_is_cancelled_is_counted_abandoned(monkeypatch):
    """The session ended while the agent ran: it is counted abandoned even when the cancel ends its thread before
    ``abandon`` returns (here the cancel waits for the thread to end, as a fast one does under load)."""
    from strop.agents import runners
    from tests.agents.agents import hangs_async

    cancel = runners._ThreadCall.cancel

    def cancel_and_wait(call):
        cancel(call)
        for _ in range(200):
            with runners._LOCK:
                if not call.running:
                    return
            time.sleep(0.01)

    monkeypatch.setattr(runners._ThreadCall, "cancel", cancel_and_wait)
    runner = runners.ThreadRunner(hangs_async, "tests.agents.agents:hangs_async", concurrency=1)

    async def scenario():
        future = runner.submit(await runner.ready(timeout_s=1.0), "http://127.0.0.1:9/v1", "key", {})
        await asyncio.sleep(0.3)
        assert not future.done()
        runner.abandon(future)
        assert runner.take_counts() == {"agent_threads_abandoned": 1, "agent_threads_abandoned_running": 0}

    try:
        asyncio.run(asyncio.wait_for(scenario(), 30))
    finally:
        runner.close()


def test_worker_processes_are_kept_replaced_and_killed():
    """agent.workers=processes: a worker serves the next agent; one that dies fails only its agent
    and is replaced; an abandoned agent's worker is killed."""
    from strop.agents.runners import ProcessRunner

    runner = ProcessRunner("tests.agents.agents:by_row")
    url = "http://127.0.0.1:9/v1"

    async def scenario():
        worker = await runner.ready(timeout_s=60)
        assert await asyncio.wait_for(runner.submit(worker, url, "k", {"reward": 0.5}), 30) == 0.5
        kept = await runner.ready(timeout_s=60)
        assert kept is worker  # (no new process for the next agent)
        with pytest.raises(RuntimeError, match="exited"):
            await asyncio.wait_for(runner.submit(kept, url, "k", {"exit": True}), 30)
        fresh = await runner.ready(timeout_s=60)
        assert fresh.process.pid != worker.process.pid
        hung = runner.submit(fresh, url, "k", {"sleep": 600})
        await asyncio.sleep(0.2)
        assert "killed" in runner.abandon(hung)
        for _ in range(100):
            if not _alive(fresh.process.pid):
                break
            await asyncio.sleep(0.05)
        assert not _alive(fresh.process.pid)
        assert runner.take_counts() == {"agent_workers_killed": 1}

    try:
        asyncio.run(asyncio.wait_for(scenario(), 120))
    finally:
        runner.close()
