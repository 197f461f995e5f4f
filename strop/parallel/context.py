"""Context parallel, all-gather style: every CP rank holds zigzag chunks of every sequence.

Layout. Each sequence of a micro-batch (a padded row, or one sample of a packed
row) is cut into ``2 * cp`` nearly equal pieces; CP rank ``r`` holds pieces ``r``
and ``2 * cp - 1 - r``, so under a causal mask every rank does about the same
attention work (the early, cheap pieces pair with the late, expensive ones).
A rank's tokens are gathered into a (B, m) local batch; ranks short of ``m``
tokens in a row fill it with filler slots that attend only to themselves and
that no real token attends to.

Attention. :func:`context_parallel_attention` is registered with transformers'
``AttentionInterface`` as ``"strop_cp"``: any Hugging Face decoder that calls its
attention through that interface gets its keys and values (after RoPE, which
uses each token's true position id) all-gathered across the CP group, then runs
SDPA with a (B, 1, m, cp * m) boolean mask that the plan builds from the tokens'
true positions and segments: causal, confined to each sequence, blind to filler.
The gather's backward reduce-scatters key/value gradients to the rank that owns
each token.

Outputs. The lm_head runs only on the response tokens whose predicting hidden
state this rank holds; the per-token values (logprobs, entropy, critic values)
are all-gathered into whole (B, T) responses by :class:`_GatherPieces`. Every
CP rank then computes the same loss from the same full tensors, so the gather's
backward hands each rank the gradient of its own piece, and the parameter
gradients of the CP ranks add up (the trainer sums them with the chunked
all-reduce) to the one-process gradient.

A rank that holds no response token (short responses, long prompts) must still
run its backward: other ranks' queries attend to its keys, and every layer's
backward is a reduce-scatter it has to join, or the group hangs. So its empty
piece is a slice of its hidden states (``x[:0]``, still in the graph), never a
fresh zero tensor: a fresh leaf would cut the rank's loss off from its layers,
its backward would skip their collectives, and the other ranks would wait in them
(tests/distributed/test_cp.py reproduces exactly that with a fresh tensor).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

ATTENTION_NAME = "strop_cp"


class _Active:
    """The CP group of the forward that is running, and its additive mask, built once for all layers."""

    def __init__(self, group):
        self.group, self._masks = group, {}

    def additive_mask(self, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        # SDPA turns a bool mask into a float one in every layer and saves each copy for
        # backward (m x cp*m x 4 bytes per layer); one shared additive mask is saved once
        key = (id(mask), dtype)
        if key not in self._masks:
            self._masks[key] = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(
                ~mask, torch.finfo(dtype).min)
        return self._masks[key]


_active: _Active | None = None  # set while a context-parallel forward runs


def zigzag_pieces(length: int, cp: int, rank: int) -> list[int]:
    """Indices 0..length-1 that CP ``rank`` holds: pieces ``rank`` and ``2cp-1-rank`` of ``2cp``."""
    pieces = torch.arange(length).tensor_split(2 * cp)
    return pieces[rank].tolist() + pieces[2 * cp - 1 - rank].tolist()


def _segments(row: torch.Tensor) -> list[tuple[int, int]]:
    """(start, length) of each run of one segment id >= 0 in a row of segment ids (L,)."""
    out, start = [], 0
    values = row.tolist()
    for i in range(1, len(values) + 1):
        if i == len(values) or values[i] != values[start]:
            if values[start] >= 0:
                out.append((start, i - start))
            start = i
    return out


class ContextParallelPlan:
    """Which tokens and which response entries this CP rank holds, for one micro-batch.

    ``segment_ids`` (B, L): the sequence each token belongs to (a packed row has
    several; padding is -1). ``position_ids`` (B, L): the tokens' RoPE positions.
    ``response_positions`` (B, T): index of each response token in its row (the
    value at entry (b, t) is predicted by the hidden state at position - 1).
    ``response_mask`` (B, T), optional: padding entries (0) are not computed; they
    repeat entry (b, 0), which is what a padded batch computes there too (the caller
    masks them). Every rank builds the same plan from the same batch: no sizes travel.
    """

    def __init__(self, segment_ids: torch.Tensor, position_ids: torch.Tensor,
                 response_positions: torch.Tensor, group, response_mask: torch.Tensor | None = None):
        self.group = group
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        cp, B, L = self.size, *segment_ids.shape
        held = [[[] for _ in range(B)] for _ in range(cp)]  # held[rank][row]: token indices
        for b in range(B):
            for start, length in _segments(segment_ids[b]):
                for r in range(cp):
                    held[r][b] += [start + i for i in zigzag_pieces(length, cp, r)]
        m = max(1, max(len(row) for rank_rows in held for row in rank_rows))
        all_idx = torch.full((cp, B, m), -1, dtype=torch.long)  # -1: a filler slot
        for r in range(cp):
            for b in range(B):
                all_idx[r, b, : len(held[r][b])] = torch.tensor(held[r][b], dtype=torch.long)
        mine = all_idx[self.rank]  # (B, m)
        self.local_index = mine.clamp(min=0)  # (B, m) gather index into the full rows
        self.position_ids = position_ids.gather(1, self.local_index).masked_fill(mine < 0, 0)  # (B, m)
        # attention mask over (this rank's queries) x (every rank's keys, rank-major slots)
        keys = all_idx.permute(1, 0, 2).reshape(B, cp * m)  # (B, cp*m)
        seg_q = segment_ids.gather(1, self.local_index).masked_fill(mine < 0, -2)  # (B, m)
        seg_k = segment_ids.gather(1, keys.clamp(min=0)).masked_fill(keys < 0, -3)  # (B, cp*m)
        mask = (keys[:, None, :] <= mine[:, :, None]) & (seg_q[:, :, None] == seg_k[:, None, :])  # (B, m, cp*m)
        filler_b, filler_j = (mine < 0).nonzero(as_tuple=True)
        mask[filler_b, filler_j, self.rank * m + filler_j] = True  # a filler query sees itself: no empty softmax row
        self.attention_mask = mask.unsqueeze(1)  # (B, 1, m, cp*m)
        # owner (rank, slot) of every token, then of every response entry's predicting position
        owner_rank = torch.full((B, L), -1, dtype=torch.long)
        owner_slot = torch.zeros((B, L), dtype=torch.long)
        slots = torch.arange(m).expand(B, m)
        for r in range(cp):
            real = all_idx[r] >= 0
            rows = torch.arange(B).unsqueeze(1).expand(B, m)[real]
            owner_rank[rows, all_idx[r][real]] = r
            owner_slot[rows, all_idx[r][real]] = slots[real]
        self.shape = tuple(response_positions.shape)  # (B, T)
        T = self.shape[1]
        pred = (response_positions - 1).clamp(min=0)  # (B, T)
        entry_rank = owner_rank.gather(1, pred)  # (B, T)
        if bool((entry_rank < 0).any()):
            raise ValueError("a response position points at a padding token; the batch is malformed")
        computed = torch.ones_like(entry_rank, dtype=torch.bool)  # (B, T)
        if response_mask is not None:
            computed = response_mask > 0
            computed[:, 0] = True  # the stand-in for the row's padding entries
        flat = torch.arange(B * T).reshape(B, T)
        source = torch.where(computed, flat, flat[:, :1])  # (B, T): the computed entry each entry reads
        entry_rank, computed, flat, source = (x.reshape(-1) for x in (entry_rank, computed, flat, source))
        self.counts = [int(((entry_rank == r) & computed).sum()) for r in range(cp)]
        mine_entries = flat[(entry_rank == self.rank) & computed]  # (n_r,) flat (b * T + t)
        self.entry_rows = mine_entries // T
        self.entry_slots = owner_slot.gather(1, pred).reshape(-1)[mine_entries]
        self.entry_targets = response_positions.reshape(-1)[mine_entries]  # index into the full row
        order = torch.cat([flat[(entry_rank == r) & computed] for r in range(cp)])  # rank-major gathered order
        where = torch.full((B * T,), -1, dtype=torch.long)
        where[order] = torch.arange(order.numel())  # gathered position of each computed entry
        self.restore = where[source]  # gathered[restore] is (b, t) order

    @classmethod
    def for_batch(cls, batch: dict, group) -> "ContextParallelPlan":
        """A plan for a collated batch: padded (2D attention_mask) or packed (``segment_ids``)."""
        if "segment_ids" in batch:
            return cls(batch["segment_ids"], batch["position_ids"], batch["positions"], group)  # no padding entries
        attention_mask = batch["attention_mask"]  # (B, L), right-padded
        segment_ids = attention_mask.long() - 1  # 0 for real tokens, -1 for padding
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        return cls(segment_ids, position_ids, batch["positions"], group, response_mask=batch["response_mask"])

    def local(self, full: torch.Tensor) -> torch.Tensor:
        """(B, L) → this rank's (B, m) tokens (filler slots repeat token 0 of the row; they are masked)."""
        return full.gather(1, self.local_index)

    def targets(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(n_r,) token ids of this rank's response entries."""
        return input_ids[self.entry_rows, self.entry_targets]

    def entry_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """(B, m, H) local hidden states → (n_r, H) at this rank's response entries.

        With no entry here the result is ``hidden[:0]``-style: a slice in the graph, so the
        backward still runs through this rank's layers and joins their collectives.
        """
        flat = hidden.reshape(-1, hidden.shape[-1])  # (B*m, H)
        if not self.entry_rows.numel():
            return flat[:0]
        return flat[self.entry_rows * hidden.shape[1] + self.entry_slots]

    def gather(self, values: torch.Tensor) -> torch.Tensor:
        """(n_r,) per-entry values of this rank → (B, T) for every entry, differentiably."""
        everything = _GatherPieces.apply(values, tuple(self.counts), self.rank, self.group)  # (B*T,) rank-major
        return everything[self.restore].reshape(self.shape)

    @contextlib.contextmanager
    def active(self):
        """Route the "strop_cp" attention of forwards run inside through this plan's CP group."""
        global _active
        previous, _active = _active, _Active(self.group)
        try:
            yield self
        finally:
            _active = previous


def _all_gather(out: torch.Tensor, x: torch.Tensor, group) -> None:
    """Flat all-gather: ``out`` (world * n,) receives every rank's ``x`` (n,) in rank order."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
    fn(out, x, group=group)


def _reduce_scatter(out: torch.Tensor, x: torch.Tensor, group) -> None:
    """Flat reduce-scatter (sum): ``out`` (n,) gets the sum over ranks of this rank's slice of ``x``."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, x, op=dist.ReduceOp.SUM, group=group)


class _GatherSequence(torch.autograd.Function):
    """All-gather (B, Hkv, m, D) across the CP group into (B, Hkv, cp*m, D); backward reduce-scatters."""

    @staticmethod
    def forward(ctx, x, group):
        cp = dist.get_world_size(group)
        out = x.new_empty(cp * x.numel())  # flat (cp * B*Hkv*m*D,): rank-major
        _all_gather(out, x.contiguous().view(-1), group)
        ctx.group, ctx.cp = group, cp
        B, H, m, D = x.shape
        return out.view(cp, B, H, m, D).permute(1, 2, 0, 3, 4).reshape(B, H, cp * m, D)

    @staticmethod
    def backward(ctx, grad):
        B, H, cpm, D = grad.shape
        m = cpm // ctx.cp
        # every rank's queries sent gradient to every key: sum them onto the key's owner
        parts = grad.reshape(B, H, ctx.cp, m, D).permute(2, 0, 1, 3, 4).contiguous()  # (cp, B, H, m, D)
        mine = grad.new_empty(B * H * m * D)
        _reduce_scatter(mine, parts.view(-1), ctx.group)
        return mine.view(B, H, m, D), None


class _GatherPieces(torch.autograd.Function):
    """All-gather 1-D pieces of known, unequal sizes; backward keeps this rank's slice of the gradient.

    The slice (not a sum) is right because every CP rank computes the same loss from the
    gathered tensor, so each holds the same gradient for every piece.
    """

    @staticmethod
    def forward(ctx, piece, counts, rank, group):
        width = max(max(counts), 1)
        padded = piece.new_zeros(width)
        padded[: piece.shape[0]] = piece
        out = piece.new_empty(len(counts) * width)
        _all_gather(out, padded, group)
        out = out.view(len(counts), width)
        ctx.start, ctx.count = sum(counts[:rank]), counts[rank]
        return torch.cat([out[r, :c] for r, c in enumerate(counts)])

    @staticmethod
    def backward(ctx, grad):
        # an empty slice when this rank holds no entry; the backward still flows on into its layers
        return grad[ctx.start : ctx.start + ctx.count], None, None, None


def context_parallel_attention(module, query, key, value, attention_mask, dropout: float = 0.0,
                               scaling: float | None = None, **kwargs):
    """transformers attention function: gather K/V over the active CP group, then SDPA with the plan's mask.

    query (B, H, m, d), key / value (B, Hkv, m, d) after RoPE; attention_mask is the
    plan's (B, 1, m, cp*m) bool mask. Returns (B, m, H, d), as transformers expects.
    Outside a context-parallel forward (the engine, a user's own call) it is plain SDPA,
    so a model switched to it still works anywhere.
    """
    if _active is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    for feature in ("softcap", "s_aux", "sliding_window"):
        if kwargs.get(feature) is not None:
            raise NotImplementedError(f"context parallel attention does not support {feature} "
                                      f"({type(module).__name__}); use parallel.context_parallel_size=1")
    dk = key.shape[-1]
    kv = _GatherSequence.apply(torch.cat([key, value], dim=-1), _active.group)  # (B, Hkv, cp*m, dk+dv)
    key, value = kv[..., :dk], kv[..., dk:]
    # grouped-query attention inside SDPA: no repeated (B, H, cp*m, d) keys and values to save
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=_active.additive_mask(attention_mask, query.dtype), dropout_p=dropout,
        scale=scaling, enable_gqa=query.shape[1] != key.shape[1])  # (B, H, m, d)
    return out.transpose(1, 2).contiguous(), None


def enable(model) -> None:
    """Switch a transformers model (and its submodules) to the "strop_cp" attention function."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "set_attn_implementation"):
        raise ValueError(f"context parallel needs a transformers model using the attention interface, got {type(model).__name__}")
    if "sliding_attention" in (getattr(config, "layer_types", None) or []):
        raise ValueError(f"context parallel does not support sliding-window attention layers ({config.model_type}); "
                         "use parallel.context_parallel_size=1 for this model")
    AttentionInterface.register(ATTENTION_NAME, context_parallel_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)  # 2D masks outside CP are built as for SDPA
    model.set_attn_implementation(ATTENTION_NAME)
