"""Policy loss hooks.

strop train --plugins.policy_loss=examples.plugins.losses:reinforce_loss
"""

import torch


def reinforce_loss(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, dict]:
    """Plain REINFORCE with the ratio's gradient: -A * ratio, unclipped. Per token (N, T)."""
    ratio = torch.exp(logprobs - old_logprobs)
    return -advantages * ratio, {"ratio_above_2": (ratio > 2.0).detach()}
