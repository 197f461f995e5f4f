"""The policy objective of one micro-batch, as a pure function: tensors and settings in, loss out.

Read top to bottom, it is the equation list of the step (all per token, (n, T)):

1. rollout correction   w_t = min(pi_old / pi_rollout, C)  (TIS);  m'_t = m_t * [w_t in range]  (MIS; IcePop,
                        geometric sequence masking as presets);  m'_t *= OPSM's sequence mask
2. policy loss          l_t = PPO-clip | GSPO | CISPO | DPPO (against pi_rollout) | a plugin (logprobs, old, A)
3. policy term          L_pg = agg(w * l, m')  (DPPO: agg(l, m'), its ratio pi/pi_rollout already holds
                        pi_old/pi_rollout, and TIS caps that factor inside it: ``dppo_loss``)
4. KL to the reference  k_t = KL_est(pi, pi_ref)  (optionally * pi / pi_old)
5. total                L = L_pg + beta * agg(k, m) - c_H * agg(H, m)

``agg`` uses normalisers counted over the whole optimizer step (every micro-batch,
every rank), so summing L over micro-batches gives the one-batch loss exactly.
No torch.distributed, no config parsing, no module calls: the trainer computes
the logprobs and passes them in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from strop.algo.kl import importance_weighted_kl, kl_estimate
from strop.algo.losses import aggregate, cispo_loss, gspo_loss, ppo_clip_loss, rollout_correction
from strop.algo.offpolicy import GEO_MASK_BOUNDS, ICEPOP_BOUNDS, dppo_loss, opsm_mask


@dataclass(frozen=True)
class Normalisers:
    """Denominators of the step's loss, fixed before any micro-batch runs."""

    num_sequences: float  # samples in the optimizer step
    total_tokens: float  # loss tokens in the optimizer step
    constant: float  # seq_mean_token_sum_norm's constant (the generation budget by default)


def policy_objective(
    logprobs: torch.Tensor,
    entropy: torch.Tensor | None,
    *,
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor | None,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    norms: Normalisers,
    algo,
    loss_fn: Callable | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Loss of one micro-batch, its policy-gradient part, and detached per-token statistics.

    ``algo`` carries the settings (an AlgoConfig: policy_loss, clip ranges, TIS/MIS,
    KL and entropy coefficients, aggregation). ``loss_fn(logprobs, old, advantages,
    mask) -> (per_token, info)`` replaces the built-in policy loss (the plugin hook).
    Statistics: clipped_low, clipped_high, [dual_clipped], importance_weight,
    mis_dropped, approx_kl_old, [kl_ref] — each (n, T), to be averaged over ``loss_mask``.
    """
    a, mask, old = algo, loss_mask, old_logprobs
    agg = dict(
        num_sequences=norms.num_sequences,
        total_tokens=norms.total_tokens,
        constant_normalizer=norms.constant,
        sequence_tokens=mask.sum(-1),
    )
    # 1. the engine sampled from pi_rollout, the ratio's denominator is pi_old
    settings = correction_settings(a)
    weight, kept, corr = rollout_correction(old, rollout_logprobs, mask, **settings)
    mis_dropped, opsm_dropped = (mask - kept).clamp(min=0), None
    if a.opsm_delta is not None:
        opsm = opsm_mask(logprobs, rollout_logprobs, advantages, mask, delta=a.opsm_delta)
        opsm_dropped = (mask - opsm).clamp(min=0)
        kept = kept * opsm
    # 2. the per-token policy loss
    per_token, info, weight = _policy_loss(
        logprobs, old, rollout_logprobs, advantages, kept, weight, corr, settings, algo=a, loss_fn=loss_fn
    )
    # 3. the policy-gradient term
    pg_loss = aggregate(per_token if weight is None else per_token * weight, kept, a.loss_agg, **agg)
    loss = pg_loss
    stats = {
        "clipped_low": info.get("clipped_low", torch.zeros_like(mask, dtype=torch.bool)).float(),
        "clipped_high": info.get("clipped_high", torch.zeros_like(mask, dtype=torch.bool)).float(),
        "importance_weight": corr["w"],
        "mis_dropped": mis_dropped,
    }
    if "dual_clipped" in info:
        stats["dual_clipped"] = info["dual_clipped"].float()
    if opsm_dropped is not None:
        stats["opsm_dropped"] = opsm_dropped
    # 4. the KL to the reference policy
    if ref_logprobs is not None:
        kl = (
            importance_weighted_kl(logprobs, old, ref_logprobs, a.kl_kind)
            if a.kl_importance_weighted
            else kl_estimate(logprobs, ref_logprobs, a.kl_kind)
        )
        if a.kl_coef:
            loss = loss + a.kl_coef * aggregate(kl, mask, a.loss_agg, **agg)
        stats["kl_ref"] = kl_estimate(logprobs, ref_logprobs, a.kl_kind).detach()
    # 5. the entropy bonus
    if a.entropy_coef:
        loss = loss - a.entropy_coef * aggregate(entropy, mask, a.loss_agg, **agg)
    stats["approx_kl_old"] = kl_estimate(logprobs, old, "k3").detach()
    return loss, pg_loss, stats


def _policy_loss(
    logprobs: torch.Tensor,
    old: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    kept: torch.Tensor,
    weight: torch.Tensor,
    corr: dict,
    settings: dict,
    *,
    algo,
    loss_fn: Callable | None,
) -> tuple[torch.Tensor, dict, torch.Tensor | None]:
    """Step 2: the per-token policy loss, its info, and the behaviour weight the policy term applies
    (None for DPPO, whose ratio holds it already)."""
    a = algo
    if loss_fn is not None:
        per_token, info = loss_fn(logprobs, old, advantages, kept)
    elif a.policy_loss == "ppo_clip":
        per_token, info = ppo_clip_loss(
            logprobs, old, advantages, clip_low=a.clip_low, clip_high=a.clip_high, dual_clip=a.dual_clip
        )
    elif a.policy_loss == "gspo":
        per_token, info = gspo_loss(logprobs, old, advantages, kept, clip_low=a.clip_low, clip_high=a.clip_high)
    elif a.policy_loss == "cispo":
        per_token, info = cispo_loss(logprobs, old, advantages, clip_low=a.clip_low, clip_high=a.clip_high)
    elif a.policy_loss == "dppo":
        # DPPO's ratio is against pi_rollout: it holds the behaviour weight pi_old/pi_rollout already, so the
        # weight is not applied again (it would make the gradient go as (pi/pi_rollout)^2); TIS (and IcePop's
        # cap) truncate that factor inside the ratio, MIS / IcePop / OPSM still mask through `kept`
        capped = weight / corr["w"] if settings["tis_cap"] is not None else None  # min(w, C) / w, detached
        per_token, info = dppo_loss(
            logprobs,
            rollout_logprobs,
            advantages,
            mask_low=a.dppo_mask_low,
            mask_high=a.dppo_mask_high,
            kl_coef=a.dppo_kl_coef,
            scale=capped,
        )
        weight = None
    else:
        raise ValueError(f"unknown policy loss {a.policy_loss!r}")
    return per_token, info, weight


def correction_settings(algo) -> dict:
    """``rollout_correction``'s settings for ``algo``, its named presets resolved: IcePop keeps a token whose
    ratio lies in [mis_low, mis_high] (AReaL's 0.5 and 5 unless set) and weighs it by that ratio (a TIS cap
    at the upper bound); geometric sequence masking keeps a sequence whose geometric-mean ratio lies in the
    band (SkyRL's 0.99 and 1.01 unless set)."""
    a = algo
    preset = a.off_policy_correction
    if preset == "icepop":
        low, high = (
            a.mis_low if a.mis_low is not None else ICEPOP_BOUNDS[0],
            a.mis_high if a.mis_high is not None else ICEPOP_BOUNDS[1],
        )
        return dict(tis_cap=high, mis_low=low, mis_high=high, mis_level="token")
    if preset == "geo_mask":
        return dict(
            tis_cap=a.tis_cap,
            mis_low=a.mis_low if a.mis_low is not None else GEO_MASK_BOUNDS[0],
            mis_high=a.mis_high if a.mis_high is not None else GEO_MASK_BOUNDS[1],
            mis_level="sequence",
        )
    return dict(tis_cap=a.tis_cap, mis_low=a.mis_low, mis_high=a.mis_high, mis_level=a.mis_level)
