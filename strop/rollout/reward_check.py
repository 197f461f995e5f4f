"""The reward tried before any model loads: ``rollout.reward`` called once on the first training and eval
row, as the rollout will call it, so a reward that cannot score the run's data is refused at start."""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from strop.config import Config
from strop.data.sources import DataError
from strop.plugins import call_hook, check_signature
from strop.rollout.rewards import BUILTIN_REWARDS
from strop.types import Sample, Status


def check_reward(cfg: Config, reward_fn: Callable, train_rows, eval_rows=None) -> None:
    """The reward tried on the first training and eval row, its label as the response, before any model loads,
    called as the run calls it (per sample or per group, awaited if it is async): a reward that cannot score
    these rows (reasoning_gym on a file's rows, a TRL reward reading a column the data lacks) is refused here,
    naming the reward, the row and the error, instead of failing every sample of the first step.
    ``rollout.check_reward=false`` skips the trial (a reward that must not be called before the run)."""
    if not cfg.rollout.check_reward or (cfg.plugins.agent and cfg.agent.reward == "session"):
        return  # (an agent's or environment's sessions carry their own reward: rollout.reward is never called)
    grouped = check_signature("reward", reward_fn) == "group"
    for rows in (train_rows, eval_rows):
        if not rows:
            continue
        row = rows[0]
        sample = Sample(prompt=row.prompt, prompt_ids=[0], label=row.label, metadata=dict(row.metadata, row_index=0))
        sample.response_text = "" if row.label is None else str(row.label)
        sample.status = Status.COMPLETED
        try:
            _call_once(reward_fn, **({"samples": [sample]} if grouped else {"sample": sample}))
        except Exception as exc:
            if cfg.rollout.reward in BUILTIN_REWARDS:
                fix = (
                    "choose a reward that scores these rows (rollout.reward=math or exact_match compare with the label)"
                )
            else:
                fix = (
                    "fix the reward or the data; if the reward cannot score its label given as the response, or "
                    "must not be called before the run, set rollout.check_reward=false"
                )
            raise DataError(
                f"rollout.reward={cfg.rollout.reward!r} cannot score {row.where or 'the first row'} "
                f"(data.source={cfg.data.source!r}), its label given as the response: "
                f"{type(exc).__name__}: {exc}; {fix}"
            ) from None


def _call_once(reward_fn: Callable, **kwargs) -> None:
    """The reward hook called once as the rollout calls it (strop.plugins.call_hook: awaited, result checked),
    on an event loop of its own (in a thread when the caller already runs one, as a notebook does)."""
    trial = functools.partial(asyncio.run, call_hook("reward", reward_fn, **kwargs))
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return trial()
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(trial).result()
