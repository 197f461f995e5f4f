"""The default rollout: prompt → generate hook → Sample → reward hook → filter hook."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Callable

from strop.engines.base import Engine
from strop.plugins import PluginError, call_hook, call_hook_sync, check_signature, load_hook
from strop.rollout.rewards import BUILTIN_REWARDS
from strop.types import SamplingParams, Sample, Status

# kept for callers that catch reward problems by this name
RewardError = PluginError


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

    def __post_init__(self):
        self.generate = self.generate or generate
        self.reward_form = check_signature("reward", self.reward) if self.reward else None


async def generate(ctx: RolloutContext, sample: Sample, sampling: SamplingParams) -> Sample:
    """Default generate function: one engine call, the response decoded into ``response_text``."""
    completion = await ctx.engine.generate(sample.prompt_ids, sampling)
    sample.apply_completion(completion)
    sample.response_text = ctx.tokenizer.decode(sample.response_ids, skip_special_tokens=True)
    return sample


def resolve_reward(name: str) -> Callable:
    """A built-in reward by name, or a reward hook by import path (checked now)."""
    return BUILTIN_REWARDS[name] if name in BUILTIN_REWARDS else load_hook("reward", name)


async def _generate_one(ctx: RolloutContext, sample: Sample, sampling: SamplingParams) -> Sample:
    try:
        return await call_hook("generate", ctx.generate, ctx=ctx, sample=sample, sampling=sampling)
    except PluginError:
        raise  # a contract violation stops the run
    except Exception as exc:  # an ordinary failure (a tool, a server) costs this sample only
        sample.status = Status.FAILED
        sample.metadata["error"] = f"{type(exc).__name__}: {exc}"
        return sample


async def score_group(ctx: RolloutContext, group: list[Sample]) -> None:
    scorable = [s for s in group if s.status.trainable]
    if not scorable:
        return
    if ctx.reward_form == "group":
        rewards = await call_hook("reward", ctx.reward, samples=scorable)
    else:
        rewards = await asyncio.gather(*(call_hook("reward", ctx.reward, sample=s) for s in scorable))
    for s, r in zip(scorable, rewards):
        s.reward = r


async def rollout_groups(ctx: RolloutContext, groups: list[list[Sample]], sampling: SamplingParams,
                         *, apply_filter: bool = True) -> list[list[Sample]]:
    """Generate and score every sample of every group concurrently (the engine batches them)."""
    flat = [(gi, s) for gi, g in enumerate(groups) for s in g]
    done = await asyncio.gather(*(_generate_one(ctx, s, sampling) for _, s in flat))
    regrouped = [[] for _ in groups]
    for (gi, _), s in zip(flat, done):  # a generate hook may return a different Sample object
        regrouped[gi].append(s)
    await asyncio.gather(*(score_group(ctx, g) for g in regrouped))
    if apply_filter and ctx.filter is not None:
        regrouped = [g for g in regrouped if call_hook_sync("filter", ctx.filter, group=g)]
    return regrouped


async def rollout(ctx: RolloutContext, groups: list[list[Sample]], sampling: SamplingParams) -> list[list[Sample]]:
    """Default rollout hook: generate, reward and filter every group."""
    return await rollout_groups(ctx, groups, sampling)
