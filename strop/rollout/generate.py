"""Single-turn rollout: prompt → engine → Sample → reward."""

from __future__ import annotations

import asyncio
import importlib
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable

from strop.engines.base import Engine
from strop.rollout.rewards import BUILTIN_REWARDS
from strop.types import SamplingParams, Sample, Status


class RewardError(RuntimeError):
    pass


@dataclass
class RolloutContext:
    """What a rollout or generate hook may use, instead of a bag of global arguments."""

    engine: Engine
    tokenizer: Any
    config: Any = None
    step: int = 0
    extra: dict = field(default_factory=dict)


async def generate(ctx: RolloutContext, sample: Sample, sampling: SamplingParams) -> Sample:
    """Default generate function: one engine call, the response decoded into ``response_text``."""
    completion = await ctx.engine.generate(sample.prompt_ids, sampling)
    sample.apply_completion(completion)
    sample.response_text = ctx.tokenizer.decode(sample.response_ids, skip_special_tokens=True)
    return sample


def load_function(path: str) -> Callable:
    """Import ``package.module:function`` (or ``package.module.function``)."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"{path!r} is not an import path like 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"cannot import {module_name!r} (from {path!r}): {exc}") from None
    try:
        fn = getattr(module, attr)
    except AttributeError:
        raise ValueError(f"module {module_name!r} has no attribute {attr!r} (from {path!r})") from None
    if not callable(fn):
        raise ValueError(f"{path!r} is not callable")
    return fn


def resolve_reward(name: str) -> Callable:
    return BUILTIN_REWARDS[name] if name in BUILTIN_REWARDS else load_function(name)


async def score(reward_fn: Callable, sample: Sample) -> float:
    value = reward_fn(sample)
    if inspect.isawaitable(value):
        value = await value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RewardError(
            f"reward function {getattr(reward_fn, '__name__', reward_fn)!r} returned {value!r} "
            f"({type(value).__name__}) for sample group={sample.group_id} index={sample.index}; expected a float"
        )
    return float(value)


async def generate_and_score(ctx: RolloutContext, sample: Sample, sampling: SamplingParams,
                             reward_fn: Callable) -> Sample:
    sample = await generate(ctx, sample, sampling)
    if sample.status.trainable:
        sample.reward = await score(reward_fn, sample)
    return sample


async def rollout_groups(ctx: RolloutContext, groups: list[list[Sample]], sampling: SamplingParams,
                         reward_fn: Callable) -> list[list[Sample]]:
    """Generate and score every sample of every group concurrently (the engine batches them)."""
    flat = [s for g in groups for s in g]
    done = await asyncio.gather(*(generate_and_score(ctx, s, sampling, reward_fn) for s in flat))
    for s in done:
        if s.status == Status.PENDING:
            raise RuntimeError(f"sample group={s.group_id} index={s.index} is still PENDING after generate")
    return groups
