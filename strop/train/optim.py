"""Optimizers of the trainer: AdamW with a learning-rate schedule (``train.lr_schedule``), and a guarded step per
model."""

from __future__ import annotations

import math

import torch


class NonFiniteGradientError(RuntimeError):
    """Several optimizer steps in a row had a NaN or infinite gradient norm."""


def lr_factor(step: int, schedule: str, warmup: int, total: int, min_ratio: float = 0.0) -> float:
    """The multiplier of ``train.lr`` at optimizer step ``step`` (0 = the first update).

    Warm-up: ``(step + 1) / (warmup + 1)`` for the first ``warmup`` steps, so step ``warmup`` is the first at the
    full rate. Then ``constant`` stays at 1; ``linear`` and ``cosine`` decay from 1 towards ``min_ratio`` over the
    remaining ``total - warmup`` steps (``progress = (step - warmup) / (total - warmup)``, as transformers'
    schedules count it) and stay at ``min_ratio`` past ``total``.
    """
    if warmup and step < warmup:
        return (step + 1) / (warmup + 1)
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    shape = 1.0 - progress if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_ratio + (1.0 - min_ratio) * shape


class _Schedule(torch.optim.lr_scheduler.LambdaLR):
    """LambdaLR whose restored state also sets the optimizer's learning rate, so a resumed run steps on from the
    same rate whether or not the optimizer's own state was loaded first."""

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        for group, lr in zip(self.optimizer.param_groups, self._last_lr, strict=True):
            group["lr"] = lr


class GuardedOptimizer:
    """AdamW + learning-rate schedule for one model, stepped through the data-parallel strategy.

    :meth:`step` reduces the gradients (the strategy's ``after_backward``), clips them,
    and applies them only when their norm is finite; a non-finite norm skips the update,
    is counted in ``nonfinite_grad_norm_steps``, and ``train.max_nonfinite_grad_steps``
    of them in a row stop the run. The schedule counts applied updates: a skipped one does not advance it (as
    transformers' Trainer does when an update is skipped), so the next update uses the rate the skipped one had.
    """

    def __init__(self, name: str, module: torch.nn.Module, lr: float, cfg, strategy):
        self.name, self.module, self.cfg, self.dp = name, module, cfg, strategy
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)
        kind, warmup, ratio = cfg.lr_schedule, cfg.warmup_steps, cfg.min_lr_ratio
        total = cfg.steps * cfg.mini_batches  # counted in optimizer steps

        def factor(s: int) -> float:  # (a function, not an object: LambdaLR keeps it out of the saved state)
            return lr_factor(s, kind, warmup, total, ratio)

        self.scheduler = _Schedule(self.optimizer, factor)
        self.nonfinite_streak = 0

    @property
    def lr(self) -> float:
        """The rate the next update uses."""
        return self.optimizer.param_groups[0]["lr"]

    def step(self, stats) -> float:
        """Reduce, clip and apply the accumulated gradients; returns the gradient norm before clipping."""
        self.dp.after_backward(self.params)
        norm = self.dp.clip_grad_norm(self.params, self.cfg.grad_clip)
        if math.isfinite(norm):
            self.optimizer.step()
            self.scheduler.step()
            self.nonfinite_streak = 0
        else:  # a non-finite gradient skips the update (and the schedule) instead of poisoning the weights
            stats.add("nonfinite_grad_norm_steps", 1.0)
            self.nonfinite_streak += 1
            if self.nonfinite_streak >= self.cfg.max_nonfinite_grad_steps:
                raise NonFiniteGradientError(
                    f"{self.name} gradient norm was {norm} in {self.nonfinite_streak} optimizer steps in a row "
                    f"(train.max_nonfinite_grad_steps={self.cfg.max_nonfinite_grad_steps}); stopping: check the "
                    "rewards, the learning rate and the loss settings"
                )
        self.optimizer.zero_grad(set_to_none=True)
        return norm
