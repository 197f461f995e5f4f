"""Reward functions used by the tests (loaded by import path, like a user's plugin)."""

from strop.types import Sample


def even_token_reward(sample: Sample) -> float:
    """Fraction of response tokens with an even id: varies between samples of a random model."""
    return sum(t % 2 == 0 for t in sample.response_ids) / max(sample.response_length, 1)


async def async_even_token_reward(sample: Sample) -> float:
    return even_token_reward(sample)


def not_a_number_reward(sample: Sample):
    return "yes"


def nan_reward(sample: Sample) -> float:
    return float("nan")


def flaky_reward(sample: Sample) -> float:
    """The reward's own work fails for samples of index 0: those samples fail, the run goes on."""
    if sample.index == 0:
        raise KeyError("no verifier for this answer")
    return even_token_reward(sample)


def first_try_fails_reward(sample: Sample) -> float:
    """The reward's own work fails the first try of every sample of index 0; the retry scores it."""
    if sample.index == 0 and not sample.metadata.get("retried"):
        raise KeyError("no verifier for this answer")
    return even_token_reward(sample)


def group_even_token_reward(samples: list[Sample]) -> list[float]:
    """A group-form reward (one call per group)."""
    return [even_token_reward(s) for s in samples]
