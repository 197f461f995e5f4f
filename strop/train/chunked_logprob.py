"""Per-token logprobs and entropy through the lm_head without materialising (N, V) logits.

Math. With hidden states h (N, H), output projection W (V, H), temperature T and
targets t (N,), the row-wise distribution is

    z = h @ W.T / T,   p = softmax(z),   lse = logsumexp(z)
    logprob_i = z[i, t_i] - lse_i
    entropy_i = -sum_v p_iv log p_iv = lse_i - sum_v p_iv z_iv

and for upstream gradients g_lp = dL/dlogprob, g_H = dL/dentropy,

    dL/dz = g_lp * (onehot(t) - p) + g_H * (-p * (log p + H))
    dL/dh = dL/dz @ W / T,         dL/dW = dL/dz.T @ h / T.

Memory. ``chunked_logprobs`` walks the N rows in chunks of ``chunk_size`` and holds
at most two (chunk_size, V) fp32 buffers at once (reused across chunks), so its
extra memory is about 2 * chunk_size * V * 4 bytes plus one (V, H) fp32 gradient
accumulator (and an fp32 copy of W when W is not fp32), independent of N. The
plain path (``naive_logprobs``) keeps several (N, V) fp32 tensors alive for
backward (logits, log_softmax, its exp, ...).

Backward does not keep any logits: it saves only hidden, weight, targets and
the per-token logsumexp / entropy, and recomputes each chunk's logits. That is
four (N, H) x (H, V)-sized matmuls instead of autograd's three (forward,
recompute, dL/dh, dL/dW), partly paid back by far fewer elementwise passes
over (N, V) tensors and no multi-GiB allocations. When the entropy is not
wanted (or gets no gradient) the entropy terms and the second buffer are skipped.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def naive_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Reference: full fp32 logits, log_softmax, gather. Same contract as ``chunked_logprobs``."""
    dtype = _compute_dtype(hidden, weight)
    logits = hidden.to(dtype) @ weight.to(dtype).T  # (N, V)
    if temperature != 1.0:
        logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1)  # (N, V)
    lp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (N,)
    ent = -(logp.exp() * logp).sum(-1) if with_entropy else None  # (N,)
    return lp, ent


def chunked_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_entropy: bool = True,
    group=None,
    vocab_start: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log_softmax(hidden @ weight.T / temperature)[targets]`` and its entropy, chunked over rows.

    hidden: (N, H), weight: (V, H) (may be tied to the input embedding),
    targets: (N,) long. Returns logprobs (N,) and entropy (N,) (None when
    ``with_entropy=False``), both computed in fp32 (fp64 if an input is fp64)
    and both differentiable w.r.t. hidden and weight. Gradients come back in
    the inputs' dtypes.

    Peak extra memory is about 2 * chunk_size * V * 4 bytes (two reused
    (chunk, V) buffers) plus a (V, H) fp32 gradient accumulator, whatever N is.
    Backward recomputes each chunk's logits instead of saving them.

    Vocabulary parallel (tensor parallel's output projection): with ``group``, ``weight`` is this rank's
    rows ``vocab_start : vocab_start + V`` of the whole projection, ``hidden`` and ``targets`` are the same
    on every rank of ``group``, and so are the results. Per chunk the ranks combine their column maxima
    (all-reduce MAX), then their sums of exp, of p * z and their target logit (one all-reduce SUM of a
    (3, C) tensor); backward sums the ranks' parts of dL/dhidden (one all-reduce of (N, H)). No rank
    holds more than its (chunk, V) slice of the logits.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"expected hidden (N, H) and weight (V, H), got {tuple(hidden.shape)} and {tuple(weight.shape)}"
        )
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"expected targets ({hidden.shape[0]},), got {tuple(targets.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    lp, ent = _ChunkedLogprob.apply(
        hidden, weight, targets.long(), float(temperature), int(chunk_size), bool(with_entropy), group, int(vocab_start)
    )
    return lp, (ent if with_entropy else None)


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    # fp32 always; fp64 only so that gradcheck can run in double precision
    return torch.float64 if torch.float64 in (hidden.dtype, weight.dtype) else torch.float32


class _ChunkedLogprob(torch.autograd.Function):
    # Each chunk's logits are held transposed, as a contiguous (V, C) buffer: with MKL on CPU,
    # W @ h.T into (V, C) and grad_W += (V, C) @ (C, H) are ~5-12% faster than the (C, V)
    # layout, and the matmuls are nearly all of the cost. Row reductions over V then become
    # column reductions: torch's sum, not a ones-vector GEMV, whose fp32 accumulation over
    # 49152 entries was off by ~1e-4 in the logsumexp.

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk_size, with_entropy, group=None, vocab_start=0):
        n, v = hidden.shape[0], weight.shape[0]
        dtype = _compute_dtype(hidden, weight)
        dev = hidden.device
        w = weight.to(dtype)  # (V, H); no copy when weight is already in the compute dtype
        inv_t = 1.0 / temperature
        c_max = min(chunk_size, n)
        # two reused buffers; each chunk's logits live only in these
        z_buf = torch.empty(v * c_max, dtype=dtype, device=dev)  # (V * C,)
        e_buf = torch.empty(v * c_max, dtype=dtype, device=dev) if with_entropy else None  # (V * C,)
        cols = torch.arange(c_max, device=dev)  # (C,)
        lp = torch.empty(n, dtype=dtype, device=dev)  # (N,)
        lse = torch.empty(n, dtype=dtype, device=dev)  # (N,)
        ent = torch.empty(n if with_entropy else 0, dtype=dtype, device=dev)  # (N,) or (0,)
        for s in range(0, n, chunk_size):
            e = min(s + chunk_size, n)
            c = e - s
            # scale the (C, H) side by 1/T rather than the (V, C) logits
            h = hidden[s:e].to(dtype)  # (C, H)
            if temperature != 1.0:
                h = h * inv_t
            zt = z_buf[: v * c].view(v, c)  # (V, C)
            torch.mm(w, h.T, out=zt)  # logits.T / T
            if group is None:
                tgt = zt[targets[s:e], cols[:c]]  # (C,)
            else:  # this rank's slice holds some targets; the others add 0
                local, hit = _local_targets(targets[s:e], vocab_start, v)
                tgt = torch.where(hit, zt[local, cols[:c]], 0.0)
            m = zt.amax(0, keepdim=True)  # (1, C)
            if group is not None:
                dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
            zt.sub_(m)  # (V, C) shifted so exp cannot overflow
            if with_entropy:
                et = e_buf[: v * c].view(v, c)  # (V, C)
                torch.exp(zt, out=et)
                sumexp = et.sum(0, keepdim=True)  # (1, C)
                # H = lse - sum p z = log s - sum exp(z') z' / s  (with z' = z - m)
                pz = et.mul_(zt).sum(0, keepdim=True)  # (1, C)
                if group is not None:
                    sumexp, pz, tgt = _sum_over(group, sumexp, pz, tgt)
                log_s = sumexp.log()  # (1, C)
                ent[s:e] = (log_s - pz / sumexp)[0]
            else:
                sumexp = zt.exp_().sum(0, keepdim=True)  # (1, C); zt is scratch from here on
                if group is not None:
                    sumexp, tgt = _sum_over(group, sumexp, tgt)
                log_s = sumexp.log()
            lse[s:e] = (m + log_s)[0]
            lp[s:e] = tgt - (m + log_s)[0]
        ctx.save_for_backward(hidden, weight, targets, lse, ent)
        ctx.temperature, ctx.chunk_size, ctx.group, ctx.vocab_start = temperature, chunk_size, group, vocab_start
        # unused outputs (e.g. entropy not in the loss) then arrive as None, which skips their work
        ctx.set_materialize_grads(False)
        return lp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        hidden, weight, targets, lse, ent = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if g_ent is not None and g_ent.numel() == 0:
            g_ent = None  # with_entropy=False
        if (g_lp is None and g_ent is None) or not (need_h or need_w):
            return None, None, None, None, None, None, None, None
        n, v = hidden.shape[0], weight.shape[0]
        dtype = lse.dtype
        dev = hidden.device
        w = weight.to(dtype)  # (V, H)
        inv_t = 1.0 / ctx.temperature
        chunk_size = ctx.chunk_size
        c_max = min(chunk_size, n)
        z_buf = torch.empty(v * c_max, dtype=dtype, device=dev)  # (V * C,)
        p_buf = torch.empty(v * c_max, dtype=dtype, device=dev) if g_ent is not None else None  # (V * C,)
        cols = torch.arange(c_max, device=dev)  # (C,)
        grad_h = torch.empty(n, hidden.shape[1], dtype=dtype, device=dev) if need_h else None  # (N, H)
        # one accumulator for all chunks' weight gradients
        grad_w = torch.zeros(v, weight.shape[1], dtype=dtype, device=dev) if need_w else None  # (V, H)
        for s in range(0, n, chunk_size):
            e = min(s + chunk_size, n)
            c = e - s
            h = hidden[s:e].to(dtype)  # (C, H)
            if ctx.temperature != 1.0:
                h = h * inv_t
            zt = z_buf[: v * c].view(v, c)  # (V, C)
            torch.mm(w, h.T, out=zt)  # recompute logits.T / T
            zt.sub_(lse[None, s:e])  # log p
            glp = g_lp[None, s:e].to(dtype) if g_lp is not None else None  # (1, C)
            if g_ent is not None:
                gH = g_ent[None, s:e].to(dtype)  # (1, C)
                pt = p_buf[: v * c].view(v, c)  # (V, C)
                torch.exp(zt, out=pt)
                # -p * (g_lp + g_H * (log p + H)) = p * (log p * (-g_H) + (-(g_lp + g_H * H)))
                bias = gH * ent[None, s:e]  # (1, C)
                if glp is not None:
                    bias = bias + glp
                torch.addcmul(bias.neg(), zt, gH.neg(), out=zt)
                zt.mul_(pt)  # (V, C) = grad_z.T without the one-hot term
            else:
                zt.exp_().mul_(glp.neg())  # (V, C) = -g_lp * p
            if glp is not None:
                # + g_lp * onehot(t); one target per column, so no duplicate indices
                if ctx.group is None:
                    zt.index_put_((targets[s:e], cols[:c]), glp[0], accumulate=True)
                else:  # only the targets in this rank's slice
                    local, hit = _local_targets(targets[s:e], ctx.vocab_start, v)
                    zt.index_put_((local[hit], cols[:c][hit]), glp[0][hit], accumulate=True)
            # zt now holds dL/dz.T for the chunk; h already carries the 1/T factor
            if need_h:
                torch.mm(zt.T, w, out=grad_h[s:e])  # (C, H)
                if ctx.temperature != 1.0:
                    grad_h[s:e].mul_(inv_t)
            if need_w:
                grad_w.addmm_(zt, h)  # (V, H) += (V, C) @ (C, H)
        if grad_h is not None and ctx.group is not None:  # each rank's slice of the vocabulary gave its part
            dist.all_reduce(grad_h, group=ctx.group)
        if grad_h is not None:
            grad_h = grad_h.to(hidden.dtype)
        if grad_w is not None:
            grad_w = grad_w.to(weight.dtype)
        return grad_h, grad_w, None, None, None, None, None, None


def _local_targets(targets: torch.Tensor, start: int, v: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Targets as rows of this rank's vocabulary slice (clamped where they are not in it) and which are."""
    local = targets - start
    hit = (local >= 0) & (local < v)
    return local.clamp(0, v - 1), hit


def _sum_over(group, *parts: torch.Tensor) -> list[torch.Tensor]:
    """Each (1, C) or (C,) part summed over ``group`` in one all-reduce."""
    flat = torch.cat([p.reshape(1, -1) for p in parts])
    dist.all_reduce(flat, group=group)
    return [flat[i].reshape(p.shape) for i, p in enumerate(parts)]
