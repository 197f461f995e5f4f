"""A verifiers environment (verifiers 0.4, its own API): reasoning-gym's one-digit arithmetic, the
quickstart's task, as a taskset whose reward is the environment's own. Train on it with

    strop train examples/configs/verifiers_arithmetic.yaml

``split='train'`` and ``split='eval'`` draw from different reasoning-gym seeds (strop also removes a
held-out question that equals a training one, and counts what is left)."""

from __future__ import annotations

import re

import reasoning_gym
import verifiers.v1 as vf

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
SEEDS = {"train": 1, "eval": 1000003}


class ArithmeticData(vf.TaskData):
    answer: str


class ArithmeticTask(vf.Task[ArithmeticData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        """1 when the reply's last number is the answer."""
        numbers = _NUMBER.findall(trace.last_reply or "")
        return float(bool(numbers) and float(numbers[-1]) == float(self.data.answer))


class ArithmeticConfig(vf.TasksetConfig):
    split: str = "train"
    size: int = 2000


class ArithmeticTaskset(vf.Taskset[ArithmeticTask, ArithmeticConfig]):
    def load(self):
        if self.config.split not in SEEDS:
            raise ValueError(f"split={self.config.split!r}: choose one of {sorted(SEEDS)}")
        data = reasoning_gym.create_dataset(
            "basic_arithmetic",
            seed=SEEDS[self.config.split],
            size=self.config.size,
            min_terms=2,
            max_terms=2,
            min_digits=1,
            max_digits=1,
        )
        for entry in data:
            yield ArithmeticTask(
                ArithmeticData(prompt=entry["question"], answer=str(entry["answer"])), self.config.task
            )


__all__ = ["ArithmeticTaskset"]
