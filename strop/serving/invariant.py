"""Batch invariance for the fast decoder (:class:`strop.serving.kvdecode.LlamaDecoder` with
``batch_invariant=True``): a row's tokens and logprobs are bitwise the same whatever the other rows
of its batch are, how many there are, and in which slot it runs.

What changes a row's numbers with its batch, measured on a 2-core AVX-512 Xeon (torch 2.13,
oneMKL 2024.2, oneDNN 3.12), and what this module does about it:

- **Linear layers in a decode step.** MKL's sgemm gives one row at a time (M = 1, its gemv path)
  other numbers than the same row among 2 or more; ``F.linear`` has more classes still (M = 1,
  2-15, 16-56 and 57+ for a 1536 x 576 weight). The pre-packed sgemm (``_mkl_linear``, what the
  decoder uses in fp32 on a CPU) gives a row the same numbers at every M from 2 to 1024 and every
  position, for every weight shape tried (32 x 96 up to 11008 x 4096). So a step computes at least
  two rows there (a single row is doubled). Elsewhere (bf16 through oneDNN, whose rows change
  beyond 32 rows for K >= 2048; no MKL; a GPU) each row is its own ``F.linear`` call.
- **Attention over the padded cache.** A batch reads the columns ``lo .. col`` with the columns
  before a row's start masked; the fused kernel's blocks then fall differently over the row's own
  keys than when it runs alone. Here each run of adjacent rows with the same start attends exactly
  its own columns (the kernel is batch-invariant for equal key lengths, measured).
- **Prefill.** Prompts admitted together are left-padded to the longest, so the matmuls see
  another M and the attention another key length. Here each distinct prompt is prefilled alone,
  unpadded (a group's shared prompt still once).

RMSNorm, the rotary embedding, SiLU, the residual adds and the sampler's reductions (logsumexp,
softmax, sort, cumsum) gave each row the same bits at every batch size (1-64) and position.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from strop.serving.linear import PackedLinear


def packed_rows(rows: int) -> int:
    """The row count a step's weights are packed for: at least two (see :func:`rows_linear`)."""
    return max(rows, 2)


def rows_linear(lin: PackedLinear, x: torch.Tensor) -> torch.Tensor:
    """``lin(x)`` for ``x`` (rows, in), each row's result independent of the other rows: on packed fp32
    weights in calls of exactly the rows they are packed for (at least 2; the last call padded with
    zero rows), elsewhere one ``F.linear`` call per row."""
    if lin.packed is not None and lin.packed_kernel == "mkl":
        R = lin.packed_rows
        if R < 2:
            raise RuntimeError(f"weights packed for {R} rows: sgemm's one-row path rounds otherwise")
        if x.shape[0] == R:
            return lin(x)
        outs = []
        for chunk in x.split(R):
            n = chunk.shape[0]
            outs.append(lin(chunk if n == R else torch.cat([chunk, chunk.new_zeros(R - n, chunk.shape[1])]))[:n])
        return torch.cat(outs)
    return torch.cat([F.linear(row, lin.weight, lin.bias) for row in x.split(1)])


def attend_rows(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, starts: list[int], col: int, scale: float
) -> torch.Tensor:
    """Attention of ``q`` (B, KV, G, D) against one layer's cache ``keys``, ``values`` (B, KV, C, D):
    row ``r`` sees exactly the columns ``starts[r] .. col``. Adjacent rows with the same start share
    one call."""
    outs, a, B = [], 0, q.shape[0]
    while a < B:
        b = a + 1
        while b < B and starts[b] == starts[a]:
            b += 1
        s = starts[a]
        outs.append(
            F.scaled_dot_product_attention(q[a:b], keys[a:b, :, s : col + 1], values[a:b, :, s : col + 1], scale=scale)
        )
        a = b
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def prefill_each(prefill, ids: torch.Tensor, lengths: torch.Tensor):
    """``prefill(ids, lengths)`` (see :meth:`LlamaDecoder.prefill`) one prompt at a time, unpadded,
    with the results laid out as one padded call returns them: logits (N, V), keys and values
    (layers, N, KV, P, D), each prompt's right-aligned (the columns before it zero)."""
    N, P = ids.shape
    logits, keys, values = [], None, None
    for j, n in enumerate(lengths.tolist()):
        lg, k, v = prefill(ids[j : j + 1, P - n :], lengths[j : j + 1])
        if keys is None:
            keys = k.new_zeros(k.shape[0], N, k.shape[2], P, k.shape[4])
            values = torch.zeros_like(keys)
        keys[:, j, :, P - n :] = k[:, 0]
        values[:, j, :, P - n :] = v[:, 0]
        logits.append(lg)
    return torch.cat(logits), keys, values


def prefill_rows(dec, tokens: int) -> int:
    """The row count :func:`prefill_packed` computes ``tokens`` prompt tokens in: the running step's
    (no repacking) unless that takes more than 8 calls per layer, then up to 256 rows per call."""
    rows = dec.head.packed_kernel == "mkl" and dec.head.packed_rows
    if rows and rows >= 2 and -(-tokens // rows) <= 8:
        return rows
    return packed_rows(min(tokens, 256))


def prefill_packed(dec, ids: torch.Tensor, lengths: torch.Tensor):
    """:meth:`LlamaDecoder.prefill` for a decoder on packed fp32 weights: every prompt's tokens, unpadded,
    through the linear layers together (:func:`rows_linear`, whose rows do not depend on each other),
    each prompt's attention alone (causal over exactly its own tokens)."""
    N, P = ids.shape
    sizes = lengths.tolist()
    flat = torch.cat([ids[j, P - n :] for j, n in enumerate(sizes)])  # (T,)
    dec._sync(prefill_rows(dec, len(flat)))
    x = dec.backbone.embed_tokens(flat)  # (T, hidden)
    positions = torch.cat([torch.arange(n, device=ids.device) for n in sizes])
    cos, sin = dec.backbone.rotary_emb(x, positions.unsqueeze(0))  # (1, T, D)
    cos, sin = cos[0].unsqueeze(1), sin[0].unsqueeze(1)  # broadcast over heads: (T, 1, D)
    keys = torch.zeros(dec.n_layers, N, dec.n_kv, P, dec.head_dim, dtype=x.dtype, device=x.device)
    values = torch.zeros_like(keys)
    ends = torch.tensor(sizes).cumsum(0).tolist()
    for i, (ln1, qkv, o_proj, ln2, gate_up, down, act) in enumerate(dec.layers):
        q, k, v = dec._split_rope(rows_linear(qkv, dec._norm(ln1, x)), cos, sin, dec.qk_norms[i])
        q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # (heads, T, D)
        outs = []
        for j, (n, end) in enumerate(zip(sizes, ends)):
            a = end - n
            keys[i, j, :, P - n :], values[i, j, :, P - n :] = k[:, a:end], v[:, a:end]
            o = F.scaled_dot_product_attention(
                q[None, :, a:end],
                k[None, :, a:end],
                v[None, :, a:end],
                is_causal=True,
                scale=dec.scale,
                enable_gqa=dec.group > 1,
            )
            outs.append(o[0].transpose(0, 1).reshape(n, -1))
        x = x + rows_linear(o_proj, torch.cat(outs))
        g, u = rows_linear(gate_up, dec._norm(ln2, x)).chunk(2, dim=-1)
        x = x + rows_linear(down, act(g) * u)
    last = torch.tensor(ends, device=x.device) - 1
    return rows_linear(dec.head, dec._norm(dec.backbone.norm, x[last])), keys, values
