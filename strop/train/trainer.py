"""One-process trainer: a batch of scored Samples → advantages → optimizer step(s).

Per step: (1) forward passes that must see the pre-update weights (old policy,
reference policy, critic values) where the configuration needs them; (2) the
advantage estimator; (3) for each mini-batch, micro-batches with gradient
accumulation and one optimizer step; (4) the critic's update (PPO).
Loss normalisers are counted over the whole mini-batch before any forward, so
the update does not depend on the micro-batch split.
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from strop.algo import advantages as adv_fns
from strop.algo.kl import importance_weighted_kl, kl_estimate
from strop.plugins import call_hook_sync
from strop.algo.losses import aggregate, cispo_loss, gspo_loss, ppo_clip_loss, rollout_correction, value_loss
from strop.parallel.collectives import DEFAULT_BUCKET_BYTES, all_reduce_coalesced
from strop.parallel import context as context_parallel
from strop.parallel.fsdp import LogprobModule, full_state_dict, shard
from strop.parallel.packing import collate_packed, pack_by_token_budget, unpack
from strop.train.critic import ValueModel
from strop.types import Sample

SCALAR_ESTIMATORS = ("grpo", "dr_grpo", "rloo")  # one advantage per sample


def collate(samples: list[Sample], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-pad prompt+response into (B, L) and index each response token (B, T)."""
    B = len(samples)
    L = max(s.total_length for s in samples)
    T = max(max(s.response_length for s in samples), 1)
    input_ids = torch.full((B, L), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((B, L), dtype=torch.long)
    positions = torch.zeros((B, T), dtype=torch.long)
    loss_mask = torch.zeros((B, T), dtype=torch.float32)
    response_mask = torch.zeros((B, T), dtype=torch.float32)
    rollout_logprobs = torch.zeros((B, T), dtype=torch.float32)
    for i, s in enumerate(samples):
        P, R = len(s.prompt_ids), s.response_length
        input_ids[i, : P + R] = torch.tensor(s.prompt_ids + s.response_ids)
        attention_mask[i, : P + R] = 1
        positions[i, :R] = torch.arange(P, P + R)
        positions[i, R:] = P  # padding entries point at a real token; the masks hide them
        loss_mask[i, :R] = torch.tensor(s.loss_mask, dtype=torch.float32)
        response_mask[i, :R] = 1.0
        rollout_logprobs[i, :R] = torch.tensor(s.rollout_logprobs)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "positions": positions,
            "loss_mask": loss_mask, "response_mask": response_mask, "rollout_logprobs": rollout_logprobs}


@dataclass
class _Batch:
    """Per-sample tensors of one step, padded to the step's longest response (N, T)."""

    samples: list[Sample]
    rewards: torch.Tensor  # (N,)
    group_ids: torch.Tensor  # (N,)
    loss_mask: torch.Tensor
    response_mask: torch.Tensor
    rollout_logprobs: torch.Tensor
    old_logprobs: torch.Tensor | None = None  # the ratio's denominator
    trainer_old_logprobs: torch.Tensor | None = None  # the trainer's pre-update logprobs, when a pre-pass ran
    ref_logprobs: torch.Tensor | None = None
    old_values: torch.Tensor | None = None
    advantages: torch.Tensor | None = None  # (N, T)
    returns: torch.Tensor | None = None  # (N, T), critic targets


def _pad_rows(rows: list[torch.Tensor], T: int) -> torch.Tensor:
    out = torch.zeros(len(rows), T)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


class Trainer:
    def __init__(self, model, *, pad_token_id: int, train, algo, temperature: float = 1.0,
                 max_new_tokens: int = 1024, advantage_fn=None, policy_loss_fn=None, dp_group=None,
                 cp_group=None, bucket_bytes: int = DEFAULT_BUCKET_BYTES, dp_mode: str = "replicate",
                 fsdp_mixed_precision: bool = False):
        """``train`` and ``algo`` are the config sections (TrainConfig, AlgoConfig); the two
        optional hooks replace the advantage estimator and the policy loss (strop.plugins).

        ``dp_group`` / ``cp_group``: this rank's data-parallel and context-parallel groups
        (the two dimensions of the device mesh; together they span every process)."""
        self.advantage_fn, self.policy_loss_fn = advantage_fn, policy_loss_fn
        # data parallel (replicate): every rank holds the full model and trains on its share of the
        # micro-batches; gradients are summed with the chunked reduction (the loss is already
        # normalised over the whole batch, so the sum is the one-process gradient)
        self.dp_group, self.cp_group, self.bucket_bytes = dp_group, cp_group, bucket_bytes
        on = dist.is_initialized()
        self.dp_rank = dist.get_rank(dp_group) if on and dp_group is not None else 0
        self.dp_size = dist.get_world_size(dp_group) if on and dp_group is not None else 1
        # context parallel: the CP ranks of one DP rank split every micro-batch's tokens (strop.parallel.context)
        self.cp_size = dist.get_world_size(cp_group) if on and cp_group is not None else 1
        self.world = self.dp_size * self.cp_size
        if self.world > 1 and self.world != dist.get_world_size():
            raise ValueError(f"data parallel ({self.dp_size}) x context parallel ({self.cp_size}) must cover all "
                             f"{dist.get_world_size()} processes")
        # every rank's parameter gradients add up to the step's gradient: DP ranks saw other
        # micro-batches, CP ranks other tokens of the same ones
        self.grad_group = dist.group.WORLD if self.world > 1 else None
        if self.cp_size > 1:
            context_parallel.enable(model)  # before the reference / critic copies, so they use it too
        self.model = model.train()
        self.dp_mode = dp_mode if self.world > 1 else "replicate"
        if self.dp_mode == "fsdp" and algo.kl_coef + algo.kl_in_reward_coef > 0 and algo.ref_mode == "swap":
            raise ValueError("algo.ref_mode='swap' cannot swap into FSDP-sharded weights; use ref_mode='copy'")
        self.pad_token_id = pad_token_id
        self.cfg, self.algo = train, algo
        self.temperature = temperature if temperature > 0 else 1.0
        self.max_new_tokens = max_new_tokens
        self.needs_ref = bool(algo.kl_coef or algo.kl_in_reward_coef)
        self.ref_model, self.ref_state = None, None
        if self.needs_ref:
            if algo.ref_mode == "copy":  # a frozen copy of the initial policy
                self.ref_model = copy.deepcopy(model).eval().requires_grad_(False)
            else:  # "swap": keep only the initial weights and swap them into the training module
                self.ref_state = {k: p.detach().clone() for k, p in model.named_parameters()}
        self.critic = None
        if algo.estimator == "ppo":
            self.critic = ValueModel.from_causal_lm(copy.deepcopy(model)).train()
            self.critic_optimizer, self.critic_scheduler = self._make_optimizer(self.critic, algo.critic_lr)
        # copies (reference, critic) are taken above from the unsharded model; then shard the policy
        self.policy = LogprobModule(self.model)
        if self.dp_mode == "fsdp":
            shard(self.policy, self.grad_group, mixed_precision=fsdp_mixed_precision)  # over DP x CP
        self.optimizer, self.scheduler = self._make_optimizer(self.model, train.lr)
        self.steps_done = 0

    def _make_optimizer(self, module, lr):
        params = [p for p in module.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=lr, betas=tuple(self.cfg.betas), weight_decay=self.cfg.weight_decay)
        warmup = self.cfg.warmup_steps  # counted in optimizer steps; linear warm-up, then constant
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / (warmup + 1)) if warmup else 1.0)
        return opt, sched

    # ---- forward passes -------------------------------------------------------------------------
    def _micro_batches(self, indices: list[int], samples: list[Sample]) -> list[list[int]]:
        """Padded micro-batches of ``micro_batch_size`` (similar lengths together), or packed ones
        filled up to ``max_tokens_per_micro_batch`` tokens."""
        if self.cfg.max_tokens_per_micro_batch:
            bins = pack_by_token_budget([samples[i].total_length for i in indices], self.cfg.max_tokens_per_micro_batch)
            return [[indices[j] for j in b] for b in bins]
        ordered = sorted(indices, key=lambda i: samples[i].total_length)  # less padding; sums are order-free
        mb = self.cfg.micro_batch_size
        return [ordered[k : k + mb] for k in range(0, len(ordered), mb)]

    def _my_share(self, micro_batches: list[list[int]], balance: bool = False) -> list[tuple[list[int], bool]]:
        """This rank's micro-batches (round robin), each with a flag "real".

        With ``balance`` (FSDP: every forward and backward is a collective) every rank runs
        the same number: a rank short of one repeats a real micro-batch with its loss
        weighted 0, so it joins every collective and changes nothing.
        """
        mine = [(idx, True) for idx in micro_batches[self.dp_rank :: self.dp_size]]
        if balance and micro_batches:
            per_rank = -(-len(micro_batches) // self.dp_size)
            mine += [(micro_batches[0], False)] * (per_rank - len(mine))
        return mine

    def _reduce_grads(self, params) -> None:
        for p in params:  # a rank with no micro-batch still sends zeros, so every rank sends the same list
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        all_reduce_coalesced([p.grad for p in params], op="sum", bucket_bytes=self.bucket_bytes, group=self.grad_group)

    def _collate(self, samples: list[Sample]) -> dict:
        if self.cfg.max_tokens_per_micro_batch:  # under CP the plan builds its own, smaller mask
            batch = collate_packed(samples, with_mask=self.cp_size == 1)
        else:
            batch = collate(samples, self.pad_token_id)
        if self.cp_size > 1:
            batch["cp"] = context_parallel.ContextParallelPlan.for_batch(batch, self.cp_group)
        return batch

    def _logprobs(self, batch: dict, *, with_entropy: bool = False, entropy_grad: bool = False, model=None):
        lp, ent = (self.policy if model is None else LogprobModule(model))(
            batch["input_ids"], batch["attention_mask"], batch["positions"], batch.get("position_ids"),
            temperature=self.temperature, with_entropy=with_entropy, entropy_grad=entropy_grad,
            chunk_size=self.cfg.logprob_chunk_size, cp=batch.get("cp"))
        if "scatter" in batch:  # a packed row back to (n, T)
            lp, ent = unpack(lp, batch), (unpack(ent, batch) if ent is not None else None)
        return lp, ent

    def _values(self, batch: dict) -> torch.Tensor:
        values = self.critic(batch["input_ids"], batch["attention_mask"], batch["positions"],
                             position_ids=batch.get("position_ids"), cp=batch.get("cp"))
        return unpack(values, batch) if "scatter" in batch else values

    @torch.no_grad()
    def _pre_pass(self, b: _Batch, need_old: bool) -> None:
        """Everything that must see pre-update weights: old and reference logprobs, critic values.

        Data-parallel ranks split the micro-batches (as in training) and then sum their
        disjoint rows, so every rank ends with the whole batch's values.
        """
        N, T = b.loss_mask.shape
        olds = torch.zeros(N, T) if need_old else None
        refs = torch.zeros(N, T) if self.needs_ref else None
        values = torch.zeros(N, T) if self.critic is not None else None
        micro_batches = self._micro_batches(list(range(N)), b.samples)
        for idx, real in self._my_share(micro_batches, balance=self.dp_mode == "fsdp"):
            batch = self._collate([b.samples[i] for i in idx])
            rows, Tm = torch.tensor(idx), batch["loss_mask"].shape[1]
            if need_old:
                lp = self._logprobs(batch)[0]  # under FSDP a collective: balancing repeats run it too
                if real:
                    olds[rows, :Tm] = lp.float()
            if not real:
                continue
            if self.needs_ref:
                if self.ref_model is not None:
                    refs[rows, :Tm] = self._logprobs(batch, model=self.ref_model)[0].float()
                else:
                    with swapped_weights(self.model, self.ref_state):
                        refs[rows, :Tm] = self._logprobs(batch)[0].float()
            if self.critic is not None:
                values[rows, :Tm] = self._values(batch).float()
        found = [t for t in (olds, refs, values) if t is not None]
        if self.dp_size > 1:  # each row came from exactly one rank: the sum assembles the batch
            all_reduce_coalesced(found, op="sum", bucket_bytes=self.bucket_bytes, group=self.dp_group)
        if need_old:
            b.old_logprobs = olds * b.response_mask
        if self.needs_ref:
            b.ref_logprobs = refs * b.response_mask
        if self.critic is not None:
            b.old_values = values * b.response_mask

    # ---- advantages -----------------------------------------------------------------------------
    def _advantages(self, b: _Batch) -> None:
        a, est = self.algo, self.algo.estimator
        if self.advantage_fn is not None:
            out = call_hook_sync("advantage", self.advantage_fn, rewards=b.rewards, group_ids=b.group_ids,
                                 mask=b.response_mask)
            b.advantages = (out.unsqueeze(-1) if out.dim() == 1 else out).float() * b.response_mask
            return
        if est in SCALAR_ESTIMATORS:
            if est == "rloo":
                scalar = adv_fns.rloo_advantages(b.rewards, b.group_ids)
            else:
                scalar = adv_fns.grpo_advantages(b.rewards, b.group_ids,
                                                 normalize_std=a.normalize_std and est == "grpo")
            b.advantages = scalar.unsqueeze(-1) * b.response_mask
            return
        kl = None
        if a.kl_in_reward_coef:
            policy_lp = b.old_logprobs if b.old_logprobs is not None else b.rollout_logprobs
            kl = kl_estimate(policy_lp, b.ref_logprobs, a.kl_in_reward_kind) * b.response_mask
        if est in ("reinforce_pp", "reinforce_pp_baseline"):
            b.advantages = adv_fns.reinforce_pp_advantages(
                b.rewards, b.group_ids, b.response_mask, kl=kl, kl_coef=a.kl_in_reward_coef, gamma=a.gamma,
                baseline=est == "reinforce_pp_baseline")
        elif est == "ppo":
            token_rewards = adv_fns.outcome_token_rewards(b.rewards, b.response_mask)
            if kl is not None:
                token_rewards = token_rewards - a.kl_in_reward_coef * kl
            advantages, b.returns = adv_fns.gae(token_rewards, b.old_values, b.response_mask, gamma=a.gamma, lam=a.lam)
            b.advantages = adv_fns.whiten(advantages, b.loss_mask)
        else:
            raise ValueError(f"unknown advantage estimator {est!r}")

    # ---- the step -------------------------------------------------------------------------------
    def step(self, samples: list[Sample]) -> dict[str, float]:
        """Train on ``samples``. Only COMPLETED and TRUNCATED samples reach the loss."""
        t0 = time.perf_counter()
        samples = [s for s in samples if s.status.trainable]
        if not samples or not any(any(s.loss_mask) for s in samples):
            raise ValueError("no trainable tokens in this step (every sample aborted, failed or fully masked)")
        T = max(s.response_length for s in samples)
        b = _Batch(
            samples=samples,
            rewards=torch.tensor([float(s.reward) for s in samples]),
            group_ids=torch.tensor([s.group_id for s in samples]),
            loss_mask=_pad_rows([torch.tensor(s.loss_mask, dtype=torch.float32) for s in samples], T),
            response_mask=_pad_rows([torch.ones(s.response_length) for s in samples], T),
            rollout_logprobs=_pad_rows([torch.tensor(s.rollout_logprobs) for s in samples], T),
        )
        a = self.algo
        # the old policy is the pre-update trainer, unless the engine's logprobs stand in for it;
        # with one optimizer step and no KL-in-reward it equals the current weights: no extra pass
        need_old = not a.use_rollout_logprobs and (self.cfg.mini_batches > 1 or bool(a.kl_in_reward_coef))
        if need_old or self.needs_ref or self.critic is not None:
            self._pre_pass(b, need_old)
        b.trainer_old_logprobs = b.old_logprobs
        if a.use_rollout_logprobs:
            b.old_logprobs = b.rollout_logprobs
        self._advantages(b)

        metrics = _Sums()
        order = list(range(len(samples)))
        n_mini = min(self.cfg.mini_batches, len(order))
        for k in range(n_mini):
            mini = order[k * len(order) // n_mini : (k + 1) * len(order) // n_mini]
            self._train_policy(b, mini, metrics, first=k == 0)
            if self.critic is not None:
                self._train_critic(b, mini, metrics)
        self.steps_done += 1
        if self.dp_size > 1:
            metrics.merge_across(self.dp_group)
        out = metrics.result()
        adv_tokens = b.advantages[b.loss_mask > 0]
        out |= {
            "advantage_mean": adv_tokens.mean().item(),
            "advantage_std": adv_tokens.std().item() if adv_tokens.numel() > 1 else 0.0,
            "train_seconds": time.perf_counter() - t0,
        }
        out["train_tokens_per_s"] = out.pop("train_tokens") / out["train_seconds"]
        out["clip_fraction"] = out["clip_fraction_low"] + out["clip_fraction_high"]
        if b.returns is not None and b.old_values is not None:
            # how much of the return the critic predicted before this step: 1 is perfect, <= 0 is no better
            # than a constant (the usual PPO diagnostic; the raw value loss moves with the reward variance)
            returns, values = b.returns[b.loss_mask > 0], b.old_values[b.loss_mask > 0]
            var = returns.var(unbiased=False)
            out["value_explained_variance"] = (1 - (returns - values).var(unbiased=False) / var).item() if var > 0 else 0.0
        return out

    def _train_policy(self, b: _Batch, mini: list[int], m: "_Sums", first: bool) -> None:
        a = self.algo
        mask_all = b.loss_mask[mini]
        # normalisers over the whole mini-batch (one optimizer step), fixed before any micro-batch
        norms = dict(num_sequences=float(len(mini)), total_tokens=float(mask_all.sum()),
                     constant_normalizer=float(a.loss_agg_constant or self.max_new_tokens))
        # a sample with zero advantage everywhere contributes zero gradient to the policy loss;
        # skip its forward unless a KL or entropy term gives it a gradient anyway
        active = list(mini)
        can_skip = not a.kl_coef and not a.entropy_coef
        if can_skip:
            active = [i for i in mini if bool((b.advantages[i] != 0).any())]
        has_signal = bool(active)
        if not has_signal:  # measure one micro-batch anyway so every step reports its metrics
            active = mini[: self.cfg.micro_batch_size]
        for idx, real in self._my_share(self._micro_batches(active, b.samples), balance=self.dp_mode == "fsdp"):
            batch = self._collate([b.samples[i] for i in idx])
            Tm = batch["loss_mask"].shape[1]
            mask = batch["loss_mask"]
            logprobs, entropy = self._logprobs(batch, with_entropy=True, entropy_grad=bool(a.entropy_coef))
            old = b.old_logprobs[idx, :Tm] if b.old_logprobs is not None else logprobs.detach()
            rollout = batch["rollout_logprobs"]
            advantages = b.advantages[idx, :Tm]
            weight, loss_mask, corr = rollout_correction(
                old, rollout, mask, tis_cap=a.tis_cap, mis_low=a.mis_low, mis_high=a.mis_high, mis_level=a.mis_level)
            if self.policy_loss_fn is not None:
                per_token, extra = call_hook_sync("policy_loss", self.policy_loss_fn, logprobs=logprobs,
                                                  old_logprobs=old, advantages=advantages, mask=loss_mask)
                info = {"clipped_low": torch.zeros_like(mask, dtype=torch.bool),
                        "clipped_high": torch.zeros_like(mask, dtype=torch.bool)} | extra
            elif a.policy_loss == "ppo_clip":
                per_token, info = ppo_clip_loss(logprobs, old, advantages, clip_low=a.clip_low,
                                                clip_high=a.clip_high, dual_clip=a.dual_clip)
            elif a.policy_loss == "gspo":
                per_token, info = gspo_loss(logprobs, old, advantages, loss_mask, clip_low=a.clip_low,
                                            clip_high=a.clip_high)
            else:
                per_token, info = cispo_loss(logprobs, old, advantages, clip_low=a.clip_low, clip_high=a.clip_high)
            seq_tokens = mask.sum(-1)  # per-rollout denominators: each sample is its own rollout here
            agg = dict(norms, sequence_tokens=seq_tokens)
            pg_loss = aggregate(per_token * weight, loss_mask, a.loss_agg, **agg)
            loss = pg_loss
            ref_kl = None
            if b.ref_logprobs is not None:
                ref = b.ref_logprobs[idx, :Tm]
                ref_kl = (importance_weighted_kl(logprobs, old, ref, a.kl_kind) if a.kl_importance_weighted
                          else kl_estimate(logprobs, ref, a.kl_kind))
                if a.kl_coef:
                    loss = loss + a.kl_coef * aggregate(ref_kl, mask, a.loss_agg, **agg)
            if a.entropy_coef:
                loss = loss - a.entropy_coef * aggregate(entropy, mask, a.loss_agg, **agg)
            if has_signal:
                # FSDP averages gradients over ranks; strop's losses are globally normalised, so scale
                # by the world size to make that average the sum. A balancing repeat weighs 0.
                scale = (self.world if self.dp_mode == "fsdp" else 1.0) if real else 0.0
                (loss * scale if scale != 1.0 else loss).backward()
            if not real:
                continue  # a balancing repeat: it joined the collectives, it is not measured
            with torch.no_grad():
                m.add("policy_loss", pg_loss.item() if has_signal else 0.0)
                m.add("loss", loss.item() if has_signal else 0.0)
                # engine vs trainer on the same weights: the pre-pass, or this pass before any update
                if b.trainer_old_logprobs is not None:
                    m.tok("train_rollout_logprob_abs_diff", (b.trainer_old_logprobs[idx, :Tm] - rollout).abs(), mask)
                elif first:
                    m.tok("train_rollout_logprob_abs_diff", (logprobs - rollout).abs(), mask)
                m.tok("entropy", entropy, mask)
                m.tok("clip_fraction_low", info["clipped_low"].float(), mask)
                m.tok("clip_fraction_high", info["clipped_high"].float(), mask)
                if "dual_clipped" in info:
                    m.tok("dual_clip_fraction", info["dual_clipped"].float(), mask)
                m.tok("approx_kl_old", kl_estimate(logprobs, old, "k3"), mask)
                if ref_kl is not None:
                    m.tok("kl_ref", kl_estimate(logprobs, b.ref_logprobs[idx, :Tm], a.kl_kind), mask)
                m.tok("importance_weight_mean", corr["w"], mask)
                m.max("importance_weight_max", (corr["w"] * mask).max().item())
                m.tok("mis_masked_fraction", (mask - loss_mask).clamp(min=0), mask)
                m.add("train_tokens", float(batch["tokens"] if "tokens" in batch else batch["attention_mask"].sum()))
                m.add("trained_samples", float(len(idx)) if has_signal else 0.0)
        params = [p for p in self.model.parameters() if p.requires_grad]
        m.last("lr", self.optimizer.param_groups[0]["lr"])
        if has_signal and self.world > 1 and self.dp_mode == "replicate":
            self._reduce_grads(params)  # FSDP has reduce-scattered them already
        if has_signal:
            norm = torch.nn.utils.clip_grad_norm_(params, self.cfg.grad_clip)
            grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
            if math.isfinite(grad_norm):  # a non-finite gradient skips the update instead of poisoning weights
                self.optimizer.step()
            self.scheduler.step()
            m.last("grad_norm", grad_norm)
        else:
            m.last("grad_norm", 0.0)
        self.optimizer.zero_grad(set_to_none=True)

    def _train_critic(self, b: _Batch, mini: list[int], m: "_Sums") -> None:
        mask_all = b.loss_mask[mini]
        total = float(mask_all.sum())
        for idx, _ in self._my_share(self._micro_batches(mini, b.samples)):
            batch = self._collate([b.samples[i] for i in idx])
            Tm, mask = batch["loss_mask"].shape[1], batch["loss_mask"]
            values = self._values(batch)
            per_token, info = value_loss(values, b.old_values[idx, :Tm], b.returns[idx, :Tm], clip=self.algo.value_clip)
            loss = aggregate(per_token, mask, "token_mean", num_sequences=float(len(mini)), total_tokens=total)
            loss.backward()
            m.add("value_loss", loss.item())
            m.tok("value_clip_fraction", info["value_clipped"].float(), mask)
        params = [p for p in self.critic.parameters() if p.requires_grad]
        if self.world > 1:
            self._reduce_grads(params)
        m.last("critic_grad_norm", float(torch.nn.utils.clip_grad_norm_(params, self.cfg.grad_clip)))
        self.critic_optimizer.step()
        self.critic_scheduler.step()
        self.critic_optimizer.zero_grad(set_to_none=True)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The full policy weights (for the engine and checkpoints). With FSDP this is a collective
        every rank must call; rank 0 gets the weights, the others an empty dict."""
        if self.dp_mode == "fsdp":
            return full_state_dict(self.model)
        return {k: v.detach() for k, v in self.model.state_dict().items()}


@contextlib.contextmanager
def swapped_weights(model, state: dict[str, torch.Tensor]):
    """Run ``model`` with the parameters in ``state`` (by name), then put its own back.

    Only tensor pointers move (``param.data``), nothing is copied, and tied
    parameters (embedding / lm_head) swap together because they are one Parameter.
    """
    params = dict(model.named_parameters())
    saved = {}
    try:
        for name, tensor in state.items():
            saved[name], params[name].data = params[name].data, tensor
        yield model
    finally:
        for name, tensor in saved.items():
            params[name].data = tensor


class _Sums:
    """Accumulates step metrics: token-weighted means, sums, maxima and last values."""

    def __init__(self):
        self.tok_sum, self.tok_n, self.raw, self.maxes, self.lasts = {}, {}, {}, {}, {}

    def tok(self, name, values, mask):
        self.tok_sum[name] = self.tok_sum.get(name, 0.0) + float((values * mask).sum())
        self.tok_n[name] = self.tok_n.get(name, 0.0) + float(mask.sum())

    def add(self, name, value):
        self.raw[name] = self.raw.get(name, 0.0) + value

    def max(self, name, value):
        self.maxes[name] = max(self.maxes.get(name, -math.inf), value)

    def last(self, name, value):
        self.lasts[name] = value

    def merge_across(self, group) -> None:
        """Combine every rank's sums (each rank measured only its own micro-batches)."""
        parts = [None] * dist.get_world_size(group)
        dist.all_gather_object(parts, (self.tok_sum, self.tok_n, self.raw, self.maxes), group=group)
        self.tok_sum, self.tok_n, self.raw, self.maxes = {}, {}, {}, {}
        for tok_sum, tok_n, raw, maxes in parts:
            for target, source in ((self.tok_sum, tok_sum), (self.tok_n, tok_n), (self.raw, raw)):
                for k, v in source.items():
                    target[k] = target.get(k, 0.0) + v
            for k, v in maxes.items():
                self.maxes[k] = max(self.maxes.get(k, -math.inf), v)

    def result(self) -> dict[str, float]:
        out = {k: v / max(self.tok_n[k], 1.0) for k, v in self.tok_sum.items()}
        return out | self.raw | self.maxes | self.lasts
