"""Batches of one training step: per-sample tables on the host, micro-batches on the device."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from strop.algo.offpolicy import distillation_advantages, overlong_penalty
from strop.parallel.packing import pack_by_token_budget, row_routes
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
    out = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "positions": positions,
        "loss_mask": loss_mask,
        "response_mask": response_mask,
        "rollout_logprobs": rollout_logprobs,
    }
    rows = [row_routes(samples, [(i, 0, s.total_length)]) for i, s in enumerate(samples)]
    if any(r is not None for r in rows):  # routing replay: (B, L, layers, top_k), -1 in the padding
        shape = next(r.shape[1:] for r in rows if r is not None)
        out["routes"] = torch.full((B, L, *shape), -1, dtype=torch.int16)
        for i, r in enumerate(rows):
            if r is not None:
                out["routes"][i, : len(r)] = r
    return out


def to_device(batch: dict, device: torch.device) -> dict:
    """Every tensor of a collated batch (tuples of tensors too) on ``device``."""

    def move(v):
        if isinstance(v, torch.Tensor):
            return v.to(device, non_blocking=True)
        if isinstance(v, tuple):
            return tuple(move(x) for x in v)
        return v.to(device) if hasattr(v, "to") else v  # a context-parallel plan moves its own tensors

    return {k: move(v) for k, v in batch.items()}


def pad_rows(rows: list[list[float]], T: int) -> torch.Tensor:
    out = torch.zeros(len(rows), T)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=torch.float32)
    return out


@dataclass
class StepBatch:
    """Per-sample tensors of one step, padded to the step's longest response (N, T), on the host."""

    samples: list[Sample]
    rewards: torch.Tensor  # (N,)
    group_ids: torch.Tensor  # (N,)
    loss_mask: torch.Tensor
    response_mask: torch.Tensor
    rollout_logprobs: torch.Tensor
    versions: torch.Tensor  # (N, T): the weight version each response token was sampled at
    old_logprobs: torch.Tensor | None = None  # the ratio's denominator
    trainer_old_logprobs: torch.Tensor | None = None  # the trainer's pre-update logprobs, when a pre-pass ran
    ref_logprobs: torch.Tensor | None = None
    teacher_logprobs: torch.Tensor | None = None  # on-policy distillation: the teacher's, of the same tokens
    old_values: torch.Tensor | None = None
    advantages: torch.Tensor | None = None  # (N, T)
    returns: torch.Tensor | None = None  # (N, T), critic targets

    @classmethod
    def of(cls, samples: list[Sample]) -> "StepBatch":
        bad = [
            (i, s.reward)
            for i, s in enumerate(samples)
            if not isinstance(s.reward, (int, float)) or s.reward != s.reward or abs(s.reward) == float("inf")
        ]
        if bad:
            i, r = bad[0]
            raise ValueError(
                f"sample {i} (group {samples[i].group_id}, index {samples[i].index}) has reward {r!r}; "
                f"rewards must be finite numbers ({len(bad)} such samples in this step)"
            )
        T = max(s.response_length for s in samples)
        return cls(
            samples=samples,
            rewards=torch.tensor([float(s.reward) for s in samples]),
            group_ids=torch.tensor([s.group_id for s in samples]),
            loss_mask=pad_rows([s.loss_mask for s in samples], T),
            response_mask=pad_rows([[1.0] * s.response_length for s in samples], T),
            rollout_logprobs=pad_rows([s.rollout_logprobs for s in samples], T),
            versions=pad_rows([s.weight_versions for s in samples], T).long(),
        )

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.loss_mask.shape)

    def shape_overlong(self, max_new_tokens: int, buffer: int | None, factor: float) -> dict[str, float]:
        """DAPO's overlong reward shaping (strop.algo.offpolicy.overlong_penalty) added to the rewards, by
        each response's length; returns its metrics (none when ``buffer`` is None: no shaping)."""
        if buffer is None:
            return {}
        penalty = overlong_penalty(
            self.response_mask.sum(-1), max_new_tokens=max_new_tokens, buffer=buffer, factor=factor
        )
        self.rewards = self.rewards + penalty
        return {
            "overlong_penalty_mean": penalty.mean().item(),
            "overlong_penalized_fraction": (penalty < 0).float().mean().item(),
        }

    def distill(self, coef: float, *, only: bool = False) -> dict[str, float]:
        """On-policy distillation (strop.algo.offpolicy.distillation_advantages): the teacher's per-token
        reverse-KL advantage added to the advantages (or replacing them, ``only``), the student's side being
        pi_old (the engine's logprobs when no pre-pass ran). Returns the mean reverse KL over loss tokens."""
        student = self.old_logprobs if self.old_logprobs is not None else self.rollout_logprobs
        distill = distillation_advantages(student, self.teacher_logprobs, self.loss_mask, coef=coef)
        self.advantages = distill if only else self.advantages + distill
        kl = ((student - self.teacher_logprobs) * self.loss_mask).sum() / self.loss_mask.sum().clamp(min=1)
        return {"distill_reverse_kl": kl.item()}

    def take_trainer_logprobs(self) -> float:
        """rollout.exact_logprobs: the trainer's pre-pass logprobs become the rollout's, in this
        batch and in each sample (float32 exactly). Returns the mean |engine - trainer| gap they
        replace, over loss tokens."""
        mask = self.loss_mask
        gap = float(((self.trainer_old_logprobs - self.rollout_logprobs).abs() * mask).sum() / mask.sum().clamp(min=1))
        self.rollout_logprobs = self.trainer_old_logprobs.clone()
        for i, s in enumerate(self.samples):
            s.rollout_logprobs = self.rollout_logprobs[i, : s.response_length].tolist()
        return gap


def split_micro_batches(
    indices: list[int], samples: list[Sample], micro_batch_size: int, max_tokens: int | None
) -> list[list[int]]:
    """Padded micro-batches of ``micro_batch_size`` (similar lengths together), or packed ones
    filled up to ``max_tokens`` tokens."""
    if max_tokens:
        bins = pack_by_token_budget([samples[i].total_length for i in indices], max_tokens)
        return [[indices[j] for j in b] for b in bins]
    ordered = sorted(indices, key=lambda i: samples[i].total_length)  # less padding; sums are order-free
    return [ordered[k : k + micro_batch_size] for k in range(0, len(ordered), micro_batch_size)]


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
