"""Dynamic sampling filters (keep or drop one scored group).

strop train --plugins.filter=examples.plugins.filters:drop_uniform_groups
"""

from strop.types import Sample


def drop_uniform_groups(group: list[Sample]) -> bool:
    """DAPO's dynamic sampling: a group whose rewards are all equal has zero advantage; drop it."""
    rewards = {s.reward for s in group if s.reward is not None}
    return len(rewards) > 1
