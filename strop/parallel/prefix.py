"""Shared-prefix ("tree") rows: a group's samples forwarded with their common prefix once.

The n samples of a GRPO group start with the same prompt (a multi-turn group's, with the same first
turns), and a padded or packed micro-batch forwards and backpropagates that prefix n times. A shared
row lays a group out as its longest common prefix once, then each sample's own tokens after it:

    [ prefix (positions 0..S-1) | sample 0's rest (S..) | sample 1's rest (S..) | ... ]

A 4D mask lets each sample's tokens see the prefix and their own earlier tokens, nothing else, and
position ids continue at S, so every token sees exactly what it sees in its own padded row: the
logprobs are the same function of the weights, and the gradient of every sample's loss flows into
the prefix's activations through attention (summed over the samples, as n separate rows would sum
it). Each response token is read where its own sequence puts it; the hidden state that predicts it
is the one of its sequence's previous token (``pred_positions``), which for a sample's first own
token is the prefix's last. Losses stay per sample: the row is unpacked to (n, T) as a packed row is.

Exact by construction (it is a different layout of the same computation); with fp32 the results
equal the padded path's to rounding (tests/test_shared_prefix.py). The mask is dense (L, L): rows
here are a few groups of a micro-batch, so it stays small.
"""

from __future__ import annotations

import os

import torch

from strop.parallel.packing import per_sample, row_routes
from strop.types import Sample


def common_prefix(seqs: list[list[int]]) -> int:
    """Length of the longest common prefix of ``seqs`` (0 for fewer than two)."""
    # (the common prefix of the smallest and the largest in list order is everyone's: two C-level comparisons)
    return len(os.path.commonprefix(seqs)) if len(seqs) > 1 else 0


def shared_length(samples: list[Sample], members: list[int]) -> int:
    """How many first tokens the samples ``members`` lay out once: their common prefix, and where they carry
    routed experts (MoE routing replay) only as far as those agree too, since the shared columns replay one."""
    seqs = [samples[i].prompt_ids + samples[i].response_ids for i in members]
    S = common_prefix(seqs)
    routes = [samples[i].routed_experts for i in members]
    if S and any(r is not None for r in routes):
        if any(r is None for r in routes):
            return 0
        differ = torch.stack([(r[:S] != routes[0][:S]).flatten(1).any(1) for r in routes]).any(0)
        S = int(differ.nonzero()[0]) if differ.any() else S
    return S


def _clusters(samples: list[Sample]) -> list[list[int]]:
    """Indices of ``samples`` by group, each group where its first member is."""
    by: dict = {}
    for i, s in enumerate(samples):
        by.setdefault(s.group_id, []).append(i)
    return list(by.values())


ROW_TOKENS = 4096
"""Without ``train.max_tokens_per_micro_batch``, the most tokens of one shared row: its mask is (L, L), so a
micro-batch of long samples is cut into rows of at most this many tokens (a 16 MiB mask)."""


def shares(samples: list[Sample]) -> bool:
    """Whether two of ``samples`` share a prefix (else a shared row is just a packed one, with its (L, L) mask)."""
    return any(shared_length(samples, members) > 0 for members in _clusters(samples) if len(members) > 1)


def tree_tokens(samples: list[Sample]) -> int:
    """Tokens of the shared row of ``samples`` (what :func:`collate_shared_prefix` lays out)."""
    total = 0
    for members in _clusters(samples):
        S = shared_length(samples, members) if len(members) > 1 else 0
        total += S + sum(samples[i].total_length - S for i in members)
    return total


def collate_shared_prefix(samples: list[Sample]) -> dict[str, torch.Tensor]:
    """One row of ``samples``, each group's common prefix once (see the module), plus the per-sample
    (n, T) tensors the loss works on. The keys of :func:`strop.parallel.packing.collate_packed`, and
    ``pred_positions`` (1, R): the column whose hidden state predicts each response token."""
    T = max(max(s.response_length for s in samples), 1)
    ids: list[int] = []
    pos_ids: list[int] = []
    segment: list[int] = []  # each prefix and each sample's own tokens: a segment
    parent: list[int] = []  # a sample's own tokens also see their group's prefix segment (-1: none)
    positions: list[int] = []
    preds: list[int] = []
    rows: list[int] = []
    cols: list[int] = []
    spans: list[tuple[int, int, int]] = []  # (sample, start, end) of each column run: where its routes come from
    next_seg = 0
    for members in _clusters(samples):
        seqs = [samples[i].prompt_ids + samples[i].response_ids for i in members]
        S, base, prefix_seg = shared_length(samples, members) if len(members) > 1 else 0, len(ids), -1
        if S:
            spans.append((members[0], 0, S))
            prefix_seg, next_seg = next_seg, next_seg + 1
            ids += seqs[0][:S]
            pos_ids += range(S)
            segment += [prefix_seg] * S
            parent += [-1] * S
        for i, seq in zip(members, seqs):
            own, next_seg, start = next_seg, next_seg + 1, len(ids)
            spans.append((i, S, len(seq)))
            ids += seq[S:]
            pos_ids += range(S, len(seq))
            segment += [own] * (len(seq) - S)
            parent += [prefix_seg] * (len(seq) - S)
            column = lambda p: base + p if p < S else start + p - S  # noqa: E731  (p: a position in seq)
            P, R = len(samples[i].prompt_ids), samples[i].response_length
            positions += [column(p) for p in range(P, P + R)]
            preds += [column(p - 1) for p in range(P, P + R)]
            rows += [i] * R
            cols += range(R)
    L, routes = len(ids), row_routes(samples, spans)
    seg, par = torch.tensor(segment), torch.tensor(parent)
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    sees = (seg.unsqueeze(1) == seg.unsqueeze(0)) | (par.unsqueeze(1) == seg.unsqueeze(0))  # [query, key]
    return {
        "input_ids": torch.tensor([ids]),
        "attention_mask": (causal & sees).view(1, 1, L, L),
        "position_ids": torch.tensor([pos_ids]),
        "positions": torch.tensor([positions]),
        "pred_positions": torch.tensor([preds]),
        "scatter": (torch.tensor(rows), torch.tensor(cols)),
        **per_sample(samples, T),
        "tokens": L,
        "tokens_unshared": sum(s.total_length for s in samples),
        **({} if routes is None else {"routes": routes.unsqueeze(0)}),
    }


def split_by_group(
    indices: list[int], samples: list[Sample], micro_batch_size: int, max_tokens: int | None
) -> list[list[int]]:
    """Micro-batches that keep a group's samples together (so they can share their prefix): whole
    groups, in order, up to ``micro_batch_size`` samples and :data:`ROW_TOKENS` tokens of the shared row,
    or up to ``max_tokens`` tokens of it; a group larger than that is cut into pieces that each share
    their own prefix."""
    ordered = sorted(indices, key=lambda i: (samples[i].group_id, i))
    groups: list[list[int]] = []
    for i in ordered:
        if groups and samples[groups[-1][0]].group_id == samples[i].group_id:
            groups[-1].append(i)
        else:
            groups.append([i])
    tokens, budget = (lambda idx: tree_tokens([samples[i] for i in idx])), max_tokens or ROW_TOKENS
    fits = lambda idx: tokens(idx) <= budget and (max_tokens or len(idx) <= micro_batch_size)  # noqa: E731
    out: list[list[int]] = []
    for g in groups:
        pieces: list[list[int]] = [[]]
        for i in g:  # a group over the limit: pieces of it
            if pieces[-1] and not fits(pieces[-1] + [i]):
                pieces.append([])
            pieces[-1].append(i)
        for piece in pieces:
            if out and fits(out[-1] + piece):
                out[-1] += piece
            else:
                out.append(piece)
    return out


def off_reason(setting: bool | None, cp_size: int, attn: str | None) -> str:
    """Why a trainer lays out no shared-prefix rows ('' when it does): ``setting`` is train.shared_prefix,
    ``attn`` the model's attention implementation."""
    if setting is False:
        return "train.shared_prefix=false"
    if cp_size > 1:
        return f"context parallel ({cp_size} ranks) masks rows its own way"
    return "flash_attention_2 takes no (L, L) mask" if attn == "flash_attention_2" else ""


def describe(micro_batch_size: int, max_tokens: int | None, off: str) -> str:
    """The micro-batch layout, for the start lines; ``off`` as :func:`off_reason` gives it."""
    size = f"{max_tokens} tokens" if max_tokens else f"{micro_batch_size} samples"
    if not off:
        return f"micro-batches of {size}, each group's common prefix forwarded once (train.shared_prefix)"
    return f"{'packed' if max_tokens else 'padded'} micro-batches of {size}; no shared prefix ({off})"


def token_metrics(out: dict[str, float]) -> float:
    """Turn a step's token counts into its metrics, in place: ``train_tokens_forwarded`` and, when rows shared
    prefixes, ``shared_prefix_tokens_saved`` (against the tokens the same samples take in rows of their own).
    Returns the tokens forwarded."""
    tokens = out.pop("train_tokens")
    out["train_tokens_forwarded"] = tokens
    if "train_tokens_unshared" in out:
        out["shared_prefix_tokens_saved"] = 1.0 - tokens / max(out.pop("train_tokens_unshared"), 1.0)
    return tokens
