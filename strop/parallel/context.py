"""Context parallel, all-gather style: every CP rank holds zigzag chunks of every sequence.

Layout. Each sequence of a micro-batch (a padded row, or one sample of a packed
row) is cut into ``2 * cp`` nearly equal pieces; CP rank ``r`` holds pieces ``r``
(its "early" block) and ``2 * cp - 1 - r`` (its "late" block). A rank's tokens
form a (B, m) local batch, each block padded to a common width with filler
slots that attend only to themselves and that no real token attends to.

Attention. :func:`context_parallel_attention` is registered with transformers'
``AttentionInterface`` as ``"strop_cp"``: any Hugging Face decoder that calls its
attention through that interface gets its keys and values (after RoPE, which
uses each token's true position id) all-gathered across the CP group and put in
piece order. An early query can only see pieces ``0..r`` and a late one pieces
``0..2cp-1-r``; both are prefixes of that order, so each block runs SDPA on its
prefix with the plan's mask (causal on true positions, confined to each
sequence, blind to filler). Zigzag makes those prefixes cost the same on every
rank: ``(2cp+1)/(4cp)`` of attending every query to every key. The gather's
backward reduce-scatters key/value gradients to the rank that owns each token.

Outputs. The lm_head runs only on the response tokens whose predicting hidden
state this rank holds; the per-token values (logprobs, entropy, critic values)
are all-gathered into whole (B, T) responses by :class:`_GatherPieces`. Every
CP rank then computes the same loss from the same full tensors, so the gather's
backward hands each rank the gradient of its own piece, and the parameter
gradients of the CP ranks add up to the one-process gradient (the trainer sums
them with the chunked all-reduce, or FSDP reduce-scatters them over DP x CP).

A rank that holds no response token (short responses, long prompts) must still
run its backward: other ranks' queries attend to its keys, and every layer's
backward is a reduce-scatter it has to join, or the group hangs. So its empty
piece is a slice of its hidden states (``x[:0]``, still in the graph), never a
fresh zero tensor: a fresh leaf would cut the rank's loss off from its layers,
its backward would skip their collectives, and the other ranks would wait in them.

The attention function reads the running plan when it is called, so a recompute
outside the forward (activation checkpointing) is not supported under CP.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

ATTENTION_NAME = "strop_cp"


class _Active:
    """The plan of the context-parallel forward that is running, and its additive masks."""

    def __init__(self, plan: "ContextParallelPlan"):
        self.plan, self._masks = plan, {}

    def additive_masks(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(early, late) blocks of the plan's mask as additive masks, built once for all layers:
        SDPA turns a bool mask into a float one in every layer and saves each copy for backward."""
        if dtype not in self._masks:
            p, mask = self.plan, self.plan.attention_mask
            blocks = (mask[:, :, : p.early, : p.early_keys], mask[:, :, p.early :, : p.late_keys])
            self._masks[dtype] = tuple(
                torch.zeros(b.shape, dtype=dtype, device=b.device).masked_fill_(~b, torch.finfo(dtype).min)
                for b in blocks
            )
        return self._masks[dtype]


_active: _Active | None = None  # set while a context-parallel forward runs


def zigzag_pieces(length: int, cp: int, rank: int) -> tuple[list[int], list[int]]:
    """The indices of 0..length-1 that CP ``rank`` holds: pieces ``rank`` (early) and
    ``2cp-1-rank`` (late) of ``2cp`` nearly equal pieces."""
    pieces = torch.arange(length).tensor_split(2 * cp)
    return pieces[rank].tolist(), pieces[2 * cp - 1 - rank].tolist()


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

    def __init__(
        self,
        segment_ids: torch.Tensor,
        position_ids: torch.Tensor,
        response_positions: torch.Tensor,
        group,
        response_mask: torch.Tensor | None = None,
        *,
        size: int | None = None,
        rank: int | None = None,
    ):
        self.group = group  # ``size`` / ``rank`` stand in for the group's in single-process tests
        self.size = dist.get_world_size(group) if size is None else size
        self.rank = dist.get_rank(group) if rank is None else rank
        all_idx = self._slots(segment_ids, position_ids)
        self._attention_mask(segment_ids, all_idx)
        self._entries(all_idx, segment_ids.shape[1], response_positions, response_mask)

    def _slots(self, segment_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Every rank's slots (cp, B, m): the token index each holds, -1 for filler; this rank's own, with their
        gather index and positions, are kept."""
        cp, B = self.size, segment_ids.shape[0]
        # this rank's slots: an "early" block (piece r of every sequence in the row), then a
        # "late" block (piece 2cp-1-r); each block padded with filler (-1) to a common width
        early = [[[] for _ in range(B)] for _ in range(cp)]  # [rank][row]: token indices
        late = [[[] for _ in range(B)] for _ in range(cp)]
        for b in range(B):
            for start, length in _segments(segment_ids[b]):
                for r in range(cp):
                    first, second = zigzag_pieces(length, cp, r)
                    early[r][b] += [start + i for i in first]
                    late[r][b] += [start + i for i in second]
        me = max(1, max(len(row) for rows in early for row in rows))
        ml = max(1, max(len(row) for rows in late for row in rows))
        self.early = me  # queries [0, me) are the early block, [me, m) the late one
        m = me + ml
        all_idx = torch.full((cp, B, m), -1, dtype=torch.long)  # (cp, B, m), -1: a filler slot
        for r in range(cp):
            for b in range(B):
                all_idx[r, b, : len(early[r][b])] = torch.tensor(early[r][b], dtype=torch.long)
                all_idx[r, b, me : me + len(late[r][b])] = torch.tensor(late[r][b], dtype=torch.long)
        mine = self.slot_tokens = all_idx[self.rank]  # (B, m) token index of each slot, -1 for filler
        self.local_index = mine.clamp(min=0)  # (B, m) gather index into the full rows
        self.position_ids = position_ids.gather(1, self.local_index).masked_fill(mine < 0, 0)  # (B, m)
        return all_idx

    def _attention_mask(self, segment_ids: torch.Tensor, all_idx: torch.Tensor) -> None:
        """The piece-major key order and this rank's (B, 1, m, cp*m) mask over it (see the module's docstring)."""
        cp, B, m = all_idx.shape
        me, ml, mine = self.early, all_idx.shape[2] - self.early, self.slot_tokens
        # Keys are gathered rank-major; attention reads them piece-major: piece p of every
        # sequence lives in the early block of rank p (p < cp) or the late block of rank
        # 2cp-1-p. In that order the keys an early query can see (pieces 0..r) and those a
        # late query can see (pieces 0..2cp-1-r) are prefixes, so each block attends to its
        # prefix only: about (2cp+1)/(4cp) of the full m x cp*m product, the same on every rank.
        blocks = [torch.arange(r * m, r * m + me) for r in range(cp)]
        blocks += [torch.arange(r * m + me, (r + 1) * m) for r in reversed(range(cp))]
        self.key_order = torch.cat(blocks)  # (cp*m,) rank-major slot of each piece-major key
        self.early_keys = (self.rank + 1) * me
        self.late_keys = cp * me + (cp - self.rank) * ml
        keys = all_idx.permute(1, 0, 2).reshape(B, cp * m)[:, self.key_order]  # (B, cp*m) piece-major
        seg_q = segment_ids.gather(1, self.local_index).masked_fill(mine < 0, -2)  # (B, m)
        seg_k = segment_ids.gather(1, keys.clamp(min=0)).masked_fill(keys < 0, -3)  # (B, cp*m)
        # causal and within one sequence, on true positions; filler keys are never visible
        mask = (keys[:, None, :] <= mine[:, :, None]) & (seg_q[:, :, None] == seg_k[:, None, :])  # (B, m, cp*m)
        sorted_slot = torch.empty_like(self.key_order)
        sorted_slot[self.key_order] = torch.arange(cp * m)
        filler_b, filler_j = (mine < 0).nonzero(as_tuple=True)
        # a filler query sees itself only: no empty softmax row
        mask[filler_b, filler_j, sorted_slot[self.rank * m + filler_j]] = True
        if bool(mask[:, :me, self.early_keys :].any()) or bool(mask[:, me:, self.late_keys :].any()):
            raise AssertionError("context parallel layout: a visible key outside its block's prefix")
        self.attention_mask = mask.unsqueeze(1)  # (B, 1, m, cp*m)

    def _entries(
        self, all_idx: torch.Tensor, L: int, response_positions: torch.Tensor, response_mask: torch.Tensor | None
    ) -> None:
        """Which response entries this rank computes (those whose predicting position it holds, in row ``L``
        long), where, and how the gathered entries of every rank go back to (B, T) order."""
        cp, B, m = all_idx.shape
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
        mine_entries = self.entry_index = flat[(entry_rank == self.rank) & computed]  # (n_r,) flat b * T + t
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

    def to(self, device: torch.device) -> "ContextParallelPlan":
        """Move every index and mask tensor of the plan to ``device`` (plans are built on the host)."""
        for name, value in vars(self).items():
            if isinstance(value, torch.Tensor):
                setattr(self, name, value.to(device))
        return self

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
        previous, _active = _active, _Active(self)
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


def context_parallel_attention(
    module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None, **kwargs
):
    """transformers attention function: gather K/V over the active CP group, then SDPA with the plan's mask.

    query (B, H, m, d), key / value (B, Hkv, m, d) after RoPE. ``attention_mask`` is the
    plan's (B, 1, m, cp*m) bool mask, passed to the model only so that transformers builds
    no mask of its own; the blocks' additive masks come from the plan. Returns
    (B, m, H, d), as transformers expects.
    Outside a context-parallel forward (the engine, a user's own call) it is plain SDPA,
    so a model switched to it still works anywhere.
    """
    if _active is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    for feature in ("softcap", "s_aux", "sliding_window"):
        if kwargs.get(feature) is not None:
            raise NotImplementedError(
                f"context parallel attention does not support {feature} "
                f"({type(module).__name__}); use parallel.context_parallel_size=1"
            )
    plan, dk = _active.plan, key.shape[-1]
    kv = _GatherSequence.apply(torch.cat([key, value], dim=-1), plan.group)  # (B, Hkv, cp*m, dk+dv) rank-major
    kv = kv[:, :, plan.key_order[: plan.late_keys]]  # piece-major; no query here sees past late_keys
    early_mask, late_mask = _active.additive_masks(query.dtype)
    outs = []
    for q, n_keys, mask in (
        (query[:, :, : plan.early], plan.early_keys, early_mask),
        (query[:, :, plan.early :], plan.late_keys, late_mask),
    ):
        # grouped-query attention inside SDPA: no repeated (B, H, keys, d) tensors to save
        outs.append(
            torch.nn.functional.scaled_dot_product_attention(
                q,
                kv[:, :, :n_keys, :dk],
                kv[:, :, :n_keys, dk:],
                attn_mask=mask,
                dropout_p=dropout,
                scale=scaling,
                enable_gqa=q.shape[1] != kv.shape[1],
            )
        )  # (B, H, block, d)
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous(), None


def enable(model) -> None:
    """Switch a transformers model (and its submodules) to the "strop_cp" attention function."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "set_attn_implementation"):
        raise ValueError(
            f"context parallel needs a transformers model using the attention interface, got {type(model).__name__}"
        )
    # every layer must be full attention: sliding-window, chunked, linear-attention or
    # state-space layers would run on this rank's zigzag tokens as if they were a sequence
    other = sorted(set(getattr(config, "layer_types", None) or ["full_attention"]) - {"full_attention"})
    if not other and getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        other = ["sliding_window"]
    if other:
        raise ValueError(
            f"context parallel supports full-attention decoders only; {config.model_type} has "
            f"{', '.join(other)} layers (use parallel.context_parallel_size=1 for this model)"
        )
    AttentionInterface.register(ATTENTION_NAME, context_parallel_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)  # 2D masks outside CP are built as for SDPA
    model.set_attn_implementation(ATTENTION_NAME)
