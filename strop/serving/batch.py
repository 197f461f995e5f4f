"""The running batch of the kv-cache decoder (:class:`strop.serving.kvdecode.LlamaDecoder`): its rows, their cache
slots, admission and compaction.

All running rows write their next token into the same cache column ``t``; a row's prompt sits right-aligned
before the column where it joined (``start[r] .. t-1``), so rows that joined later simply start further right.
Attention masks every column left of a row's ``start``. Keys and values live in two tensors ``(layers, rows,
kv_heads, columns, head_dim)`` allocated once per layout change (an admission beyond their slots or columns), never
concatenated per step. Grouped query attention multiplies each kv head against its group of query heads directly,
without materialising repeated keys.

Slots. Where one packing of the weights serves every row count (oneDNN, or none), a step computes exactly the
running rows; where MKL's packing is made for a row count, slots come in buckets and the spare ones decode padding
(:func:`slots_for`). A batch with slots to spare compacts in place: the running rows past the slots it keeps move
into finished rows' slots, and the cache tensors stay, as a view of fewer slots, for rows that join later.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from strop.serving.kvdecode import LlamaDecoder
from strop.serving.moe import record_prompt_routes, record_step_routes
from strop.serving.prefix import left_padded


@dataclass(eq=False)
class Row:
    """One running sequence: its owner (an opaque handle for the caller) and its output so far."""

    owner: Any
    sampling: Any
    budget: int
    stops: set[int]
    generator: torch.Generator | None
    request_id: str | None = None
    abort_gen: int = 0
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list = field(default_factory=list)  # per token, filled by a sampler asked for alternatives
    finish: str | None = None
    drafts: Any = None  # speculation's DraftIndex for the row's prompt (strop.serving.speculative)
    routes: list = field(default_factory=list)  # routed experts' choices, prompt then steps (strop.serving.moe)


def slots_for(rows: int, step: int = 16) -> int:
    """Cache slots for ``rows`` running rows: with ``step`` 1, ``rows``; else powers of two up to 16, then
    multiples of ``step``. MKL's weights are packed for one batch size, so there the slot count changes rarely
    (``step`` 16); the spare slots decode padding."""
    if step == 1:
        return max(rows, 1)
    if rows <= 16:
        return 1 << max(rows - 1, 0).bit_length()
    return -(-rows // step) * step


def _pad_row() -> Row:
    return Row(owner=None, sampling=None, budget=0, stops=set(), generator=None, finish="pad")


class Batch:
    """The running batch of a :class:`LlamaDecoder`: rows join (``admit``) and leave (finished)
    between steps. ``sample(logits, rows)`` picks tokens and logprobs (``sample(logits, rows, block_lse)`` after
    a step that computed the logits' ``strop.serving.sampling.block_logsumexp``); ``should_abort(row)`` is asked
    once per step for each row still running.

    Every cache slot has a :class:`Row`; a finished row's slot (or a padding slot) is taken by the
    next row that joins, and the batch is compacted in place when it holds more slots than
    :func:`slots_for` gives its running rows (``LlamaDecoder.slot_step``)."""

    def __init__(
        self,
        decoder: LlamaDecoder,
        sample: Callable,
        *,
        pad_token_id: int,
        should_abort: Callable[[Row], bool] = lambda row: False,
    ):
        self.dec, self.sample, self.pad = decoder, sample, pad_token_id
        self.should_abort = should_abort
        self.rows: list[Row] = []  # one per cache slot
        self.keys = self.values = None
        self.col = 0  # the column the next fed token is written to
        self.start = torch.zeros(0, dtype=torch.long)  # first valid column of each slot
        self.positions = torch.zeros(0, dtype=torch.long)  # position id of the next fed token
        self.next_tokens = torch.zeros(0, dtype=torch.long)
        self.ends = None  # per-slot write columns while rows end apart (strop.serving.speculative)
        self.speculating = False  # whether this busy period drafts (strop.serving.speculative)
        self.prefilled_tokens = 0  # prompt tokens actually prefilled (after sharing)
        self.prompt_tokens = 0  # prompt tokens of every admitted row

    @property
    def live(self) -> int:
        return sum(r.finish is None for r in self.rows)

    # ---- layout ---------------------------------------------------------------------------
    def _relayout(self, keep: list[int], slots: int, width: int, capacity: int) -> None:
        """New cache tensors with ``slots`` slots: first the slots ``keep`` (in order), then padding;
        at least ``width`` columns before the write column and ``capacity`` columns in all."""
        d = self.dec
        lo = int(self.start[keep].min()) if keep else self.col
        used = self.col - lo  # columns in use left of the write column
        new_col = max(width, used)
        shape = (d.n_layers, slots, d.n_kv, max(capacity, new_col + 1), d.head_dim)
        keys = torch.zeros(shape, dtype=d.dtype, device=d.device)
        values = torch.zeros(shape, dtype=d.dtype, device=d.device)
        if keep and used:
            idx = torch.tensor(keep, device=d.device)
            keys[:, : len(keep), :, new_col - used : new_col] = self.keys.index_select(1, idx)[:, :, :, lo : self.col]
            values[:, : len(keep), :, new_col - used : new_col] = self.values.index_select(1, idx)[
                :, :, :, lo : self.col
            ]
        shift, k, extra = new_col - self.col, torch.tensor(keep, dtype=torch.long), slots - len(keep)
        self.start = torch.cat([self.start[k] + shift, torch.full((extra,), new_col, dtype=torch.long)])
        self.positions = torch.cat([self.positions[k], torch.zeros(extra, dtype=torch.long)])
        self.next_tokens = torch.cat([self.next_tokens[k], torch.zeros(extra, dtype=torch.long)])
        self.rows = [self.rows[i] for i in keep] + [_pad_row() for _ in range(extra)]
        self.keys, self.values, self.col = keys, values, new_col
        self._base_keys, self._base_values = keys, values  # (``keys`` may become a view of fewer slots)

    def _compact(self, live: list[int], slots: int) -> list[int]:
        """Keep the first ``slots`` slots: the running rows past them move into finished rows' slots, in the same
        tensors, 4-12 ms for a 56-row fp32 cache (measured: a new layout of it took 0.3 s, about what the 8 rows it
        stopped computing saved over the rest of a GRPO batch). Returns the running rows' slots."""
        free = [i for i in range(slots) if self.rows[i].finish is not None]
        moving = [i for i in live if i >= slots]
        if moving:
            lo, dst, src = int(self.start[live].min()), free[: len(moving)], moving
            d, s = torch.tensor(dst, device=self.keys.device), torch.tensor(src, device=self.keys.device)
            for cache in (self.keys, self.values):
                cache[:, d, :, lo : self.col] = cache[:, s, :, lo : self.col]
            d, s = torch.tensor(dst), torch.tensor(src)
            for t in (self.start, self.positions, self.next_tokens):
                t[d] = t[s]
            for i, j in zip(dst, src):
                self.rows[i] = self.rows[j]
        self.keys, self.values = self.keys[:, :slots], self.values[:, :slots]
        self.start, self.positions = self.start[:slots], self.positions[:slots]
        self.next_tokens, self.rows = self.next_tokens[:slots], self.rows[:slots]
        return sorted([i for i in live if i < slots] + free[: len(moving)])

    def _regain(self, n: int) -> list[int]:
        """``n`` of the slots a compaction left behind, back in the batch as padding; returns them. Their columns
        hold finite keys and values of earlier rows, which the joining rows' starts mask."""
        old = len(self.rows)
        self.keys = self._base_keys[:, : old + n]
        self.values = self._base_values[:, : old + n]
        self.start = torch.cat([self.start, torch.full((n,), self.col, dtype=torch.long)])
        self.positions = torch.cat([self.positions, torch.zeros(n, dtype=torch.long)])
        self.next_tokens = torch.cat([self.next_tokens, torch.zeros(n, dtype=torch.long)])
        self.rows += [_pad_row() for _ in range(n)]
        return list(range(old, old + n))

    def admit(self, prompts: list[list[int]], rows: list[Row]) -> list[Row]:
        """Prefill ``prompts`` (one per row; equal prompts are prefilled once), sample each row's
        first token, and add the rows to the batch. Returns the rows that finished on that token."""
        if not rows:
            return []
        d = self.dec
        unique: dict[tuple, int] = {}
        which = [unique.setdefault(tuple(p), len(unique)) for p in prompts]
        uniq = list(unique)
        ids, lengths = left_padded(uniq, self.pad)
        P = ids.shape[1]
        logits, k, v = d.prefill(ids.to(d.device), lengths.to(d.device))
        record_prompt_routes(d.routes, rows, which, prompts, P)
        self.prefilled_tokens += int(lengths.sum()) - d.shared_tokens
        self.prompt_tokens += sum(len(p) for p in prompts)
        w = torch.tensor(which, device=d.device)
        tokens, logprobs = self.sample(logits.index_select(0, w).float(), rows)
        finished = self._record(rows, tokens.tolist(), logprobs.tolist())
        joining = [i for i, r in enumerate(rows) if r.finish is None]
        if not joining:
            return finished
        # each joining prompt ends just left of the write column, in a free slot if there is room
        free = [i for i, r in enumerate(self.rows) if r.finish is not None]
        if self.keys is not None and 0 < len(joining) - len(free) <= self._base_keys.shape[1] - len(self.rows):
            free += self._regain(len(joining) - len(free))
        longest = max(rows[i].budget for i in joining)
        if not (
            self.keys is not None
            and len(free) >= len(joining)
            and self.col >= P
            and self.keys.shape[3] >= self.col + 1 + longest
        ):
            keep = [i for i, r in enumerate(self.rows) if r.finish is None]
            need = max(self.col - (int(self.start[keep].min()) if keep else self.col), P)  # columns left of col
            capacity = max(
                [need + longest + 1] + [need + self.rows[i].budget - len(self.rows[i].token_ids) + 2 for i in keep]
            )
            self._relayout(keep, slots_for(len(keep) + len(joining), d.slot_step), need, capacity)
            free = list(range(len(keep), len(self.rows)))
        slots = free[: len(joining)]
        c, dst = self.col, torch.tensor(slots, device=d.device)
        src = w[torch.tensor(joining, device=d.device)]
        self.keys[:, dst, :, c - P : c] = k.index_select(1, src)
        self.values[:, dst, :, c - P : c] = v.index_select(1, src)
        for slot, i in zip(slots, joining):
            r = rows[i]
            self.start[slot] = c - len(prompts[i])
            self.positions[slot] = len(prompts[i])
            self.next_tokens[slot] = r.token_ids[-1]
            self.rows[slot] = r
        return finished

    def _record(self, rows: list[Row], tokens: list[int], logprobs: list[float]) -> list[Row]:
        done = []
        for r, tok, lp in zip(rows, tokens, logprobs):
            if r.finish is not None:
                continue
            r.token_ids.append(tok)
            r.logprobs.append(lp)
            if tok in r.stops:
                r.finish = "stop"
            elif len(r.token_ids) >= r.budget:
                r.finish = "length"
            elif self.should_abort(r):
                r.finish = "abort"
            if r.finish is not None:
                done.append(r)
        return done

    def step(self) -> list[Row]:
        """Decode one token for every running row. Returns the rows that finished."""
        live = [i for i, r in enumerate(self.rows) if r.finish is None]
        if not live:
            return []
        slots = slots_for(len(live), self.dec.slot_step)
        if len(self.rows) > slots:  # more slots than the running rows need: compact
            live = self._compact(live, slots)
        B = len(self.rows)
        lo = int(self.start[live].min())
        cols = torch.arange(lo, self.col + 1)
        valid = cols.unsqueeze(0) >= self.start.unsqueeze(1)  # (B, T); every slot sees at least its own column
        bias = torch.zeros(valid.shape, dtype=self.dec.dtype).masked_fill_(~valid, float("-inf"))
        dev = self.dec.device
        logits = self.dec.step(
            self.next_tokens.to(dev),
            self.positions.to(dev),
            self.keys,
            self.values,
            self.col,
            lo,
            bias.view(B, 1, 1, -1).to(dev),
            self.start,
        )
        self.col += 1
        self.positions += 1
        running = [self.rows[i] for i in live]
        record_step_routes(self.dec.routes, running, live)
        lse = self.dec.block_lse  # (the compiled step's, computed in its graph)
        if len(live) < B:
            idx = torch.tensor(live, device=dev)
            logits, lse = logits.index_select(0, idx), None if lse is None else lse.index_select(0, idx)
        tokens, logprobs = self.sample(logits.float(), running, *(() if lse is None else (lse,)))
        self.next_tokens[torch.tensor(live)] = tokens.cpu()
        finished = self._record(running, tokens.tolist(), logprobs.tolist())
        done = {id(r) for r in finished}
        for i in live:  # a finished row's slot attends only to its own column from now on (no NaN)
            if id(self.rows[i]) in done:
                self.start[i] = self.col
        return finished
