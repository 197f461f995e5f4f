"""Reward hooks. A reward is a plain function of one Sample (sync or async) returning a float,
or of a whole group (`samples: list[Sample]`) returning one float per sample.

    strop train --rollout.reward=examples.plugins.rewards:concise_math_reward
    strop check-plugin --hook reward examples.plugins.rewards:concise_math_reward
"""

from strop.rollout.rewards import math_equal
from strop.types import Sample


def concise_math_reward(sample: Sample) -> float:
    """1 for a correct final answer, minus up to 0.2 for using the whole length budget."""
    correct = 1.0 if math_equal(sample.response_text, sample.label) else 0.0
    budget = sample.metadata.get("max_new_tokens", 48)
    return correct - 0.2 * min(sample.response_length / budget, 1.0)


def rank_in_group_reward(samples: list[Sample]) -> list[float]:
    """Group form: correct answers share 1, and among them the shorter ones get a little more."""
    correct = [math_equal(s.response_text, s.label) for s in samples]
    lengths = sorted(s.response_length for s, ok in zip(samples, correct) if ok)
    return [
        (1.0 + 0.1 * (1 - lengths.index(s.response_length) / max(len(lengths), 1))) if ok else 0.0
        for s, ok in zip(samples, correct)
    ]
