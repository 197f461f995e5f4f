"""Sequence packing: samples share one row with no padding, attention confined to each sample.

A packed micro-batch is one row of all its samples' prompt+response tokens; each
sample's position ids restart at 0, and a block-diagonal causal mask (B=1, 1, L, L)
keeps attention inside each sample, so every token sees exactly what it would in
a padded batch. Packing changes only how tokens are laid out, never the loss
normalisation (the trainer fixes its normalisers per optimizer step).
"""

from __future__ import annotations

import torch

from strop.types import Sample


def pack_by_token_budget(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """First-fit decreasing: bins of indices whose lengths sum to <= max_tokens.

    A sample longer than the budget gets a bin of its own. Deterministic:
    ties keep index order; bins come out in the order they were opened.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(max_tokens - lengths[i])
    return bins


def collate_packed(samples: list[Sample], with_mask: bool = True) -> dict[str, torch.Tensor]:
    """One packed row, plus the per-sample (n, T) tensors the loss works on.

    ``positions`` (1, R) indexes every response token in the row; ``scatter``
    (rows, cols), each (R,), places those R values back into (n, T). Without
    ``with_mask`` the (L, L) attention mask is not built (context parallel builds its
    own from ``segment_ids``) and ``attention_mask`` is None.
    """
    T = max(max(s.response_length for s in samples), 1)
    ids, pos_ids, segment, positions, rows, cols = [], [], [], [], [], []
    offset = 0
    for i, s in enumerate(samples):
        tokens = s.prompt_ids + s.response_ids
        ids += tokens
        pos_ids += range(len(tokens))  # positions restart per sample
        segment += [i] * len(tokens)
        P, R = len(s.prompt_ids), s.response_length
        positions += range(offset + P, offset + P + R)
        rows += [i] * R
        cols += range(R)
        offset += len(tokens)
    L = offset
    routes = row_routes(samples, [(i, 0, s.total_length) for i, s in enumerate(samples)])
    seg = torch.tensor(segment)
    mask = None
    if with_mask:
        causal = torch.ones(L, L, dtype=torch.bool).tril()
        mask = (causal & (seg.unsqueeze(0) == seg.unsqueeze(1))).view(1, 1, L, L)  # (1, 1, L, L) block-diagonal
    return {
        "input_ids": torch.tensor([ids]),
        "attention_mask": mask,
        "position_ids": torch.tensor([pos_ids]),
        "segment_ids": seg.view(1, L),
        "positions": torch.tensor([positions]),
        "scatter": (torch.tensor(rows), torch.tensor(cols)),
        **per_sample(samples, T),
        "tokens": L,
        **({} if routes is None else {"routes": routes.unsqueeze(0)}),
    }


def row_routes(samples: list[Sample], spans: list[tuple[int, int, int]]) -> torch.Tensor | None:
    """The routed experts (MoE routing replay) of a row laid out from ``spans``, each ``(sample, start, end)``: a
    piece of a sample's tokens, in column order. (columns, layers, top_k) int16, -1 where a sample has none; None
    when no sample of the row has any."""
    shape = next((tuple(s.routed_experts.shape[1:]) for s in samples if s.routed_experts is not None), None)
    if shape is None:
        return None
    parts = []
    for i, start, end in spans:
        r = samples[i].routed_experts
        if r is not None and tuple(r.shape[1:]) != shape:
            raise ValueError(
                f"sample group={samples[i].group_id} index={samples[i].index} has routes of {tuple(r.shape[1:])} "
                f"(layers, top_k), another in its micro-batch {shape}: one model's engine records one shape"
            )
        parts.append(r[start:end] if r is not None else torch.full((end - start, *shape), -1, dtype=torch.int16))
    return torch.cat(parts)


def per_sample(samples: list[Sample], T: int) -> dict[str, torch.Tensor]:
    """The (n, T) tensors the loss works on, of a row's samples: loss mask, response mask, rollout logprobs."""
    n = len(samples)
    out = {k: torch.zeros(n, T) for k in ("loss_mask", "response_mask", "rollout_logprobs")}
    for i, s in enumerate(samples):
        R = s.response_length
        out["loss_mask"][i, :R] = torch.tensor(s.loss_mask, dtype=torch.float32)
        out["response_mask"][i, :R] = 1.0
        out["rollout_logprobs"][i, :R] = torch.tensor(s.rollout_logprobs)
    return out


def unpack(values: torch.Tensor, batch: dict) -> torch.Tensor:
    """(1, R) values of a packed row → (n, T), zero where a sample has no token (differentiable)."""
    rows, cols = batch["scatter"]
    n, T = batch["loss_mask"].shape
    return values.new_zeros(n, T).index_put((rows, cols), values.reshape(-1))
