"""The trainer: a batch of scored Samples → advantages → optimizer step(s).

Per step: (1) forward passes on the pre-update weights (old policy, reference, critic values)
where needed; (2) the advantage estimator; (3) per mini-batch, micro-batches with gradient
accumulation and one optimizer step (loss: :func:`strop.algo.objective.policy_objective`,
normalisers counted over the whole mini-batch first); (4) the critic's update (PPO).
Which micro-batches this process runs and how ranks combine is the data-parallel
strategy's business (:mod:`strop.parallel.strategy`); no torch.distributed here.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch
from torch import nn

from strop.algo.advantages import compute_advantages, explained_variance
from strop.observe.metrics import StepStats, advantage_stats
from strop.parallel import context as context_parallel
from strop.parallel.packing import collate_packed, unpack
from strop.parallel import prefix
from strop.parallel.strategy import SingleProcess
from strop.plugins import call_hook_sync
from strop.train.batch import StepBatch, collate, pad_rows, split_micro_batches, swapped_weights, to_device
from strop.train.critic import critic_values, train_critic
from strop.train.modules import Modules, build_modules
from strop.train.optim import GuardedOptimizer, NonFiniteGradientError
from strop.train.policy import train_policy
from strop.train.routing_replay import RoutingReplay
from strop.types import Sample

__all__ = ["Trainer", "Sampling", "NonFiniteGradientError", "collate", "swapped_weights"]


@dataclass(frozen=True)
class Sampling:
    """What the trainer needs of the rollout (the rollout config section has these fields too)."""

    temperature: float = 1.0  # the logits are scaled by it
    max_new_tokens: int = 1024  # the response length limit (overlong shaping, the constant loss normaliser)
    exact_logprobs: bool = False  # report the trainer's logprobs as the sampler's (StepBatch.take_trainer_logprobs)


class Trainer:
    def __init__(self, model, *, pad_token_id: int, train, algo, rollout=None, parallel=None, hooks=None, teacher=None):
        """``model``: the :class:`strop.train.modules.Modules` to step, split over the run's mesh before they came
        (build_modules), or a whole model, built into them here. ``train``, ``algo``: the config sections;
        ``rollout``: the rollout section or a :class:`Sampling`. ``parallel``: the data-parallel strategy
        (strop.parallel.strategy.make_strategy; default one process on the CPU). ``hooks``: plugins by hook name
        ('advantage' and 'policy_loss' replace the estimator and the policy loss). On-policy distillation's
        ``teacher``: a model (frozen here; beside a whole ``model`` only) or a server's (RemoteTeacher)."""
        self.dp = parallel or SingleProcess()
        self.device = self.dp.device
        rollout, hooks = rollout or Sampling(), hooks or {}
        self.advantage_fn, self.policy_loss_fn = hooks.get("advantage"), hooks.get("policy_loss")
        self.pad_token_id, self.cfg, self.algo, self.max_new_tokens = pad_token_id, train, algo, rollout.max_new_tokens
        self.temperature = rollout.temperature if rollout.temperature > 0 else 1.0
        self.autocast, self.exact_logprobs = train.bf16_autocast, rollout.exact_logprobs
        local = isinstance(teacher, nn.Module)
        if isinstance(model, Modules) and local:
            raise ValueError("a teacher model is built into the modules (build_modules), not given beside them")
        m = (
            model
            if isinstance(model, Modules)
            else build_modules(model, self.dp, algo, train, teacher=teacher if local else None)
        )
        self.model, self.policy, self.ref, self.ref_state, self.critic = m.model, m.policy, m.ref, m.ref_state, m.critic
        self.teacher, self.remote_teacher = m.teacher, None if local else teacher  # on-policy distillation's, either
        self.adapters, self.ref_off = m.adapters, m.ref_off  # LoRA: what trains; the reference is them off
        if self.critic is not None:
            self.critic_opt = GuardedOptimizer("critic", self.critic, algo.critic_lr, train, self.dp)
        self.policy_opt = GuardedOptimizer("policy", self.model, train.lr, train, self.dp)
        self.steps_done = 0
        attn = getattr(getattr(self.model, "config", None), "_attn_implementation", None)
        self.shared_prefix_off = prefix.off_reason(train.shared_prefix, self.dp.cp_size, attn)  # '' when on
        self.shared_prefix = not self.shared_prefix_off
        self.replay = RoutingReplay.of_policy(self.model, algo.routing_replay)  # MoE: R3, or how far off without

    def describe_layout(self) -> str:
        """How micro-batches are laid out, for the start lines."""
        return prefix.describe(self.cfg.micro_batch_size, self.cfg.max_tokens_per_micro_batch, self.shared_prefix_off)

    # the strategy's shape, for callers that print or branch on it
    cp_size = property(lambda self: self.dp.cp_size)
    world = property(lambda self: self.dp.world)
    optimizer = property(lambda self: self.policy_opt.optimizer)
    scheduler = property(lambda self: self.policy_opt.scheduler)
    critic_optimizer = property(lambda self: self.critic_opt.optimizer)

    # ---- forward passes -------------------------------------------------------------------------
    def _micro_batches(self, indices, samples) -> list[list[int]]:
        split = prefix.split_by_group if self.shared_prefix else split_micro_batches
        return split(list(indices), samples, self.cfg.micro_batch_size, self.cfg.max_tokens_per_micro_batch)

    def _collate(self, samples: list[Sample]) -> dict:
        if self.shared_prefix and prefix.shares(samples):  # each group's common prefix once (strop.parallel.prefix)
            batch = prefix.collate_shared_prefix(samples)
        elif self.cfg.max_tokens_per_micro_batch:  # under CP the plan builds its own, smaller mask
            batch = collate_packed(samples, with_mask=self.cp_size == 1)
        else:
            batch = collate(samples, self.pad_token_id)
        if self.cp_size > 1:
            batch["cp"] = context_parallel.ContextParallelPlan.for_batch(batch, self.dp.cp_group)
        return to_device(batch, self.device)

    def _precision(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16) if self.autocast else contextlib.nullcontext()

    def _logprobs(self, module, batch, *, with_entropy=False, entropy_grad=False, temperature=None, replay=False):
        """``replay``: the policy's own forward (its old and new logprobs), which routing replay routes (R3)."""
        routes = self.replay.around(batch) if replay and self.replay is not None else contextlib.nullcontext()
        with self._precision(), routes:
            lp, ent = module(
                batch["input_ids"],
                batch["attention_mask"],
                batch["positions"],
                batch.get("position_ids"),
                temperature=temperature or self.temperature,
                with_entropy=with_entropy,
                entropy_grad=entropy_grad,
                chunk_size=self.cfg.logprob_chunk_size,
                cp=batch.get("cp"),
                pred_positions=batch.get("pred_positions"),
            )
        lp, ent = lp.float(), (ent.float() if ent is not None else None)
        if "scatter" in batch:  # a packed row back to (n, T)
            lp, ent = unpack(lp, batch), (unpack(ent, batch) if ent is not None else None)
        return lp, ent

    @torch.no_grad()
    def _pre_pass(self, b: StepBatch, need_old: bool) -> dict[str, torch.Tensor]:
        """Everything that must see pre-update weights: old, reference and teacher logprobs, critic values
        (none: {}, and no forward pass). Ranks split the micro-batches (as in training); the strategy merges their disjoint rows."""
        wanted = [
            k
            for k, on in (
                ("old", need_old),
                ("ref", self.ref is not None or self.ref_state is not None or self.ref_off),
                ("teacher", self.teacher is not None),
                ("values", self.critic is not None),
            )
            if on
        ]
        if not wanted:
            return {}
        out = {k: torch.zeros(b.shape, device=self.device) for k in wanted}
        for idx, real in self.dp.share(self._micro_batches(range(len(b.samples)), b.samples)):
            batch = self._collate([b.samples[i] for i in idx])  # under FSDP every forward is a collective:
            found = {}  # balancing repeats run them too, and their rows are not kept
            if need_old:
                found["old"] = self._logprobs(self.policy, batch, replay=True)[0]
            if self.ref is not None:
                found["ref"] = self._logprobs(self.ref, batch)[0]
            elif self.ref_state is not None:
                with swapped_weights(self.model, self.ref_state):
                    found["ref"] = self._logprobs(self.policy, batch)[0]
            elif self.ref_off:
                with self.adapters.disabled():
                    found["ref"] = self._logprobs(self.policy, batch)[0]
            if self.teacher is not None:
                found["teacher"] = self._logprobs(self.teacher, batch, temperature=self.algo.distill_temperature)[0]
            if self.critic is not None:
                found["values"] = critic_values(self, batch)
            if real:
                rows = torch.tensor(idx, device=self.device)
                for k, v in found.items():
                    out[k][rows, : v.shape[1]] = v
        self.dp.merge_rows(list(out.values()))
        return {k: v.cpu() * b.response_mask for k, v in out.items()}

    def _advantages(self, b: StepBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.advantage_fn is not None:
            out = call_hook_sync(
                "advantage", self.advantage_fn, rewards=b.rewards, group_ids=b.group_ids, mask=b.response_mask
            )
            return (out.unsqueeze(-1) if out.dim() == 1 else out).float() * b.response_mask, None
        policy_lp = b.old_logprobs if b.old_logprobs is not None else b.rollout_logprobs
        return compute_advantages(
            self.algo,
            rewards=b.rewards,
            group_ids=b.group_ids,
            response_mask=b.response_mask,
            loss_mask=b.loss_mask,
            policy_logprobs=policy_lp,
            ref_logprobs=b.ref_logprobs,
            old_values=b.old_values,
        )

    # ---- the step -------------------------------------------------------------------------------
    def step(self, samples: list[Sample]) -> dict[str, float]:
        """Train on ``samples``. Only COMPLETED and TRUNCATED samples reach the loss."""
        t0 = time.perf_counter()
        samples = [s for s in samples if s.status.trainable]
        if not samples or not any(any(s.loss_mask) for s in samples):
            raise ValueError("no trainable tokens in this step (every sample aborted, failed or fully masked)")
        b, a = StepBatch.of(samples), self.algo
        if self.replay is not None:  # every trainable sample carries the engine's routes
            self.replay.check(samples)
        shaped = b.shape_overlong(self.max_new_tokens, a.overlong_buffer, a.overlong_penalty)
        # pi_old: the pre-update trainer (with one optimizer step and no KL-in-reward, the current weights)
        need_old = (
            self.exact_logprobs
            or not a.use_rollout_logprobs
            and (self.cfg.mini_batches > 1 and a.proximal == "recompute" or bool(a.kl_in_reward_coef))
        )
        pre = self._pre_pass(b, need_old)
        b.old_logprobs = b.trainer_old_logprobs = pre.get("old")
        gap = {"engine_logprob_abs_diff": b.take_trainer_logprobs()} if self.exact_logprobs else {}
        b.ref_logprobs, b.old_values, b.teacher_logprobs = pre.get("ref"), pre.get("values"), pre.get("teacher")
        if self.remote_teacher is not None:  # a server scores the samples (strop.engines.teacher)
            b.teacher_logprobs = pad_rows(self.remote_teacher(b.samples), b.shape[1]) * b.response_mask
        b.old_logprobs = b.rollout_logprobs if a.use_rollout_logprobs else b.old_logprobs  # the engine's stand in
        b.advantages, b.returns = self._advantages(b)
        if b.teacher_logprobs is not None:  # on-policy distillation: the teacher's view of each token
            shaped |= b.distill(a.distill_coef, only=a.distill_only)
        stats, n = StepStats(), len(samples)
        n_mini = min(self.cfg.mini_batches, n)
        for k in range(n_mini):
            mini = list(range(k * n // n_mini, (k + 1) * n // n_mini))
            train_policy(self, b, mini, stats, first=k == 0, n_mini=n_mini)
            if self.critic is not None:
                train_critic(self, b, mini, stats, n_mini=n_mini)
        self.steps_done += 1
        if self.replay is not None:
            self.replay.count_into(stats)
        self.dp.merge_stats(stats)
        out = stats.result() | advantage_stats(b.advantages, b.loss_mask) | {"train_seconds": time.perf_counter() - t0}
        out["train_tokens_per_s"] = prefix.token_metrics(out) / out["train_seconds"]
        out["clip_fraction"] = out["clip_fraction_low"] + out["clip_fraction_high"]
        if b.returns is not None and b.old_values is not None:
            out["value_explained_variance"] = explained_variance(b.returns, b.old_values, b.loss_mask)
        return out | gap | shaped

    def full_weights(self) -> dict[str, torch.Tensor]:
        """The policy's whole weights for the engine, on the trainer's device, as copies the next
        optimizer step cannot change. Under FSDP a collective every rank must call; rank 0 gets
        the weights, the others an empty dict. With LoRA: the merged weights, under the base model's names."""
        return self.adapters.merged_weights() if self.adapters is not None else self.dp.full_weights(self.model)

    def weights(self):
        """What the engine is updated from: whole weights, or sharded ones gathered as read (strategy.weights);
        with LoRA, the merged weights (strop.train.lora)."""
        return self.adapters.merged_weights() if self.adapters is not None else self.dp.weights(self.model)
