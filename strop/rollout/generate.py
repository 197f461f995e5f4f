"""The default rollout: prompt → generate hook → Sample → reward hook → filter hook."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import json
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from strop.engines.base import Engine, EngineWrapper
from strop.plugins import PluginError, call_hook, call_hook_sync, check_signature
from strop.rollout import reward_adapters
from strop.types import SampleInvariantError, SamplingParams, Sample, Status

# kept for callers that catch reward problems by this name
RewardError = PluginError


class EngineError(RuntimeError):
    """The inference engine failed a request. Not a sample's fault: it stops the step."""


class GuardedEngine(EngineWrapper):
    """The engine as hooks see it: any error it raises becomes an :class:`EngineError`, so the
    rollout can tell an engine failure (stop) from a failure of the sample's own work (fail the sample).
    ``affinity`` (a key per sample: every turn of it goes to one engine) reaches engines that take
    it (the router, with engine.affinity) and is dropped for the others."""

    def __init__(self, engine: Engine):
        self._engine = engine
        params = inspect.signature(engine.generate).parameters if engine is not None else {}  # train only: none
        self._takes_affinity = "affinity" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
        # the engine reports each token as it decodes it (the embedded engine's on_token): streams can be live
        self.streams = "on_token" in params

    async def generate(
        self, prompt_ids, sampling, affinity: str | None = None, *, request_id: str | None = None, on_token=None
    ):
        """``request_id`` and ``on_token`` (see :meth:`EmbeddedEngine.generate`) only where ``streams``."""
        kw = {"affinity": affinity} if affinity is not None and self._takes_affinity else {}
        if on_token is not None:
            kw.update(request_id=request_id, on_token=on_token)
        try:
            return await self._engine.generate(prompt_ids, sampling, **kw)
        except Exception as exc:
            raise EngineError(f"{type(self._engine).__name__}.generate failed: {type(exc).__name__}: {exc}") from exc


@dataclass
class RolloutContext:
    """What a rollout or generate hook may use, instead of a bag of global arguments."""

    engine: Engine
    tokenizer: Any
    config: Any = None
    step: int = 0
    generate: Callable | None = None  # the generate hook (default: :func:`generate`)
    reward: Callable | None = None  # the reward hook
    filter: Callable | None = None  # the dynamic sampling filter, if any
    extra: dict = field(default_factory=dict)
    run_dir: Path | None = None  # failed samples are written to run_dir/failed_samples.jsonl

    def __post_init__(self):
        if not isinstance(self.engine, GuardedEngine):
            self.engine = GuardedEngine(self.engine)
        self.generate = self.generate or generate
        self.reward_form = check_signature("reward", self.reward) if self.reward else None


async def generate(ctx: RolloutContext, sample: Sample, sampling: SamplingParams) -> Sample:
    """Default generate function: one engine call, the response decoded into ``response_text``.
    A sample that already has tokens (aborted at a weight update, resumed: rollout.partial=resume)
    continues from its prompt plus those tokens, with the budget it has left."""
    done = sample.response_length
    if done:
        sampling = dataclasses.replace(sampling, max_new_tokens=sampling.max_new_tokens - done)
    completion = await ctx.engine.generate(
        sample.prompt_ids + sample.response_ids if done else sample.prompt_ids, sampling, affinity=affinity_key(sample)
    )
    sample.apply_completion(completion)
    sample.response_text = ctx.tokenizer.decode(sample.response_ids, skip_special_tokens=True)
    return sample


def affinity_key(sample: Sample) -> str:
    """The router's affinity key of ``sample``: its requests (turns, a resumed continuation) go to
    the engine that holds its prefix. Group ids are unique in a run (eval groups are negative)."""
    return f"{sample.group_id}/{sample.index}"


def resolve_reward(name: str, cfg=None) -> Callable:
    """A built-in reward by name, or a reward function of any shape strop takes, by import path or file
    (strop.rollout.reward_adapters: strop's own, TRL's, verl's, slime's); checked now."""
    return reward_adapters.resolve_reward(name, cfg)


# errors that are never a sample's own: a broken contract or invariant, the engine, cancellation
_NOT_THE_SAMPLES = (PluginError, SampleInvariantError, EngineError)


def fail_sample(ctx: RolloutContext, sample: Sample, stage: str, exc: Exception) -> Sample:
    """Mark ``sample`` FAILED by an error of its own work (its generate plugin, tool or reward),
    keep the error text in its metadata and append it to run_dir/failed_samples.jsonl."""
    sample.status = Status.FAILED
    sample.metadata["error"] = f"{type(exc).__name__}: {exc}"
    sample.metadata["error_stage"] = stage
    if ctx.run_dir is not None:
        record = {
            "step": ctx.step,
            "group_id": sample.group_id,
            "index": sample.index,
            "stage": stage,
            "error": sample.metadata["error"],
            "traceback": traceback.format_exception(exc)[-6:],
        }
        with open(Path(ctx.run_dir) / "failed_samples.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
    return sample


async def _generate_one(ctx: RolloutContext, sample: Sample, sampling: SamplingParams) -> Sample:
    try:
        return await call_hook("generate", ctx.generate, ctx=ctx, sample=sample, sampling=sampling)
    except _NOT_THE_SAMPLES:
        raise  # a contract violation, a broken Sample or an engine failure stops the run
    except Exception as exc:  # the generate plugin's own work (a tool, a parser) failed: this sample only
        return fail_sample(ctx, sample, "generate", exc)


async def _reward_one(ctx: RolloutContext, sample: Sample) -> None:
    try:
        sample.reward = await call_hook("reward", ctx.reward, sample=sample)
    except _NOT_THE_SAMPLES:
        raise  # a non-numeric or non-finite reward is a broken contract: the run stops naming hook and sample
    except Exception as exc:
        fail_sample(ctx, sample, "reward", exc)


def with_segments(samples: list[Sample]) -> list[Sample]:
    """``samples`` with the extra samples a generate function returned beside one (an agent
    session's forks, ``metadata['extra_samples']``) right after it, in the same group."""
    out = []
    for s in samples:
        out.append(s)
        out += s.metadata.pop("extra_samples", [])
    return out


async def score_group(ctx: RolloutContext, group: list[Sample]) -> None:
    # (an agent session's samples come with their session's reward: metadata['reward_given'])
    scorable = [s for s in group if s.status.trainable and not s.metadata.get("reward_given")]
    if not scorable:
        return
    if ctx.reward_form != "group":
        await asyncio.gather(*(_reward_one(ctx, s) for s in scorable))
        _shape_tool_calls(ctx, scorable)
        return
    try:
        rewards = await call_hook("reward", ctx.reward, samples=scorable)
    except _NOT_THE_SAMPLES:
        raise
    except Exception as exc:  # a group reward that raised fails the group's samples
        for s in scorable:
            fail_sample(ctx, s, "reward", exc)
        return
    for s, r in zip(scorable, rewards):
        s.reward = r
    _shape_tool_calls(ctx, scorable)


def _shape_tool_calls(ctx: RolloutContext, samples: list[Sample]) -> None:
    """tools.call_reward: add it per successful tool call, at most max_call_reward in absolute value."""
    per_call, cap = ctx.extra.get("call_reward", (0.0, 0.0))
    if not per_call:
        return
    for s in samples:
        if s.status.trainable and s.reward is not None and "tool_calls" in s.metadata:
            ok = s.metadata["tool_calls"] - s.metadata.get("tool_errors", 0)
            s.reward = float(s.reward) + max(-abs(cap), min(abs(cap), per_call * ok))


async def rollout_groups(
    ctx: RolloutContext, groups: list[list[Sample]], sampling: SamplingParams, *, apply_filter: bool = True
) -> list[list[Sample]]:
    """Generate and score every sample of every group concurrently (the engine batches them)."""
    flat = [(gi, s) for gi, g in enumerate(groups) for s in g]
    done = await asyncio.gather(*(_generate_one(ctx, s, sampling) for _, s in flat))
    regrouped = [[] for _ in groups]
    for (gi, _), s in zip(flat, done):  # a generate hook may return a different Sample object
        regrouped[gi] += with_segments([s])
    await asyncio.gather(*(score_group(ctx, g) for g in regrouped))
    if apply_filter and ctx.filter is not None:
        regrouped = [g for g in regrouped if call_hook_sync("filter", ctx.filter, group=g)]
    return regrouped


async def rollout(ctx: RolloutContext, groups: list[list[Sample]], sampling: SamplingParams) -> list[list[Sample]]:
    """Default rollout hook: generate, reward and filter every group."""
    return await rollout_groups(ctx, groups, sampling)
