"""Advantage estimator hooks.

strop train --plugins.advantage=examples.plugins.advantages:median_baseline
"""

import torch


def median_baseline(rewards: torch.Tensor, group_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A_i = r_i - median of its group: robust to one outlier reward. Returns (N,)."""
    out = torch.empty_like(rewards)
    for g in group_ids.unique():
        members = group_ids == g
        out[members] = rewards[members] - rewards[members].median()
    return out
