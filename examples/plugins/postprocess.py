"""Rollout-data postprocess hooks, called just before training.

strop train --plugins.postprocess=examples.plugins.postprocess:overlong_penalty
"""

from strop.types import Sample, Status


def overlong_penalty(samples: list[Sample], step: int) -> list[Sample] | None:
    """Subtract 0.5 from the reward of truncated responses (DAPO's overlong shaping, simplified)."""
    for s in samples:
        if s.status == Status.TRUNCATED and s.reward is not None:
            s.reward -= 0.5
    return None  # edited in place
