"""Advantage estimators. Pure tensor functions: no config objects, no torch.distributed."""

from __future__ import annotations

import torch


def grpo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, *, normalize_std: bool = True,
                    eps: float = 1e-6) -> torch.Tensor:
    """GRPO outcome advantages (Shao et al. 2024, "DeepSeekMath", section 4.1.2).

    ``A_i = (r_i - mean(r_group)) / (std(r_group) + eps)`` for every sample i of
    a group (samples sharing a group id). Deviations from the paper:
    - the std is the sample std (divide by n - 1), as torch.std, TRL and slime
      compute it; a group of one sample has std 0; eps = 1e-6 keeps all-equal
      groups at exactly 0 instead of 0/0;
    - ``normalize_std=False`` gives the Dr. GRPO form (Liu et al. 2025), which
      only centres the rewards.
    The advantage is one scalar per sample, broadcast to its response tokens by the loss.

    rewards: (N,) float; group_ids: (N,) int. Returns (N,).
    """
    if rewards.shape != group_ids.shape or rewards.dim() != 1:
        raise ValueError(f"rewards {tuple(rewards.shape)} and group_ids {tuple(group_ids.shape)} must be equal 1-D")
    rewards = rewards.float()
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    sums = torch.zeros(len(counts), dtype=rewards.dtype).index_add_(0, inverse, rewards)
    mean = sums / counts  # (G,)
    centred = rewards - mean[inverse]  # (N,)
    if not normalize_std:
        return centred
    squares = torch.zeros(len(counts), dtype=rewards.dtype).index_add_(0, inverse, centred**2)
    var = squares / (counts - 1).clamp(min=1)  # Bessel's correction; n = 1 gives 0 / 1
    return centred / (var.sqrt()[inverse] + eps)
