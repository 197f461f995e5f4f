"""The default rollout: prompt → generate hook → Sample → reward hook → filter hook."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import json
import traceback
from collections import Counter
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
    sample_retries: int = 0  # rollout.sample_retries: a failed sample starts over this many times at most
    counts: Counter = field(default_factory=Counter)  # failures, retries and failed groups since take_counts()

    def __post_init__(self):
        if not isinstance(self.engine, GuardedEngine):
            self.engine = GuardedEngine(self.engine)
        self.generate = self.generate or generate
        self.reward_form = check_signature("reward", self.reward) if self.reward else None

    def take_counts(self) -> dict[str, int]:
        """The failures (``sample_failures/<stage>/<error type>``), retries (``samples_retried``) and groups
        dropped for a failed member (``groups_failed``) since the last call."""
        out, self.counts = {k: v for k, v in self.counts.items() if not k.startswith("_")}, Counter()
        return out


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
    ctx.counts[f"sample_failures/{stage}/{type(exc).__name__}"] += 1
    if ctx.run_dir is not None:
        record = {
            "step": ctx.step,
            "group_id": sample.group_id,
            "index": sample.index,
            "stage": stage,
            "error": sample.metadata["error"],
            "attempt": sample.metadata.get("retried", 0) + 1,
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


async def settle(ctx: RolloutContext, sample: Sample, sampling: SamplingParams, generate_one=None) -> list[Sample]:
    """Generate ``sample`` (with ``generate_one``: default the generate hook) and, for a per-sample reward,
    score it as soon as it finishes: no sample waits for its group or the batch. Returns the sample and the
    segments its generate function made beside it. A sample whose own work failed (its generate hook, agent
    or environment, its reward or judge) starts over, a fresh run of all of it, at most
    ``ctx.sample_retries`` times (each counted in ``samples_retried``); it stays FAILED past that."""
    generate_one = generate_one or _generate_one
    attempt = 0
    while True:
        done = with_segments([await generate_one(ctx, sample, sampling)])
        if ctx.reward_form != "group":
            await _score_each(ctx, done)
        failed = [s for s in done if s.status == Status.FAILED]
        if not failed or attempt >= ctx.sample_retries:
            return done
        attempt += 1
        ctx.counts["samples_retried"] += 1
        sample = done[0]
        sample.reset_response()
        for key in ("error", "error_stage", "extra_samples", "reward_given"):
            sample.metadata.pop(key, None)
        sample.metadata["retried"] = attempt


async def _score_each(ctx: RolloutContext, samples: list[Sample]) -> None:
    """Per-sample rewards for those not scored yet (an agent session's come with its reward), then tool shaping."""
    todo = [s for s in samples if s.status.trainable and s.reward is None and not s.metadata.get("reward_given")]
    await asyncio.gather(*(_reward_one(ctx, s) for s in todo))
    _shape_tool_calls(ctx, todo)


def failed_group(ctx: RolloutContext, group: list[Sample]) -> bool:
    """True when a member of ``group`` failed (past its retries): the whole group is then dropped, never
    trained with a member missing (its baseline would be another group's). Counted in ``groups_failed``."""
    if any(s.status == Status.FAILED for s in group):
        ctx.counts["groups_failed"] += 1
        ctx.counts["samples_in_failed_groups"] += len(group)
        ctx.counts["_forks_in_failed_groups"] += sum(s.metadata.get("segment", 0) > 0 for s in group)
        return True
    return False


async def score_group(ctx: RolloutContext, group: list[Sample]) -> None:
    """Score what is not scored yet: each sample (per-sample rewards), or the group at once (group rewards)."""
    # (an agent session's samples come with their session's reward: metadata['reward_given'])
    if ctx.reward_form != "group":
        await _score_each(ctx, group)
        return
    scorable = [s for s in group if s.status.trainable and not s.metadata.get("reward_given")]
    if not scorable:
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
    """Generate and score every sample of every group concurrently (the engine batches them); each
    sample is scored as it finishes and retried on its own failure (:func:`settle`). With
    ``apply_filter`` (training), a group with a member failed past its retries is dropped whole
    (:func:`failed_group`), then the filter hook runs; evaluation keeps every sample."""
    settled = await asyncio.gather(*(asyncio.gather(*(settle(ctx, s, sampling) for s in g)) for g in groups))
    regrouped = [[s for done in g for s in done] for g in settled]
    await asyncio.gather(*(score_group(ctx, g) for g in regrouped))
    if apply_filter:
        regrouped = [g for g in regrouped if not failed_group(ctx, g)]
        if ctx.filter is not None:
            regrouped = [g for g in regrouped if call_hook_sync("filter", ctx.filter, group=g)]
    return regrouped


async def rollout(ctx: RolloutContext, groups: list[list[Sample]], sampling: SamplingParams) -> list[list[Sample]]:
    """Default rollout hook: generate, reward and filter every group."""
    return await rollout_groups(ctx, groups, sampling)
