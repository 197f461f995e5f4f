"""Per-token logprobs and entropy of response tokens, without full logits.

The lm_head runs only at positions that predict a response token (never over
the prompt), and, with ``chunk_size > 0``, through
:func:`strop.train.chunked_logprob.chunked_logprobs`, which never materialises
the (tokens, vocab) logits of the micro-batch and recomputes them per chunk in
backward. ``chunk_size=0`` is the plain path (full logits), kept as the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from strop.parallel.tensor import vocab_slice
from strop.train.chunked_logprob import chunked_logprobs, naive_logprobs


def response_logprobs(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_positions: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    chunk_size: int = 1024,
    position_ids: torch.Tensor | None = None,
    cp=None,
    pred_positions: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprobs of the tokens at ``response_positions`` under ``log_softmax(logits / temperature)``.

    input_ids, attention_mask: (B, L), right-padded. response_positions: (B, T)
    indices into L of each response token (padding entries may repeat any
    valid index; the caller masks them). A packed row passes a 4D block-diagonal
    ``attention_mask`` and its own ``position_ids``; a shared-prefix row
    (strop.parallel.prefix) also ``pred_positions``, the columns whose hidden states predict
    the response tokens (default: each one's column - 1). Returns logprobs (B, T) and, if asked,
    the entropy (B, T) of the same distribution (detached unless ``entropy_grad``:
    an entropy bonus needs its gradient, a metric does not).

    With ``cp`` (a :class:`strop.parallel.context.ContextParallelPlan` for this batch)
    the backbone runs on this CP rank's tokens only, the lm_head on its response
    entries only, and the results are gathered into the same (B, T) on every CP rank.
    """
    h, targets, restore = response_hidden(
        model.get_decoder() if hasattr(model, "get_decoder") else model.model,
        input_ids,
        attention_mask,
        response_positions,
        position_ids,
        cp,
        pred_positions,
    )
    head = model.get_output_embeddings()
    temperature = temperature if temperature > 0 else 1.0  # greedy rollouts report the raw distribution
    split = vocab_slice(head.weight)  # tensor parallel: this rank's rows of the vocabulary
    if split is not None:
        weight, start, group = split
        logprobs, entropy = chunked_logprobs(
            h,
            weight,
            targets,
            temperature=temperature,
            with_entropy=with_entropy,
            chunk_size=chunk_size if chunk_size > 0 else max(1, h.shape[0]),
            group=group,
            vocab_start=start,
        )
    elif getattr(head, "bias", None) is not None or chunk_size <= 0:
        logits = head(h).float() / temperature  # (N, V): the plain path
        logp_all = torch.log_softmax(logits, dim=-1)
        logprobs = logp_all.gather(-1, targets.reshape(-1, 1)).squeeze(-1)
        entropy = -(logp_all.exp() * logp_all).sum(-1) if with_entropy else None
    else:
        logprobs, entropy = chunked_logprobs(
            h, head.weight, targets, temperature=temperature, chunk_size=chunk_size, with_entropy=with_entropy
        )
    if entropy is not None and not entropy_grad:
        entropy = entropy.detach()  # a metric: its backward work is skipped entirely
    return restore(logprobs), (restore(entropy) if entropy is not None else None)


def response_hidden(
    backbone, input_ids, attention_mask, response_positions, position_ids=None, cp=None, pred_positions=None
):
    """Hidden states that predict each response token: (N, H), their targets (N,), and ``restore``,
    which turns per-entry values (N,) back into (B, T).

    Without ``cp``, N = B * T. With it, N is this CP rank's share of the entries and
    ``restore`` gathers every rank's share (a collective every CP rank must join).
    """
    B, T = response_positions.shape
    if cp is not None:
        with cp.active():
            hidden = backbone(
                input_ids=cp.local(input_ids), attention_mask=cp.attention_mask, position_ids=cp.position_ids
            ).last_hidden_state  # (B, m, H)
        return cp.entry_hidden(hidden), cp.targets(input_ids), cp.gather
    if position_ids is None:
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    L, n = input_ids.shape[1], getattr(backbone, "sequence_parallel_size", 1)
    if L % n:  # sequence parallel splits the columns evenly: pad them (masked, dropped again below)
        pad = (0, n - L % n)
        input_ids, position_ids = F.pad(input_ids, pad), F.pad(position_ids, pad)
        if attention_mask.dim() == 4:  # a packed / shared-prefix row's (1, 1, L, L): pad columns only see themselves
            attention_mask = F.pad(attention_mask, (0, pad[1], 0, pad[1]))
            attention_mask[..., range(L, L + pad[1]), range(L, L + pad[1])] = True
        else:
            attention_mask = F.pad(attention_mask, pad)
    hidden = backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).last_hidden_state[
        :, :L
    ]
    # the token at position p is predicted by the hidden state at p - 1 (in a shared-prefix row: its sequence's)
    pred_pos = (response_positions - 1).clamp(min=0) if pred_positions is None else pred_positions  # (B, T)
    h = hidden.gather(1, pred_pos.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))  # (B, T, H)
    targets = input_ids.gather(1, response_positions)  # (B, T)
    return h.reshape(B * T, -1), targets.reshape(-1), lambda values: values.reshape(B, T)


class LogprobModule(nn.Module):
    """A causal LM whose forward returns response logprobs (and entropy): one module for FSDP's hooks."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    def forward(
        self,
        input_ids,
        attention_mask,
        positions,
        position_ids=None,
        *,
        temperature=1.0,
        with_entropy=False,
        entropy_grad=False,
        chunk_size=1024,
        cp=None,
        pred_positions=None,
    ):
        lp, ent = response_logprobs(
            self.lm,
            input_ids,
            attention_mask,
            positions,
            temperature=temperature,
            with_entropy=with_entropy,
            entropy_grad=entropy_grad,
            chunk_size=chunk_size,
            position_ids=position_ids,
            cp=cp,
            pred_positions=pred_positions,
        )
        # FSDP hooks the outputs for backward; fresh tensors, not views, keep those hooks intact
        return lp.clone(), (ent.clone() if ent is not None else None)


__all__ = ["LogprobModule", "response_logprobs", "response_hidden", "naive_logprobs"]
