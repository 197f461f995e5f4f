"""Corrections for tokens sampled by another policy than the one being trained: an older one (async
rollout, several mini-batches) or a numerically different one (the engine's kernels, bf16).

Pure tensor functions, like :mod:`strop.algo.losses`. Notation, per token (N, T): ``behaviour`` = the
rollout's logprobs (the policy that sampled, mu), ``proximal`` / ``old`` = the trainer's logprobs before
this update (pi_old), ``logprobs`` = the current policy's (pi, with gradient), ``mask`` = loss mask.
Every sequence statistic is a mean over that sequence's loss tokens; an all-masked sequence gives 0,
never NaN. A mask returned here only removes tokens from the loss's numerator: the step's normalisers
(:class:`strop.algo.objective.Normalisers`) are counted before it, so masked tokens stay in the
denominator, as slime, AReaL and prime-rl do.
"""

from __future__ import annotations

import torch

# IcePop (Ling team 2025, "Every Step Evolves", arXiv 2510.18855): AReaL's and verl's bounds
ICEPOP_BOUNDS = (0.5, 5.0)
# geometric sequence masking: SkyRL's default band (``geo_mask_low`` / ``geo_mask_high``)
GEO_MASK_BOUNDS = (0.99, 1.01)


def sequence_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over each row's masked tokens, (N, 1); 0 for a row with no token."""
    m = mask.to(x.dtype)
    return (x * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1)


def opsm_mask(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *, delta: float
) -> torch.Tensor:
    """Off-policy sequence masking (OPSM; DeepSeek-AI 2025, "DeepSeek-V3.2", arXiv 2512.02556; slime's
    ``--use-opsm``): a sequence is left out of the loss when its advantage is negative and it has
    drifted from the policy that scored it:

    ``KL_i = mean_t m (log pi_old - log pi)`` (the k1 estimate of KL(pi_old || pi), over loss tokens);
    token t of sequence i is masked when ``A_it < 0`` and ``KL_i > delta``.

    ``old_logprobs`` is the sampling side (the rollout's logprobs, or the trainer's pre-update ones),
    ``logprobs`` the current policy; nothing here carries a gradient. Advantages (N, 1) or (N, T).
    Returns the new mask (N, T), ``mask``'s dtype.
    """
    kl = sequence_mean((old_logprobs - logprobs).detach(), mask)  # (N, 1)
    drop = (advantages < 0) & (kl > delta)
    return (mask.bool() & ~drop.expand_as(mask)).to(mask.dtype)


def dppo_loss(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    mask_low: float = 0.2,
    mask_high: float = 0.2,
    kl_coef: float = 1e-3,
    scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPPO, Binary-TV form (Qi et al. 2026, "Rethinking the Trust Region in LLM Reinforcement Learning",
    arXiv 2602.04879), as prime-rl's default loss computes it (``default_loss_fn`` in prime-rl's
    ``src/prime_rl/trainer/rl/loss.py``): the trust region is a bound on the *probability* change of
    the sampled token, not on the ratio.

    ``r = pi / mu`` (not clipped), ``d = pi - mu`` (probabilities, detached);
    a token is masked when ``A > 0 and d > mask_high`` or ``A <= 0 and d < -mask_low``;
    ``loss_t = -keep_t A_t r_t + kl_coef (log pi - log mu)^2`` (the squared-log term on every token,
    masked ones included, as prime-rl does).

    ``r`` already carries the behaviour weight ``pi_old / mu`` (``r = (pi / pi_old)(pi_old / mu)``), so a
    correction must not multiply it in again (the gradient would go as ``r^2``). Truncated importance
    sampling with cap C acts on that factor inside the one ratio: ``r = (pi / pi_old) min(pi_old / mu, C)``,
    i.e. ``r`` times ``scale`` = the detached ``min(w, C) / w`` (w = pi_old / mu, from
    :func:`strop.algo.losses.rollout_correction`); the squared-log term stays unweighted, as in prime-rl.

    Deviation from prime-rl: its advantage scale ``adv_tau`` is left out (scale the rewards instead).
    Returns the per-token loss and the indicators ``clipped_low`` (A <= 0 masked) and ``clipped_high``.
    """
    log_ratio = logprobs - behaviour_logprobs
    ratio = torch.exp(log_ratio.clamp(-20.0, 20.0))  # (N, T), pi / mu with gradient
    if scale is not None:  # min(w, C) / w: 1 below the cap, so an untruncated token keeps prime-rl's pi/mu
        ratio = ratio * scale
    d = (torch.exp(logprobs) - torch.exp(behaviour_logprobs)).detach()
    adv = advantages.expand_as(ratio)
    high = (adv > 0) & (d > mask_high)
    low = (adv <= 0) & (d < -mask_low)
    keep = ~(high | low)
    loss = -torch.where(keep, adv * ratio, torch.zeros_like(ratio)) + kl_coef * log_ratio**2
    return loss, {"clipped_low": low.detach(), "clipped_high": high.detach()}


def loglinear_proximal(
    behaviour_logprobs: torch.Tensor, logprobs: torch.Tensor, versions: torch.Tensor, current_version: int
) -> torch.Tensor:
    """The proximal policy's logprobs without a forward pass (AReaL's ``prox_logp_method=loglinear``,
    Fu et al. 2025, arXiv 2505.24298): log-linear interpolation between the policy that sampled each
    token (weights version ``v_t``) and the policy being trained (``current_version`` v: the version
    this step's update produces), at the proximal version ``v - 1`` (the weights the step starts from):

    ``alpha_t = clamp((v - 1 - v_t) / (v - v_t), 0, 1)`` (0 where ``v_t >= v``, and for a token one
    version old, whose sampler *is* the proximal policy);
    ``log pi_prox = log mu + alpha_t (sg[log pi] - log mu)``.

    ``versions`` (N, T): the weight version each token was sampled at (``Sample.weight_versions``).
    """
    v = torch.as_tensor(current_version, dtype=torch.float64, device=versions.device)
    vt = versions.to(torch.float64)
    span = v - vt
    alpha = torch.where(span > 0, ((v - 1 - vt) / span.clamp(min=1)).clamp(0.0, 1.0), torch.zeros_like(span))
    return behaviour_logprobs + alpha.to(logprobs.dtype) * (logprobs.detach() - behaviour_logprobs)


def overlong_penalty(lengths: torch.Tensor, *, max_new_tokens: int, buffer: int, factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, arXiv 2503.14476), added to the reward:

    ``0`` while ``len <= L - B``; ``-factor (len - (L - B)) / B`` inside the last B tokens before the
    limit L (``-factor`` at the limit, where a truncated response ends); by length alone, truncated
    or not. ``lengths`` (N,), response tokens; returns (N,) float.
    """
    if not 0 < buffer <= max_new_tokens:
        raise ValueError(f"the overlong buffer must be in 1..max_new_tokens={max_new_tokens}, got {buffer}")
    over = (lengths.to(torch.float32) - (max_new_tokens - buffer)).clamp(min=0.0, max=float(buffer))
    return -factor * over / buffer


def distillation_advantages(
    student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, mask: torch.Tensor, *, coef: float = 1.0
) -> torch.Tensor:
    """On-policy distillation (Thinking Machines 2025, "On-Policy Distillation"; slime's ``--use-opd``):
    the per-token reverse KL of the sampled token, ``log pi_student - log pi_teacher``, as a negative
    advantage with no discount: ``A_t = -coef (log pi_student(t) - log pi_teacher(t))`` on loss tokens,
    0 elsewhere. Added to the task's advantages (or alone, for pure distillation)."""
    return -coef * (student_logprobs - teacher_logprobs).detach() * mask.to(student_logprobs.dtype)
