"""Plugins that record how strop calls them, then behave like the defaults."""

from strop.algo.advantages import grpo_advantages
from strop.algo.losses import ppo_clip_loss
from strop.rollout.generate import generate as default_generate
from strop.rollout.generate import rollout_groups

CALLS: dict[str, list[dict]] = {}


def _record(hook, **kwargs):
    CALLS.setdefault(hook, []).append({k: type(v) for k, v in kwargs.items()} | {"_values": kwargs})


async def rollout(ctx, groups, sampling):
    _record("rollout", ctx=ctx, groups=groups, sampling=sampling)
    return await rollout_groups(ctx, groups, sampling)


async def generate(ctx, sample, sampling):
    _record("generate", ctx=ctx, sample=sample, sampling=sampling)
    return await default_generate(ctx, sample, sampling)


def reward(sample):
    _record("reward", sample=sample)
    return sum(t % 2 == 0 for t in sample.response_ids) / max(sample.response_length, 1)


def filter(group):
    _record("filter", group=group)
    return True


def postprocess(samples, step):
    _record("postprocess", samples=samples, step=step)
    return None


def advantage(rewards, group_ids, mask):
    _record("advantage", rewards=rewards, group_ids=group_ids, mask=mask)
    return grpo_advantages(rewards, group_ids)


def policy_loss(logprobs, old_logprobs, advantages, mask):
    _record("policy_loss", logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, mask=mask)
    loss, info = ppo_clip_loss(logprobs, old_logprobs, advantages)
    return loss, {}


def data_source(config, split):
    _record("data_source", config=config, split=split)
    numbers = range(12) if split == "train" else range(100, 103)  # held out: disjoint from training
    return [{"prompt": f"What is {i} + {i}?", "label": str(2 * i)} for i in numbers]


def tools(config):
    from strop.tools import CALCULATOR

    _record("tools", config=config)
    return [CALCULATOR]
