"""The embedded engine's sampler: temperature, top-k and top-p over one row of logits each, one token
per row drawn by inverse CDF from one uniform number (a two-level search over blocks of the
vocabulary, so the (B, V) probabilities are built only when a filter needs them), its logprob under
the temperature-scaled distribution the trainer computes.

A row is sampled as it would be alone: only the rows that ask for top-k or top-p go through the
filtered probabilities, and each filter applies to the rows that set it (the blocks' CDF and the
filtered softmax's round differently, so a row's token must not depend on its neighbours' settings)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

GREEDY_BELOW = 1e-5  # a temperature below this samples greedily (dividing by it overflows the logits)


def sample(
    logits,
    temperature,
    top_p,
    top_k,
    generators,
    default_generator: torch.Generator,
    top_n: int = 0,
    block_lse: torch.Tensor | None = None,
):
    """Pick one token per row; return it and its logprob under logits / temperature. With ``top_n``
    also the ``top_n`` largest logprobs of each row under that distribution and their token ids,
    ((B, top_n), (B, top_n)), most likely first. A row without its own generator draws from
    ``default_generator`` (the engine's). ``block_lse``: :func:`block_logsumexp` of ``logits`` where the
    caller computed it (the compiled decode step does, in its graph); used when every temperature is 1."""
    greedy = temperature < GREEDY_BELOW
    any_greedy = bool(greedy.any())
    t = torch.where(greedy, torch.ones_like(temperature), temperature)
    unscaled = bool((t == 1).all())
    scaled = logits if unscaled else logits / t.unsqueeze(-1)  # (B, V)
    blocks = _blocks(scaled)  # (B, V / chunk, chunk): the sampler's two levels
    if block_lse is None or not unscaled:
        block_lse = torch.logsumexp(blocks, dim=-1)
    lse = torch.logsumexp(block_lse, dim=-1, keepdim=True)  # (B, 1)
    # inverse-CDF sampling: one uniform number per row (drawing a Gumbel or exponential
    # per vocabulary entry costs more than a whole decoder layer on a CPU)
    uniform = torch.empty(len(scaled), 1)
    if all(g is None for g in generators):
        uniform.uniform_(generator=default_generator)
    else:
        for i, g in enumerate(generators):
            uniform[i].uniform_(generator=g if g is not None else default_generator)
    uniform = uniform.to(scaled.device)  # drawn on the host generator: the same numbers on every device
    # the whole distribution: never materialise the (B, V) probabilities
    sampled = _sample_blocks(blocks, block_lse, lse, uniform)
    filters = (top_k > 0) | (top_p < 1.0)
    if bool(filters.any()):  # those rows again, from their filtered probabilities
        rows = filters.nonzero().squeeze(-1)
        probs = torch.softmax(_filter(scaled[rows], top_k[rows], top_p[rows]), dim=-1)
        sampled[rows] = _invert_cdf(probs, uniform[rows])
    tokens = torch.where(greedy, torch.argmax(logits, dim=-1), sampled) if any_greedy else sampled
    # logprob under the full temperature-scaled distribution (what the trainer computes)
    logprobs = scaled.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - lse.squeeze(-1)
    if not top_n:
        return tokens, logprobs
    values, ids = torch.topk(scaled, min(top_n, scaled.shape[-1]), dim=-1)  # (B, top_n)
    return tokens, logprobs, (values - lse, ids)


def _filter(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """``scaled`` (B, V) with the tokens outside each row's top-k, then outside its top-p, at -inf;
    a row's filter leaves the other rows as they are."""
    filtered = scaled
    if bool((top_k > 0).any()):
        k = torch.where(top_k > 0, top_k, torch.full_like(top_k, scaled.shape[-1]))
        kth = torch.sort(filtered, dim=-1, descending=True).values.gather(-1, (k - 1).unsqueeze(-1))
        filtered = filtered.masked_fill((filtered < kth) & (top_k > 0).unsqueeze(-1), float("-inf"))
    if bool((top_p < 1.0).any()):
        sorted_logits, order = torch.sort(filtered, dim=-1, descending=True)
        probs_sorted = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the mass before it already reaches top_p (the first always stays)
        drop_sorted = (probs_sorted.cumsum(-1) - probs_sorted) >= top_p.unsqueeze(-1)
        drop_sorted &= (top_p < 1.0).unsqueeze(-1)  # (a cumsum that rounds up to 1 drops nothing at top_p 1)
        drop_sorted[..., 0] = False  # (a top_p that rounds to 0 in float32 would drop it too)
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        filtered = filtered.masked_fill(drop, float("-inf"))
    return filtered


_CHUNK = 1024  # vocabulary entries per block of the two-level sampler


def block_logsumexp(logits: torch.Tensor) -> torch.Tensor:
    """The logsumexp of each block of the sampler's vocabulary blocks, (B, V / chunk): what :func:`sample` computes
    first (measured: 4.7 ms of a 50 ms bf16 decode step at 64 rows as eager passes over the logits)."""
    return torch.logsumexp(_blocks(logits), dim=-1)


def _blocks(scaled: torch.Tensor, chunk: int = _CHUNK) -> torch.Tensor:
    """(B, V) logits as (B, V / chunk, chunk) blocks, the tail padded with -inf (no mass)."""
    B, V = scaled.shape
    if V % chunk:
        scaled = F.pad(scaled, (0, chunk - V % chunk), value=float("-inf"))
    return scaled.view(B, -1, chunk)


def _pick(mass: torch.Tensor, blocks: torch.Tensor, uniform: torch.Tensor, weigh) -> torch.Tensor:
    """Two-level inverse CDF: the first index whose cumulative weight reaches ``(1 - u) * total``,
    per row. ``mass`` (B, C) is each block's total weight; ``weigh`` turns the chosen block's
    entries (B, chunk) into their weights, so only one block per row is scanned in full. The
    index found always carries weight."""
    B, _, chunk = blocks.shape
    ccdf = mass.cumsum(-1)  # (B, C)
    target = (1.0 - uniform) * ccdf[:, -1:]  # in (0, total]
    which = torch.searchsorted(ccdf, target).clamp(max=ccdf.shape[1] - 1)  # (B, 1)
    before = torch.where(which > 0, ccdf.gather(-1, (which - 1).clamp(min=0)), torch.zeros_like(target))
    local = weigh(blocks.gather(1, which.unsqueeze(-1).expand(B, 1, chunk)).squeeze(1)).cumsum(-1)  # (B, chunk)
    rest = torch.minimum(target - before, local[:, -1:])  # (0, chunk total]
    where = torch.searchsorted(local, rest).clamp(max=chunk - 1)
    return (which * chunk + where).squeeze(-1)


def _sample_blocks(
    blocks: torch.Tensor, block_lse: torch.Tensor, lse: torch.Tensor, uniform: torch.Tensor
) -> torch.Tensor:
    """:func:`_invert_cdf` on ``softmax`` of the logits in ``blocks`` (B, C, chunk) without building
    it: each block's mass comes from its logsumexp ``block_lse`` (B, C), and only the chosen block
    of each row is exponentiated (measured: materialising the (B, V) probabilities took 7 of
    the 10 ms the sampler spent per decode step at batch 64)."""
    return _pick(torch.exp(block_lse - lse), blocks, uniform, lambda chosen: torch.exp(chosen - lse))


def _invert_cdf(probs: torch.Tensor, uniform: torch.Tensor, chunk: int = _CHUNK) -> torch.Tensor:
    """:func:`_pick` over the probabilities ``probs`` (B, V), the tail padded with zeros."""
    B, V = probs.shape
    if V % chunk:
        probs = F.pad(probs, (0, chunk - V % chunk))
    blocks = probs.view(B, -1, chunk)
    return _pick(blocks.sum(-1), blocks, uniform, lambda chosen: chosen)
