"""KL estimators between the policy and a reference policy, per token.

Pure tensor functions. All take per-token logprobs of the *sampled* tokens,
(N, T), and return a per-token estimate of KL(pi || pi_ref) (Schulman 2020,
"Approximating KL divergence"): with ``log_r = ref_logprob - logprob``,
- ``k1 = -log_r``: unbiased, high variance, can be negative;
- ``k2 = log_r^2 / 2``: biased, low variance, its gradient is the true KL gradient's;
- ``k3 = exp(log_r) - 1 - log_r``: unbiased and non-negative ("low-variance KL"
  of GRPO). strop clamps ``log_r`` to [-10, 10] and the value to <= 10, so a
  single wild token cannot blow up the loss. The peers differ: verl clamps the
  log-ratio to [-20, 20] and then the k3 value to [-10, 10]; slime clamps the
  k3 value to [-10, 10]. Below a log-ratio of 10 in size all three agree
  (docs/algorithms.md, "Conventions").
"""

from __future__ import annotations

import torch

KL_KINDS = ("k1", "k2", "k3")


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    log_r = ref_logprobs - logprobs  # log(pi_ref / pi) at the sampled token
    if kind == "k1":
        return -log_r
    if kind == "k2":
        return 0.5 * log_r**2
    if kind == "k3":
        log_r = log_r.clamp(-10.0, 10.0)
        return (torch.exp(log_r) - 1.0 - log_r).clamp(max=10.0)
    raise ValueError(f"unknown KL estimator {kind!r}; expected one of {KL_KINDS}")


def importance_weighted_kl(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "k3"
) -> torch.Tensor:
    """Unbiased KL(pi || pi_ref) when the tokens were sampled from pi_old, not pi.

    ``w_t * k(t)`` with ``w_t = pi(t) / pi_old(t)`` (detached): the estimators
    above are unbiased only under samples from pi itself; after the first
    update of a step (or with engine/trainer mismatch) the samples come from
    pi_old, and the importance weight corrects for it (DeepSeek-V3.2 report, 2025).
    """
    weight = torch.exp((logprobs - old_logprobs).clamp(-20.0, 20.0)).detach()
    return weight * kl_estimate(logprobs, ref_logprobs, kind)
