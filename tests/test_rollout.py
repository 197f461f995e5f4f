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


def _run(engine, tmp_path, generate=None, reward=lambda sample: 1.0):
    ctx = RolloutContext(engine=engine, tokenizer=Tok(), generate=generate, reward=reward, run_dir=tmp_path)
    return asyncio.run(rollout_groups(ctx, _groups(), SamplingParams(max_new_tokens=4)))


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


def test_a_generate_plugins_own_error_fails_that_sample_only(tmp_path):
    async def tool(ctx, sample, sampling):
        if sample.index == 1:
            raise TimeoutError("the tool took too long")
        sample.apply_completion(await ctx.engine.generate(sample.prompt_ids, sampling))
        return sample

    groups = _run(FakeEngine(), tmp_path, generate=tool)
    statuses = [[s.status for s in g] for g in groups]
    assert statuses == [[Status.COMPLETED, Status.FAILED]] * 2
    assert groups[0][1].metadata["error"] == "TimeoutError: the tool took too long"
    written = [json.loads(x) for x in (tmp_path / "failed_samples.jsonl").read_text().splitlines()]
    assert len(written) == 2 and written[0]["stage"] == "generate" and "too long" in written[0]["error"]


def test_a_broken_sample_invariant_stops_the_run(tmp_path):
    async def breaks(ctx, sample, sampling):
        sample.response_ids = [1, 2, 3]  # no logprobs, no loss mask for them
        sample.status = Status.COMPLETED
        return sample

    with pytest.raises((PluginError, SampleInvariantError), match="invariant"):
        _run(FakeEngine(), tmp_path, generate=breaks)
