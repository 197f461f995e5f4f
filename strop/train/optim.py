"""Optimizers of the trainer: AdamW with linear warm-up, and a guarded step per model."""

from __future__ import annotations

import math

import torch


class NonFiniteGradientError(RuntimeError):
    """Several optimizer steps in a row had a NaN or infinite gradient norm."""


class GuardedOptimizer:
    """AdamW + warm-up schedule for one model, stepped through the data-parallel strategy.

    :meth:`step` reduces the gradients (the strategy's ``after_backward``), clips them,
    and applies them only when their norm is finite; a non-finite norm skips the update,
    is counted in ``nonfinite_grad_norm_steps``, and ``train.max_nonfinite_grad_steps``
    of them in a row stop the run.
    """

    def __init__(self, name: str, module: torch.nn.Module, lr: float, cfg, strategy):
        self.name, self.module, self.cfg, self.dp = name, module, cfg, strategy
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)
        warmup = cfg.warmup_steps  # counted in optimizer steps; linear warm-up, then constant
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / (warmup + 1)) if warmup else 1.0
        )
        self.nonfinite_streak = 0

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def step(self, stats) -> float:
        """Reduce, clip and apply the accumulated gradients; returns the gradient norm before clipping."""
        self.dp.after_backward(self.params)
        norm = self.dp.clip_grad_norm(self.params, self.cfg.grad_clip)
        if math.isfinite(norm):
            self.optimizer.step()
            self.nonfinite_streak = 0
        else:  # a non-finite gradient skips the update instead of poisoning the weights
            stats.add("nonfinite_grad_norm_steps", 1.0)
            self.nonfinite_streak += 1
            if self.nonfinite_streak >= self.cfg.max_nonfinite_grad_steps:
                raise NonFiniteGradientError(
                    f"{self.name} gradient norm was {norm} in {self.nonfinite_streak} optimizer steps in a row "
                    f"(train.max_nonfinite_grad_steps={self.cfg.max_nonfinite_grad_steps}); stopping: check the "
                    "rewards, the learning rate and the loss settings"
                )
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm
