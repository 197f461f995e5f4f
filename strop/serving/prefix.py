"""The prefill of a batch of prompts (:meth:`strop.serving.kvdecode.LlamaDecoder.prefill`'s default path), with the
tokens every prompt starts with computed once.

Prompts admitted together usually share their start: the chat template and its system prompt (27 of the 44-47
tokens of each prompt in ``bench/engine.py``'s batches). :func:`prefill_shared` forwards that common prefix as one
row, then every prompt's remaining tokens against the prefix's keys and values, and lays the result out as one
padded forward of the whole prompts would have (the same function of the same tokens; only the rounding differs, the
attention running over another layout of the same keys, and neither is closer to a float64 forward:
``bench/prefill.py``). The batch-invariant prefills
(:mod:`strop.serving.invariant`) and models with routed experts, whose routes are recorded per prompt token, keep the
whole-prompt forward."""

from __future__ import annotations

import torch
import torch.nn.functional as F

MIN_SHARED = 8  # shorter common prefixes are forwarded with each prompt (no gain worth the second call)


def left_padded(prompts, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists as the prefill takes them: ids (N, P), each prompt right-aligned after ``pad``, and their lengths."""
    P = max(map(len, prompts))
    ids = torch.full((len(prompts), P), pad, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, P - len(p) :] = torch.tensor(p)
    return ids, torch.tensor([len(p) for p in prompts])


def common_prefix(ids: torch.Tensor, lengths: torch.Tensor) -> int:
    """How many leading tokens all the left-padded prompts ``ids`` (N, P) share, leaving every prompt one token of
    its own at least (its last position gives the prompt's logits)."""
    N, P = ids.shape
    shortest = int(lengths.min()) if N else 0
    if N < 2 or shortest < 2:
        return 0
    firsts = torch.stack([ids[j, P - n : P - n + shortest] for j, n in enumerate(lengths.tolist())])
    differ = (firsts != firsts[:1]).any(0).nonzero()
    return min(int(differ[0]) if len(differ) else shortest, shortest - 1)


def prefill_shared(dec, ids: torch.Tensor, lengths: torch.Tensor, lin):
    """:func:`forward_prompts` of ``ids`` (N, P), left-padded, with their common prefix forwarded once when it is at
    least :data:`MIN_SHARED` tokens long. Returns last-position logits (N, V) and keys and values
    (layers, N, KV, P, D), each prompt's right-aligned."""
    shared = common_prefix(ids, lengths)
    if shared < MIN_SHARED:
        return forward_prompts(dec, ids, lengths, lin)
    N, P = ids.shape
    dec.shared_tokens = (N - 1) * shared
    first = P - int(lengths[0])
    _, pk, pv = forward_prompts(dec, ids[:1, first : first + shared], lengths.new_tensor([shared]), lin, head=False)
    # every prompt's own tokens sit right-aligned in the last P - shared columns
    logits, sk, sv = forward_prompts(dec, ids[:, shared:], lengths - shared, lin, past=(pk, pv))
    keys = sk.new_zeros(dec.n_layers, N, dec.n_kv, P, dec.head_dim)
    values = torch.zeros_like(keys)
    keys[..., shared:, :], values[..., shared:, :] = sk, sv
    starts = P - lengths
    for s in starts.unique().tolist():  # the prefix goes just before each prompt's own tokens
        rows = (starts == s).nonzero().squeeze(-1)
        keys[:, rows, :, s : s + shared] = pk.expand(-1, len(rows), -1, -1, -1)
        values[:, rows, :, s : s + shared] = pv.expand(-1, len(rows), -1, -1, -1)
    return logits, keys, values


def forward_prompts(dec, ids: torch.Tensor, lengths: torch.Tensor, lin, past=None, head: bool = True):
    """The decoder's forward of left-padded prompts ``ids`` (N, P), ``lengths`` tokens each. With ``past`` (keys,
    values) of a common prefix (layers, 1, KV, L, D), the prompts continue it: their positions start at L and every
    query also attends the prefix's L columns. Returns last-position logits (N, V) and the prompts' own keys and
    values (layers, N, KV, P, D), rotary embedding applied (no logits, None, with ``head=False``)."""
    N, P = ids.shape
    dec.routes = []
    dev = ids.device
    done = 0 if past is None else past[0].shape[3]
    cols = torch.arange(P, device=dev)
    valid = cols.unsqueeze(0) >= (P - lengths).unsqueeze(1)  # (N, P)
    position_ids = (valid.long().cumsum(-1) - 1).clamp(min=0) + done
    causal = cols.unsqueeze(0) <= cols.unsqueeze(1)  # (P, P): query row, key column
    mask = causal.unsqueeze(0) & valid.unsqueeze(1)
    mask = mask | torch.eye(P, dtype=torch.bool, device=dev).unsqueeze(0)  # pad queries see themselves
    if done:
        mask = torch.cat([mask.new_ones(N, P, done), mask], dim=-1)  # (N, P, L + P): the prefix, then the prompt
    mask = mask.unsqueeze(1)  # (N, 1, P, [L +] P)
    x = dec.backbone.embed_tokens(ids)
    cos, sin = dec.backbone.rotary_emb(x, position_ids)  # (N, P, D)
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)  # broadcast over heads: (N, P, 1, D)
    keys = torch.empty(dec.n_layers, N, dec.n_kv, P, dec.head_dim, dtype=x.dtype, device=dev)
    values = torch.empty_like(keys)
    for i, (ln1, qkv, o_proj, ln2, gate_up, down, act) in enumerate(dec.layers):
        q, k, v = dec._split_rope(lin(qkv, dec._norm(ln1, x)), cos, sin, dec.qk_norms[i])
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (N, heads, P, D)
        keys[i], values[i] = k, v
        if done:
            k = torch.cat([past[0][i].expand(N, -1, -1, -1), k], dim=2)
            v = torch.cat([past[1][i].expand(N, -1, -1, -1), v], dim=2)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=dec.scale, enable_gqa=dec.group > 1)
        x = x + lin(o_proj, o.transpose(1, 2).reshape(N, P, -1))
        x = x + dec._mlp(dec._norm(ln2, x), gate_up, down, act, lin)
    if not head:
        return None, keys, values
    if dec.batch_invariant:
        return dec.head(dec._norm(dec.backbone.norm, x[:, -1:]))[:, 0], keys, values
    return dec.head(dec._norm(dec.backbone.norm, x[:, -1])), keys, values
