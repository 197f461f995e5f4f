"""Batch invariance for the fast decoder (:class:`strop.serving.kvdecode.LlamaDecoder` with
``batch_invariant=True``): a row's tokens and logprobs are bitwise the same whatever the other rows
of its batch are, how many there are, and in which slot it runs.

What changes a row's numbers with its batch, measured on a 2-core AVX-512 Xeon (torch 2.13,
oneMKL 2024.2, oneDNN 3.12), and what this module does about it:

- **Linear layers in a decode step.** MKL's sgemm gives one row at a time (M = 1, its gemv path)
  other numbers than the same row among 2 or more; ``F.linear`` has more classes still (M = 1,
  2-15, 16-56 and 57+ for a 1536 x 576 weight). The pre-packed sgemm (``_mkl_linear``) gives a row
  the same numbers at every M from 2 to 1024 and every position on that Xeon, for every weight shape
  tried (32 x 96 up to 11008 x 4096). On an AMD EPYC (AVX-512, no AMX) the same call agrees at
  M = 4, 8 and every M from 12 up, and gives the rows of the last partial block other numbers at
  M = 2-3, 5-7 and 9-11. So the row counts are not assumed: :func:`mkl_row_counts` measures them on
  the CPU it runs on (once per process), and a step computes its rows in a call of a row count that
  agrees (:func:`packed_rows`: the rows, or the next count up that agrees, padded with zero rows).
  Where no count agrees, or without MKL (bf16 through oneDNN, whose rows change beyond 32 rows for
  K >= 2048; a GPU), each row is its own ``F.linear`` call.
- **Attention over the padded cache.** A batch reads the columns ``lo .. col`` with the columns
  before a row's start masked; the fused kernel's blocks then fall differently over the row's own
  keys than when it runs alone. And rows of equal key lengths in one call are not safe either: on the
  EPYC, with two threads, the fused kernel gives a batch's rows other bits than alone. Here each row
  attends exactly its own columns in a call of its own (:func:`attend_one`).
- **Prefill.** Prompts admitted together are left-padded to the longest, so the matmuls see
  another M and the attention another key length. Here each distinct prompt is prefilled alone,
  unpadded (a group's shared prompt still once).

RMSNorm, the rotary embedding, SiLU, the residual adds and the sampler's reductions (logsumexp,
softmax, sort, cumsum) gave each row the same bits at every batch size (1-64) and position.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from strop.serving.linear import PackedLinear


# the row counts measured: every count to 32 (the blocks of any sgemm kernel in use), then beyond and at the
# multiples where a kernel changes its blocking
PROBED = (*range(1, 33), 47, 48, 63, 64, 65, 96, 127, 128, 129, 255, 256, 257)


@functools.cache
def mkl_row_counts(threads: int) -> tuple[tuple[int, ...], int] | None:
    """The row counts at which MKL's pre-packed sgemm gives every row the numbers it gets among the most rows
    probed, on this CPU with ``threads`` OpenMP threads: (the counts that agree below the threshold, the
    threshold from which every count agrees). None when no threshold exists (the largest counts disagree),
    or without MKL. Measured with one row repeated at every position (a row's result in a matmul depends
    on its place in the kernel's blocks, never on the other rows' values) at two inner sizes."""
    if not (torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight")):
        return None
    g = torch.Generator().manual_seed(0)
    agree = set(PROBED)
    for k in (96, 1024):
        w, v = torch.randn(64, k, generator=g), torch.randn(1, k, generator=g)
        outs = {}
        for m in PROBED:
            x = v.expand(m, k).contiguous()
            outs[m] = torch.ops.mkl._mkl_linear(x, torch.ops.mkl._mkl_reorder_linear_weight(w, m), w, None, m)
        want = outs[PROBED[-1]][0]
        agree &= {m for m, out in outs.items() if bool((out == want).all())}
    if PROBED[-1] not in agree:
        return None
    threshold = PROBED[-1]
    for m in reversed(PROBED):
        if m not in agree:
            break
        threshold = m
    return tuple(sorted(m for m in agree if m < threshold)), threshold


def packed_rows(rows: int) -> int:
    """The row count a step's ``rows`` rows are computed in on pre-packed fp32 weights (see :func:`rows_linear`):
    the smallest count from ``rows`` up at which every row gets the numbers it gets among any other agreeing
    count (:func:`mkl_row_counts`; at least two where nothing is measured)."""
    counts = mkl_row_counts(torch.get_num_threads())
    if counts is None:
        return max(rows, 2)
    below, threshold = counts
    return next((m for m in below if m >= rows), max(rows, threshold))


def exact_mkl() -> bool:
    """Whether batch-invariant steps can run on MKL's pre-packed sgemm on this CPU (some row counts agree)."""
    return mkl_row_counts(torch.get_num_threads()) is not None


def rows_linear(lin: PackedLinear, x: torch.Tensor) -> torch.Tensor:
    """``lin(x)`` for ``x`` (rows, in), each row's result independent of the other rows: on packed fp32
    weights in calls of exactly the rows they are packed for (at least 2; the last call padded with
    zero rows), elsewhere one ``F.linear`` call per row."""
    if lin.packed is not None and lin.packed_kernel == "mkl":
        R = lin.packed_rows
        if R != packed_rows(R):
            raise RuntimeError(f"weights packed for {R} rows: this CPU's sgemm rounds a row otherwise there")
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
    row ``r`` sees exactly the columns ``starts[r] .. col``, in a call of its own (:func:`attend_one`)."""
    return torch.cat(
        [
            attend_one(q[r], keys[r, :, s : col + 1], values[r, :, s : col + 1], scale)
            for r, s in enumerate(starts[: q.shape[0]])
        ]
    )


def attend_one(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """One row's attention, ``q`` (KV, G, D) over ``keys``, ``values`` (KV, T, D), as the call it gets alone
    (1, KV, G, D): CPU flash attention splits a batch's work by the thread count, and on a 2-core AMD EPYC
    the rows of a batch of two or more got other bits than alone from T = 17 keys on (with one thread they
    agreed). A call per row is the same call whatever the batch."""
    return F.scaled_dot_product_attention(q[None], keys[None], values[None], scale=scale)


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
    if rows and packed_rows(rows) == rows and -(-tokens // rows) <= 8:
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
