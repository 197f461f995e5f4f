"""Rollout hooks: a whole step's rollout.

strop train --plugins.rollout=examples.plugins.rollout:rollout_with_best_of_group
"""

from strop.rollout.generate import rollout_groups
from strop.types import SamplingParams, Sample


async def rollout_with_best_of_group(ctx, groups: list[list[Sample]], sampling: SamplingParams) -> list[list[Sample]]:
    """The default rollout, then record in each sample's metadata whether it was its group's best."""
    groups = await rollout_groups(ctx, groups, sampling)
    for group in groups:
        best = max((s.reward for s in group if s.reward is not None), default=None)
        for s in group:
            s.metadata["best_of_group"] = s.reward is not None and s.reward == best
    return groups
