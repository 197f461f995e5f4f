"""Policy losses, value loss and loss aggregation.

Pure tensor functions: no config objects, no torch.distributed. A loss
function returns the *per-token* loss (N, T) and detached per-token indicator
tensors for metrics; :func:`aggregate` then reduces it with a normaliser fixed
for the whole step, so the gradient does not depend on how the step's samples
are split into micro-batches (or, later, ranks).
"""

from __future__ import annotations

import torch

from strop.algo.offpolicy import sequence_mean

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")


def _ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor) -> torch.Tensor:
    return torch.exp((logprobs - old_logprobs).clamp(-20.0, 20.0))  # guard exp overflow on garbage inputs


def ppo_clip_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate (Schulman et al. 2017), per token.

    ``ratio = exp(logprob - old_logprob)``;
    ``loss_t = max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high))``.
    Deviations from the paper: separate low and high epsilon ("clip-higher",
    DAPO, Yu et al. 2025); optional dual clip (Ye et al. 2020, "Mastering
    Complex Control in MOBA Games"): for A < 0 the loss is also capped at
    ``-A * dual_clip`` (dual_clip > 1), so a huge ratio on a bad token cannot
    dominate. All tensors (N, T); advantages may be (N, 1).
    Returns the per-token loss and indicators ``clipped_low``, ``clipped_high``, ``dual_clipped``.
    """
    ratio = _ratio(logprobs, old_logprobs)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)  # the pessimistic bound
    clip_active = (clipped > unclipped).detach()  # the clipped term was chosen
    adv = advantages.expand_as(ratio)
    info = {"clipped_low": clip_active & (adv < 0), "clipped_high": clip_active & (adv > 0)}
    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
        cap = -advantages * dual_clip  # positive where A < 0
        dual = (adv < 0) & (loss > cap)
        loss = torch.where(dual, cap.expand_as(loss), loss)
        info["dual_clipped"] = dual.detach()
    return loss, info


def gspo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO: sequence-level importance ratio (Zheng et al. 2025, "Group Sequence Policy Optimization").

    ``s_i = exp(mean_t (logprob - old_logprob))`` over the sequence's loss tokens
    (a length-normalised geometric mean of token ratios); the clipped objective
    of PPO is applied to ``s_i`` with the paper's tiny clip ranges. Written in
    the paper's token form ``s_i,t = sg[s_i] * pi(t) / sg[pi(t)]``, whose value
    is ``s_i`` and whose gradient is ``s_i * grad log pi(t)``, so the loss stays
    per token and any aggregation mode applies (the paper uses
    seq_mean_token_mean). Advantages are per sequence, (N, 1) or (N, T).
    """
    m = mask.to(logprobs.dtype)
    n = m.sum(-1, keepdim=True).clamp(min=1)
    seq_log_ratio = ((logprobs - old_logprobs) * m).sum(-1, keepdim=True) / n  # (N, 1)
    seq_ratio = torch.exp(seq_log_ratio.clamp(-20.0, 20.0))
    token_ratio = seq_ratio.detach() * torch.exp(logprobs - logprobs.detach())  # value s_i, gradient per token
    unclipped = -advantages * token_ratio
    clipped = -advantages * token_ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    clip_active = (clipped > unclipped).detach()
    adv = advantages.expand_as(loss)
    return loss, {"clipped_low": clip_active & (adv < 0), "clipped_high": clip_active & (adv > 0)}


def cispo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_low: float = 1.0,
    clip_high: float = 0.28,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO (MiniMax 2025, "MiniMax-M1"): clip the importance weight, not the update.

    ``loss_t = -sg[clip(ratio, 1 - clip_low, 1 + clip_high)] * A * logprob_t``.
    Every token keeps a gradient (REINFORCE form), only its weight is bounded.
    The paper sets no lower bound: ``clip_low = 1.0`` (weight >= 0) is that.
    """
    ratio = _ratio(logprobs, old_logprobs).detach()
    weight = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = -weight * advantages * logprobs
    adv = advantages.expand_as(loss)
    return loss, {
        "clipped_low": (ratio < 1.0 - clip_low) & (adv != 0),
        "clipped_high": (ratio > 1.0 + clip_high) & (adv != 0),
    }


def value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, *, clip: float | None = 0.2
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss of PPO (as in OpenAI baselines / verl), per token.

    ``0.5 * max((V - R)^2, (V_old + clip(V - V_old, -clip, clip) - R)^2)``;
    ``clip=None`` gives the plain ``0.5 * (V - R)^2``.
    """
    unclipped = (values - returns) ** 2
    if clip is None:
        return 0.5 * unclipped, {"value_clipped": torch.zeros_like(unclipped, dtype=torch.bool)}
    clipped_values = old_values + (values - old_values).clamp(-clip, clip)
    clipped = (clipped_values - returns) ** 2
    return 0.5 * torch.maximum(unclipped, clipped), {"value_clipped": (clipped > unclipped).detach()}


def aggregate(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    *,
    num_sequences: float,
    total_tokens: float | None = None,
    sequence_tokens: torch.Tensor | None = None,
    constant_normalizer: float | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss (N, T) to a scalar with normalisers fixed for the whole step.

    The normalisers are counts over the *whole step* (every micro-batch, every
    rank), passed in by the caller, so summing this over micro-batches gives
    exactly the one-batch loss:
    - ``token_mean``: ``sum_it mask * l / total_tokens`` (DAPO; every token weighs the same);
    - ``seq_mean_token_mean``: ``sum_i (sum_t mask * l / n_i) / num_sequences`` (GRPO paper;
      every sequence weighs the same). ``n_i`` is ``sequence_tokens[i]`` when given
      (per-rollout denominators: the loss tokens of the whole rollout a sample belongs
      to, for rollouts split into several training samples), else the sample's own count;
    - ``seq_mean_token_sum_norm``: ``sum_it mask * l / (num_sequences * constant_normalizer)``
      (Dr. GRPO: a constant, e.g. the generation budget, instead of the length, so
      long and short answers are not re-weighted).
    """
    m = mask.to(per_token.dtype)
    masked = per_token * m
    if mode == "token_mean":
        if total_tokens is None:
            raise ValueError("token_mean needs total_tokens (loss tokens in the whole step)")
        return masked.sum() / max(total_tokens, 1.0)
    if mode == "seq_mean_token_mean":
        n = sequence_tokens.to(per_token.dtype) if sequence_tokens is not None else m.sum(-1)
        return (masked.sum(-1) / n.clamp(min=1)).sum() / max(num_sequences, 1.0)
    if mode == "seq_mean_token_sum_norm":
        if not constant_normalizer:
            raise ValueError("seq_mean_token_sum_norm needs constant_normalizer (e.g. max_new_tokens)")
        return masked.sum() / (max(num_sequences, 1.0) * constant_normalizer)
    raise ValueError(f"unknown loss aggregation {mode!r}; expected one of {AGGREGATIONS}")


def rollout_correction(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    tis_cap: float | None = None,
    mis_low: float | None = None,
    mis_high: float | None = None,
    mis_level: str = "token",
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Correct for the engine sampling from a slightly different policy than the trainer's.

    ``w_t = pi_old(t) / pi_rollout(t)`` (trainer's pre-update logprob over the engine's).
    - truncated importance sampling (TIS; Yao et al. 2025, "Your efficient RL framework
      secretly brings you off-policy RL training"): the per-token loss is multiplied by
      ``min(w_t, tis_cap)`` (detached);
    - masked importance sampling (MIS, "IcePop"-style): tokens whose ``w_t`` leaves
      ``[mis_low, mis_high]`` are dropped from the loss; at ``mis_level="sequence"`` the
      test is on the sequence's geometric-mean ratio and drops the whole sequence.
    Returns (weight (N, T) detached, new mask (N, T), info with the raw ``w``).
    """
    log_w = (old_logprobs - rollout_logprobs).detach().clamp(-20.0, 20.0)
    w = torch.exp(log_w)
    weight = w.clamp(max=tis_cap) if tis_cap is not None else torch.ones_like(w)
    keep = mask.bool()
    if mis_low is not None or mis_high is not None:
        lo = mis_low if mis_low is not None else 0.0
        hi = mis_high if mis_high is not None else float("inf")
        if mis_level == "token":
            inside = (w >= lo) & (w <= hi)
        elif mis_level == "sequence":
            seq = torch.exp(sequence_mean(log_w, mask))
            inside = ((seq >= lo) & (seq <= hi)).expand_as(w)
        else:
            raise ValueError(f"mis_level must be 'token' or 'sequence', got {mis_level!r}")
        keep = keep & inside
    return weight, keep.to(mask.dtype), {"w": w}
