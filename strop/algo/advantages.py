"""Advantage estimators and discounted returns.

Pure tensor functions: no config objects, no torch.distributed. Shapes: N samples,
T response tokens (right-padded); ``mask`` is 1 at real response tokens.
"""

from __future__ import annotations

import torch

from strop.algo.kl import kl_estimate


def _group_stats(values: torch.Tensor, group_ids: torch.Tensor):
    """Per-sample group mean, group size and the index of each sample's group."""
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    sums = torch.zeros(len(counts), dtype=values.dtype).index_add_(0, inverse, values)
    return sums[inverse] / counts[inverse], counts[inverse], inverse, counts


def _check_outcome(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    if rewards.shape != group_ids.shape or rewards.dim() != 1:
        raise ValueError(f"rewards {tuple(rewards.shape)} and group_ids {tuple(group_ids.shape)} must be equal 1-D")
    return rewards.float()


def grpo_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, *, normalize_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO outcome advantages (Shao et al. 2024, "DeepSeekMath", section 4.1.2).

    ``A_i = (r_i - mean(r_group)) / (std(r_group) + eps)`` for every sample i of
    a group (samples sharing a group id). Deviations from the paper:
    - the std is the sample std (divide by n - 1), as torch.std, TRL and slime
      compute it; a group of one sample has std 0; eps = 1e-6 keeps all-equal
      groups at exactly 0 instead of 0/0;
    - ``normalize_std=False`` is Dr. GRPO (Liu et al. 2025, "Understanding
      R1-Zero-Like Training"), which only centres the rewards.
    The advantage is one scalar per sample, broadcast to its response tokens by the loss.

    rewards: (N,) float; group_ids: (N,) int. Returns (N,).
    """
    rewards = _check_outcome(rewards, group_ids)
    mean, _, inverse, counts = _group_stats(rewards, group_ids)
    centred = rewards - mean  # (N,)
    if not normalize_std:
        return centred
    squares = torch.zeros(len(counts), dtype=rewards.dtype).index_add_(0, inverse, centred**2)
    std = (squares / (counts - 1).clamp(min=1)).sqrt()[inverse]  # Bessel's correction; n = 1 gives 0
    return centred / (std + eps)


def rloo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """RLOO: REINFORCE with a leave-one-out baseline (Ahmadian et al. 2024, "Back to Basics").

    ``A_i = r_i - mean_{j != i} r_j = n / (n - 1) * (r_i - mean(r_group))``.
    A group of one sample has no baseline and gets advantage 0. No std scaling.
    """
    rewards = _check_outcome(rewards, group_ids)
    mean, n, _, _ = _group_stats(rewards, group_ids)
    n = n.to(rewards.dtype)
    return torch.where(n > 1, (rewards - mean) * n / (n - 1).clamp(min=1), torch.zeros_like(rewards))


def outcome_token_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Place each sample's scalar reward on its last response token: (N,) → (N, T)."""
    lengths = mask.sum(-1).long()  # (N,)
    out = torch.zeros_like(mask, dtype=torch.float32)
    has = lengths > 0
    rows = torch.arange(len(rewards))[has]
    out[rows, lengths[has] - 1] = rewards.float()[has]
    return out


def discounted_cumsum(x: torch.Tensor, factor: float, *, chunk_size: int = 64) -> torch.Tensor:
    """``y_t = x_t + factor * y_{t+1}`` along the last dim (y beyond the end is 0), vectorised.

    The sequence is cut into chunks of ``chunk_size`` tokens, processed right to
    left: inside a chunk the sum is one matmul with the upper-triangular matrix
    ``D[t, k] = factor^(k - t)`` (k >= t), and the chunk's start value carries
    ``factor^(C - t) * y_next`` from the chunk to its right. The Python loop runs
    over T / chunk_size chunks, not over tokens; powers stay bounded because a
    chunk is short. x: (N, T). Returns (N, T) in x's dtype.
    """
    N, T = x.shape
    if T == 0:
        return x.clone()
    xd = x.double()  # long chunks of powers lose precision in fp32
    out = torch.empty_like(xd)
    carry = torch.zeros(N, dtype=torch.float64)  # y at the first position right of the current chunk
    for end in range(T, 0, -chunk_size):
        start = max(0, end - chunk_size)
        C = end - start
        idx = torch.arange(C, dtype=torch.float64)
        exponent = idx.unsqueeze(0) - idx.unsqueeze(1)  # (C, C): k - t
        D = torch.where(
            exponent >= 0,
            torch.tensor(factor, dtype=torch.float64) ** exponent.clamp(min=0),
            torch.zeros((), dtype=torch.float64),
        )
        tail = factor ** (C - idx)  # (C,): factor^(C - t) reaches the carry
        out[:, start:end] = xd[:, start:end] @ D.T + carry.unsqueeze(1) * tail.unsqueeze(0)
        carry = out[:, start]
    return out.to(x.dtype)


def discounted_returns(
    token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0, *, chunk_size: int = 64
) -> torch.Tensor:
    """Returns ``G_t = r_t + gamma * G_{t+1}`` over each response; zero at padding. (N, T)."""
    return discounted_cumsum(token_rewards * mask, gamma, chunk_size=chunk_size) * mask


def gae(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    *,
    gamma: float = 1.0,
    lam: float = 0.95,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016).

    ``delta_t = r_t + gamma * V_{t+1} - V_t`` with V = 0 after the last response
    token (the episode ends there), ``A_t = delta_t + gamma * lam * A_{t+1}``,
    and the critic's target ``R_t = A_t + V_t``. Computed with
    :func:`discounted_cumsum`, not a loop over tokens. Masks must be
    contiguous (1s then 0s). Returns (advantages, returns), both (N, T), zero at padding.
    """
    values = values * mask
    next_values = torch.cat([values[:, 1:], torch.zeros_like(values[:, :1])], dim=1)  # V_{t+1}, 0 past the end
    deltas = (token_rewards + gamma * next_values - values) * mask
    advantages = discounted_cumsum(deltas, gamma * lam, chunk_size=chunk_size) * mask
    return advantages, (advantages + values) * mask


def whiten(x: torch.Tensor, mask: torch.Tensor, *, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """Normalise over all masked tokens of the batch: ``(x - mean) / (std + eps)`` (REINFORCE++, PPO).

    The std is the population std over masked tokens. ``shift_mean=False``
    keeps the mean (only scales). Zero at padding.
    """
    m = mask.to(x.dtype)
    n = m.sum().clamp(min=1)
    mean = (x * m).sum() / n
    var = (((x - mean) * m) ** 2).sum() / n
    out = (x - mean if shift_mean else x) / (var.sqrt() + eps)
    return out * m


def reinforce_pp_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    mask: torch.Tensor,
    *,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    gamma: float = 1.0,
    baseline: bool = False,
    chunk_size: int = 64,
) -> torch.Tensor:
    """REINFORCE++ (Hu et al. 2025) and REINFORCE++-baseline.

    Token rewards: the outcome reward on the last response token, and the KL
    penalty ``-kl_coef * kl_t`` on every token (KL folded into the reward).
    Returns ``G_t`` are discounted with ``gamma`` and then whitened over every
    response token of the batch (global batch normalisation, the paper's
    replacement for a critic). ``baseline=True`` first subtracts the group mean
    reward (REINFORCE++-baseline, for groups of n samples per prompt).
    rewards, group_ids: (N,); mask, kl: (N, T). Returns (N, T).
    """
    rewards = _check_outcome(rewards, group_ids)
    if baseline:
        rewards = rewards - _group_stats(rewards, group_ids)[0]
    token_rewards = outcome_token_rewards(rewards, mask)
    if kl is not None and kl_coef:
        token_rewards = token_rewards - kl_coef * kl * mask
    returns = discounted_returns(token_rewards, mask, gamma, chunk_size=chunk_size)
    return whiten(returns, mask)


SCALAR_ESTIMATORS = ("grpo", "dr_grpo", "rloo")  # one advantage per sample, broadcast to its tokens


def action_compaction(actions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each row's action tokens are: ``index`` (N, A) of their positions in order, and the
    compact mask (N, A) of real entries (A = most actions in a row). Gather with
    ``x.gather(1, index) * cmask``; put back with :func:`scatter_actions`."""
    m = actions > 0
    counts = m.sum(-1)
    A = int(counts.max()) if counts.numel() else 0
    order = torch.argsort((~m).to(torch.int8), dim=-1, stable=True)  # action positions first, in order
    cmask = (torch.arange(A).unsqueeze(0) < counts.unsqueeze(1)).to(torch.float32)
    return order[:, :A], cmask


def scatter_actions(values: torch.Tensor, index: torch.Tensor, cmask: torch.Tensor, T: int) -> torch.Tensor:
    return torch.zeros(values.shape[0], T, dtype=values.dtype).scatter(1, index, values * cmask.to(values.dtype))


def compute_advantages(
    algo,
    *,
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    response_mask: torch.Tensor,
    loss_mask: torch.Tensor,
    policy_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    old_values: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The configured estimator over one step's batch: (advantages (N, T), critic returns (N, T) or None).

    ``algo`` is an AlgoConfig (estimator, normalize_std, gamma, lam, kl_in_reward_*).
    ``policy_logprobs`` is the policy side of a KL folded into the reward (the
    pre-update trainer's logprobs, or the engine's); ``old_values`` the critic's (PPO).

    The rule for tokens the model did not choose (``loss_mask`` 0: tool output, a plugin's
    masked prefix): they are not actions. Every estimator sees only the action tokens, in
    order, as if the others were not there. So the outcome reward sits on the last action
    token; the KL penalty, discounting and GAE's recursion (``V_{t+1}`` is the next *action*'s
    value) run over actions only; every whitening mean and std is over actions only; and
    advantages and critic targets are 0 at non-action tokens. With no masked token this is the
    textbook estimator, unchanged.
    """
    a, est = algo, algo.estimator
    actions = loss_mask * response_mask
    if est in SCALAR_ESTIMATORS:
        if est == "rloo":
            scalar = rloo_advantages(rewards, group_ids)
        else:
            scalar = grpo_advantages(rewards, group_ids, normalize_std=a.normalize_std and est == "grpo")
        return scalar.unsqueeze(-1) * actions, None
    T = actions.shape[1]
    index, cmask = action_compaction(actions)
    pick = lambda x: x.gather(1, index) * cmask.to(x.dtype)  # noqa: E731  (N, T) -> (N, A)
    kl = None
    if a.kl_in_reward_coef:
        kl = pick(kl_estimate(policy_logprobs, ref_logprobs, a.kl_in_reward_kind))
    if est in ("reinforce_pp", "reinforce_pp_baseline"):
        adv = reinforce_pp_advantages(
            rewards,
            group_ids,
            cmask,
            kl=kl,
            kl_coef=a.kl_in_reward_coef,
            gamma=a.gamma,
            baseline=est == "reinforce_pp_baseline",
        )
        return scatter_actions(adv, index, cmask, T), None
    if est == "ppo":
        token_rewards = outcome_token_rewards(rewards, cmask)
        if kl is not None:
            token_rewards = token_rewards - a.kl_in_reward_coef * kl
        advantages, returns = gae(token_rewards, pick(old_values), cmask, gamma=a.gamma, lam=a.lam)
        return (scatter_actions(whiten(advantages, cmask), index, cmask, T), scatter_actions(returns, index, cmask, T))
    raise ValueError(f"unknown advantage estimator {est!r}")


def explained_variance(returns: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> float:
    """How much of the return the critic predicted: ``1 - Var(R - V) / Var(R)`` over masked tokens.

    1 is perfect, <= 0 is no better than a constant (the usual PPO diagnostic; the raw
    value loss moves with the reward variance). 0 when the returns do not vary.
    """
    r, v = returns[mask > 0], values[mask > 0]
    var = r.var(unbiased=False)
    return (1 - (r - v).var(unbiased=False) / var).item() if var > 0 else 0.0
