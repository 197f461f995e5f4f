"""Which errors fail one sample and which stop the run (rollout/generate.py)."""

import asyncio
import json

import pytest

from strop.plugins import PluginError
from strop.rollout.generate import EngineError, RolloutContext, rollout_groups
from strop.types import Completion, Sample, SampleInvariantError, SamplingParams, Status


class FakeEngine:
    weight_version = 0

    def __init__(self, fail=None):
        self.fail = fail

    async def generate(self, prompt_ids, sampling):
        if self.fail is not None:
            raise self.fail
        return Completion([7, 8], [-0.5, -0.25], "stop", 0)


class Tok:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def _groups():
    return [[Sample(prompt="p", prompt_ids=[1, 2], group_id=g, index=i) for i in range(2)] for g in range(2)]


def _run(engine, tmp_path, generate=None, reward=lambda sample: 1.0, *, retries=0, apply_filter=True, ctx=None):
    ctx = ctx or RolloutContext(
        engine=engine, tokenizer=Tok(), generate=generate, reward=reward, run_dir=tmp_path, sample_retries=retries
    )
    return asyncio.run(rollout_groups(ctx, _groups(), SamplingParams(max_new_tokens=4), apply_filter=apply_filter))


def test_an_engine_error_stops_the_rollout_with_its_cause(tmp_path):
    cause = ConnectionError("server went away")
    with pytest.raises(EngineError, match="ConnectionError: server went away") as err:
        _run(FakeEngine(fail=cause), tmp_path)
    assert err.value.__cause__ is cause
    assert not (tmp_path / "failed_samples.jsonl").exists()


def test_an_engine_error_inside_a_generate_plugin_still_stops(tmp_path):
    async def tool_then_engine(ctx, sample, sampling):
        return await ctx.engine.generate(sample.prompt_ids, sampling)  # the engine raises, the plugin does not catch

    with pytest.raises(EngineError):
        _run(FakeEngine(fail=RuntimeError("CUDA error")), tmp_path, generate=tool_then_engine)


def _flaky(fail_times: dict):
    """A generate hook whose sample 1 of each group raises its first ``fail_times[group]`` attempts."""
    attempts = {}

    async def tool(ctx, sample, sampling):
        key = (sample.group_id, sample.index)
        attempts[key] = attempts.get(key, 0) + 1
        if sample.index == 1 and attempts[key] <= fail_times.get(sample.group_id, 0):
            raise TimeoutError("the tool took too long")
        sample.apply_completion(await ctx.engine.generate(sample.prompt_ids, sampling))
        return sample

    return tool, attempts


def test_a_generate_plugins_own_error_fails_that_sample_and_drops_its_group_whole(tmp_path):
    tool, attempts = _flaky({0: 9, 1: 9})
    ctx = RolloutContext(
        engine=FakeEngine(), tokenizer=Tok(), generate=tool, reward=lambda sample: 1.0, run_dir=tmp_path
    )
    groups = _run(None, tmp_path, ctx=ctx)
    assert groups == []  # never trained with a member missing
    assert ctx.take_counts() == {
        "sample_failures/generate/TimeoutError": 2,
        "groups_failed": 2,
        "samples_in_failed_groups": 4,
    }
    written = [json.loads(x) for x in (tmp_path / "failed_samples.jsonl").read_text().splitlines()]
    assert len(written) == 2 and written[0]["stage"] == "generate" and "too long" in written[0]["error"]


def test_evaluation_keeps_a_failed_sample_and_its_group(tmp_path):
    tool, _ = _flaky({0: 9, 1: 9})
    groups = _run(FakeEngine(), tmp_path, generate=tool, apply_filter=False)
    assert [[s.status for s in g] for g in groups] == [[Status.COMPLETED, Status.FAILED]] * 2
    assert groups[0][1].metadata["error"] == "TimeoutError: the tool took too long"


def test_a_failed_sample_starts_over_within_its_retries_and_its_group_trains(tmp_path):
    tool, attempts = _flaky({0: 1, 1: 2})  # group 0's sample fails once, group 1's twice
    ctx = RolloutContext(
        engine=FakeEngine(),
        tokenizer=Tok(),
        generate=tool,
        reward=lambda sample: 1.0,
        run_dir=tmp_path,
        sample_retries=1,
    )
    groups = _run(None, tmp_path, ctx=ctx)
    assert [g[0].group_id for g in groups] == [0]  # group 1 ran out of retries: dropped whole
    assert [s.status for s in groups[0]] == [Status.COMPLETED, Status.COMPLETED]
    assert groups[0][1].metadata["retried"] == 1 and "error" not in groups[0][1].metadata
    assert groups[0][1].response_ids == [7, 8] and groups[0][1].reward == 1.0
    assert attempts == {(0, 0): 1, (0, 1): 2, (1, 0): 1, (1, 1): 2}
    assert ctx.take_counts() == {
        "sample_failures/generate/TimeoutError": 3,
        "samples_retried": 2,
        "groups_failed": 1,
        "samples_in_failed_groups": 2,
    }
    attempts_logged = [json.loads(x)["attempt"] for x in (tmp_path / "failed_samples.jsonl").read_text().splitlines()]
    assert sorted(attempts_logged) == [1, 1, 2]


def test_a_reward_that_raises_is_retried_and_each_sample_is_scored_as_it_finishes(tmp_path):
    order, calls = [], {}

    class Slow(FakeEngine):
        async def generate(self, prompt_ids, sampling):
            await asyncio.sleep(0.05 if prompt_ids == [9] else 0)
            order.append(("generated", prompt_ids[0]))
            return await super().generate(prompt_ids, sampling)

    def reward(sample):
        calls[sample.index] = calls.get(sample.index, 0) + 1
        order.append(("scored", sample.prompt_ids[0]))
        if sample.index == 0 and calls[0] == 1:
            raise ValueError("judge said garbage")
        return 0.5

    ctx = RolloutContext(engine=Slow(), tokenizer=Tok(), reward=reward, run_dir=tmp_path, sample_retries=1)
    group = [
        Sample(prompt="p", prompt_ids=[1], group_id=0, index=0),
        Sample(prompt="p", prompt_ids=[9], group_id=0, index=1),
    ]
    (got,) = asyncio.run(rollout_groups(ctx, [group], SamplingParams(max_new_tokens=4)))
    assert [s.reward for s in got] == [0.5, 0.5] and calls == {0: 2, 1: 1}
    # the fast sample was scored (twice: the retry) before the slow one finished generating
    assert order.index(("scored", 1)) < order.index(("generated", 9))
    assert ctx.take_counts() == {"sample_failures/reward/ValueError": 1, "samples_retried": 1}


def test_a_broken_sample_invariant_stops_the_run(tmp_path):
    async def breaks(ctx, sample, sampling):
        sample.response_ids = [1, 2, 3]  # no logprobs, no loss mask for them
        sample.status = Status.COMPLETED
        return sample

    with pytest.raises((PluginError, SampleInvariantError), match="invariant"):
        _run(FakeEngine(), tmp_path, generate=breaks)
