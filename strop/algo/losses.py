"""Policy losses and loss reduction. Pure tensor functions: no config, no torch.distributed."""

from __future__ import annotations

import torch


def ppo_clip_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                  loss_mask: torch.Tensor, *, clip_low: float = 0.2, clip_high: float = 0.2,
                  normalizer: float | torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """PPO clipped surrogate (Schulman et al. 2017) with separate low/high clip (DAPO, Yu et al. 2025).

    Per token t: ``ratio = exp(logprob - old_logprob)``,
    ``loss_t = max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high))``.
    Tokens with ``loss_mask == 0`` (prompt padding, tool output) contribute nothing.

    Reduction is the token mean over the *whole step*: ``sum_t(mask * loss_t) / normalizer``
    where ``normalizer`` is the number of loss tokens in the step (not in this micro-batch),
    so that gradient accumulation over micro-batches equals the one-batch gradient.
    If ``normalizer`` is None the micro-batch's own token count is used.

    All tensors are (B, T); advantages may be (B, T) or (B, 1). Returns the loss
    and detached metric sums (``clipped_tokens``, ``loss_tokens``).
    """
    mask = loss_mask.to(logprobs.dtype)
    log_ratio = (logprobs - old_logprobs).clamp(-20.0, 20.0)  # guard exp overflow on garbage inputs
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(unclipped, clipped)  # (B, T): the pessimistic bound
    if normalizer is None:
        normalizer = mask.sum().clamp(min=1.0)
    loss = (per_token * mask).sum() / normalizer
    with torch.no_grad():
        is_clipped = (clipped > unclipped) & (mask > 0)  # the clip bound was the active one
        metrics = {"clipped_tokens": is_clipped.sum().item(), "loss_tokens": mask.sum().item()}
    return loss, metrics
