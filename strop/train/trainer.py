"""One process trainer: a batch of scored Samples → one optimizer step."""

from __future__ import annotations

import math
import time

import torch

from strop.algo.losses import ppo_clip_loss
from strop.train.logprob import response_logprobs
from strop.types import Sample


def collate(samples: list[Sample], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-pad prompt+response into (B, L) and index each response token (B, T)."""
    B = len(samples)
    L = max(s.total_length for s in samples)
    T = max(max(s.response_length for s in samples), 1)
    input_ids = torch.full((B, L), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((B, L), dtype=torch.long)
    positions = torch.zeros((B, T), dtype=torch.long)
    loss_mask = torch.zeros((B, T), dtype=torch.float32)
    rollout_logprobs = torch.zeros((B, T), dtype=torch.float32)
    for i, s in enumerate(samples):
        P, R = len(s.prompt_ids), s.response_length
        input_ids[i, : P + R] = torch.tensor(s.prompt_ids + s.response_ids)
        attention_mask[i, : P + R] = 1
        positions[i, :R] = torch.arange(P, P + R)
        positions[i, R:] = P  # padding entries point at a real token; loss_mask hides them
        loss_mask[i, :R] = torch.tensor(s.loss_mask, dtype=torch.float32)
        rollout_logprobs[i, :R] = torch.tensor(s.rollout_logprobs)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "positions": positions,
            "loss_mask": loss_mask, "rollout_logprobs": rollout_logprobs}


class Trainer:
    def __init__(self, model, *, pad_token_id: int, lr: float, warmup_steps: int = 0,
                 weight_decay: float = 0.0, betas=(0.9, 0.99), grad_clip: float = 1.0,
                 micro_batch_size: int = 16, temperature: float = 1.0, clip_low: float = 0.2,
                 clip_high: float = 0.2, skip_zero_advantage: bool = True):
        self.model = model.train()
        self.pad_token_id = pad_token_id
        self.grad_clip = grad_clip
        self.micro_batch_size = micro_batch_size
        self.temperature = temperature if temperature > 0 else 1.0
        self.clip_low, self.clip_high = clip_low, clip_high
        self.skip_zero_advantage = skip_zero_advantage
        params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=lr, betas=tuple(betas), weight_decay=weight_decay)
        # linear warm-up to lr, then constant
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: min(1.0, (step + 1) / (warmup_steps + 1)) if warmup_steps else 1.0
        )
        self.steps_done = 0

    def step(self, samples: list[Sample], advantages: torch.Tensor) -> dict[str, float]:
        """One optimizer step on ``samples`` (advantages: one per sample).

        Only COMPLETED and TRUNCATED samples reach the loss. The loss is the
        token mean over every loss token of the step, whatever the micro-batch
        split. Samples whose advantage is exactly zero carry zero gradient, so
        (with ``skip_zero_advantage``) they are not forwarded at all; they
        still count in the token-mean denominator.
        """
        t0 = time.perf_counter()
        keep = [i for i, s in enumerate(samples) if s.status.trainable]
        samples = [samples[i] for i in keep]
        advantages = advantages[keep].float()
        total_tokens = float(sum(sum(s.loss_mask) for s in samples))
        if not samples or total_tokens == 0:
            raise ValueError("no trainable tokens in this step (every sample aborted, failed or fully masked)")
        active = list(range(len(samples)))
        if self.skip_zero_advantage:
            active = [i for i in active if advantages[i] != 0]
        has_signal = bool(active)
        if not has_signal:  # forward one micro-batch anyway so the step still measures logprobs
            active = list(range(min(self.micro_batch_size, len(samples))))
        # similar lengths share a micro-batch: less right-padding, same loss (the sum is order-free)
        active.sort(key=lambda i: samples[i].total_length)

        sums = {"loss": 0.0, "abs_diff": 0.0, "entropy": 0.0, "clipped": 0.0, "tokens": 0.0}
        train_tokens = 0
        for start in range(0, len(active), self.micro_batch_size):
            idx = active[start : start + self.micro_batch_size]
            batch = collate([samples[i] for i in idx], self.pad_token_id)
            train_tokens += int(batch["attention_mask"].sum())
            logprobs, entropy = response_logprobs(
                self.model, batch["input_ids"], batch["attention_mask"], batch["positions"],
                temperature=self.temperature, with_entropy=True,
            )
            mask = batch["loss_mask"]
            # one optimizer step per rollout: the old policy is the current one (ratio = 1)
            loss, m = ppo_clip_loss(
                logprobs, logprobs.detach(), advantages[idx].unsqueeze(-1), mask,
                clip_low=self.clip_low, clip_high=self.clip_high, normalizer=total_tokens,
            )
            if has_signal:
                loss.backward()
            with torch.no_grad():
                sums["loss"] += loss.item()
                sums["abs_diff"] += ((logprobs - batch["rollout_logprobs"]).abs() * mask).sum().item()
                sums["entropy"] += (entropy * mask).sum().item()
                sums["clipped"] += m["clipped_tokens"]
                sums["tokens"] += m["loss_tokens"]

        params = [p for p in self.model.parameters() if p.requires_grad]
        lr = self.optimizer.param_groups[0]["lr"]  # the rate this step uses
        if has_signal:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, self.grad_clip))
            if math.isfinite(grad_norm):
                self.optimizer.step()
            self.scheduler.step()
        else:
            grad_norm = 0.0
        self.optimizer.zero_grad(set_to_none=True)
        self.steps_done += 1
        measured = max(sums["tokens"], 1.0)
        seconds = time.perf_counter() - t0
        return {
            "loss": sums["loss"] if has_signal else 0.0,
            "grad_norm": grad_norm,
            "lr": lr,
            "entropy": sums["entropy"] / measured,
            "clip_fraction": sums["clipped"] / measured,
            "train_rollout_logprob_abs_diff": sums["abs_diff"] / measured,
            "trained_samples": len(active) if has_signal else 0,
            "train_tokens_per_s": train_tokens / seconds,
            "train_seconds": seconds,
        }

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in self.model.state_dict().items()}
