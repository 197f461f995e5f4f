"""The policy's update: one optimizer step of the trainer's policy on one mini-batch of the step batch."""

from __future__ import annotations

import torch

from strop.algo.objective import Normalisers, policy_objective
from strop.algo.offpolicy import loglinear_proximal
from strop.observe.metrics import StepStats
from strop.plugins import call_hook_sync
from strop.train.batch import StepBatch


def _plugin_loss(fn):
    def loss(logprobs, old, advantages, mask):
        return call_hook_sync("policy_loss", fn, logprobs=logprobs, old_logprobs=old, advantages=advantages, mask=mask)

    return loss


def train_policy(trainer, b: StepBatch, mini: list[int], m: StepStats, first: bool, n_mini: int) -> None:
    """One optimizer step of ``trainer``'s policy on the samples ``mini`` of ``b`` (micro-batches, gradient
    accumulation; :func:`strop.algo.objective.policy_objective` with normalisers counted over the whole
    mini-batch first), measured into the step's stats ``m``."""
    a = trainer.algo
    norms = Normalisers(
        float(len(mini)), float(b.loss_mask[mini].sum()), float(a.loss_agg_constant or trainer.max_new_tokens)
    )
    # a sample with zero advantage everywhere contributes zero gradient to the policy loss;
    # skip its forward unless a KL or entropy term gives it a gradient anyway (DPPO's squared-log term too)
    kl_anyway = a.kl_coef or a.entropy_coef or (a.policy_loss == "dppo" and a.dppo_kl_coef)
    active = mini if kl_anyway else [i for i in mini if bool((b.advantages[i] != 0).any())]
    has_signal = bool(active)
    active = active or mini[: trainer.cfg.micro_batch_size]  # measure one micro-batch anyway for the metrics
    for idx, real in trainer.dp.share(trainer._micro_batches(active, b.samples)):
        batch = trainer._collate([b.samples[i] for i in idx])
        mask = batch["loss_mask"]
        Tm = mask.shape[1]
        rows = lambda t: t[idx, :Tm].to(trainer.device) if t is not None else None  # noqa: E731
        logprobs, entropy = trainer._logprobs(
            trainer.policy, batch, with_entropy=True, entropy_grad=bool(a.entropy_coef), replay=True
        )
        old = rows(b.old_logprobs) if b.old_logprobs is not None else logprobs.detach()
        if a.proximal == "loglinear":  # this step turns weights v - 1 into v
            old = loglinear_proximal(batch["rollout_logprobs"], logprobs, rows(b.versions), trainer.steps_done + 1)
        loss, pg_loss, tok = policy_objective(
            logprobs,
            entropy,
            old_logprobs=old,
            rollout_logprobs=batch["rollout_logprobs"],
            ref_logprobs=rows(b.ref_logprobs),
            advantages=rows(b.advantages),
            loss_mask=mask,
            norms=norms,
            algo=a,
            loss_fn=_plugin_loss(trainer.policy_loss_fn) if trainer.policy_loss_fn is not None else None,
        )
        if has_signal:
            scale = trainer.dp.loss_scale(real)
            (loss * scale if scale != 1.0 else loss).backward()
        if not real:
            continue  # a balancing repeat: it joined the collectives, it is not measured
        with torch.no_grad():  # the step's loss is the mean over its mini-batches, not their sum
            m.add("policy_loss", pg_loss.item() / n_mini if has_signal else 0.0)
            m.add("loss", loss.item() / n_mini if has_signal else 0.0)
            # engine vs trainer on the same weights: the pre-pass, or this pass before any update
            if b.trainer_old_logprobs is not None:
                m.tok(
                    "train_rollout_logprob_abs_diff",
                    (rows(b.trainer_old_logprobs) - batch["rollout_logprobs"]).abs(),
                    mask,
                )
            elif first:
                m.tok("train_rollout_logprob_abs_diff", (logprobs - batch["rollout_logprobs"]).abs(), mask)
            m.tok("entropy", entropy, mask)
            m.policy_tokens(tok, mask)
            tokens = float(batch["tokens"] if "tokens" in batch else batch["attention_mask"].sum())
            m.add("train_tokens", tokens)
            if trainer.shared_prefix:  # what the same samples take in rows of their own
                m.add("train_tokens_unshared", float(batch.get("tokens_unshared", tokens)))
            m.add("trained_samples", float(len(idx)) if has_signal else 0.0)
    m.last("lr", trainer.policy_opt.lr)
    m.last("grad_norm", trainer.policy_opt.step(m) if has_signal else 0.0)
