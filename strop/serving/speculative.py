"""Lossless speculative decoding for the fast decoder (``engine.speculative``, ``strop serve --speculative``).

Drafts come from rollout history, not from a draft model: a :class:`DraftIndex` per prompt holds the prompt,
every response to it that is decoding now (a GRPO group's siblings) and the earlier responses to it (earlier
rollouts of the same prompt), indexed by their n-grams; a row's draft is what followed another occurrence of
its last 4, 3 or 2 tokens (suffix matching, longest first).

A round feeds each running row its next token and its draft, ``1 + k`` tokens, in one forward pass, then samples
position by position: the token sampled after position ``j`` is the row's next token whatever the draft said, and
the draft's token ``j + 1`` stands (its cache entry and logits are used) only when it equals that sample. The
sampler draws one uniform number per token from the row's own generator, in the order of its tokens, as one
token per step does; and every number of a round is computed as one token at a time computes it (each row's
linear layers independent of the other rows, :func:`strop.serving.invariant.rows_linear`; each position's
attention over exactly its own row's columns, as :func:`strop.serving.invariant.attend_rows` computes it). So a
request's tokens and logprobs (seeded, greedy, or unseeded with the engine's seed: each row has its own
generator) are bitwise those of decoding without speculation (tests/test_speculative.py); drafts change only how
many tokens a forward pass yields.

Rows keep their own write column here (``batch.ends``): a row whose draft was cut short overwrites the rejected
columns on its next round. :func:`align` brings them back to the one column :class:`strop.serving.batch.Batch`
assumes before rows join. Whether a round drafts at all is measured, not assumed (:class:`Speculator`): per size
of the running batch, what a round costs with and without drafts, against the tokens a row lately got per
drafting round (it pays when few rows run and a step is bound by reading the weights, and costs where many do).

A busy period (from an idle engine until no row runs) that starts with more rows than one drafted token each
allows (``DRAFT_ROWS // 2``) does not speculate at all: it decodes as the engine without speculation does, on the
default kernels, so it costs nothing there; its tokens and logprobs are that engine's
(:meth:`Speculator.drafts_at`). A busy period that drafts gives those of the batch-invariant engine. With
``batch_invariant`` asked for as well, every busy period runs the batch-invariant kernels.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict

import torch

from strop.serving.invariant import attend_one, packed_rows, rows_linear
from strop.serving.batch import Row, slots_for

NGRAMS = (4, 3, 2)  # the suffix lengths a draft is matched on, longest first
MAX_SOURCES = 64  # sequences one prompt's index holds; past it, the prompt and the latest half
MAX_PROMPTS = 512  # prompts indexed at once (the least recently used one goes)
EXPLORE = 16  # every this many rounds of a batch size, the mode measured slower runs once again
# the most rows a drafting round's linear layers compute: up to about this many, a CPU step costs what reading the
# weights costs (a SmolLM2-135M fp32 step's linear layers on 2 cores: 8 rows 41 ms, 64 rows 75 ms, 320 rows
# 288 ms); past it, drafts multiply the work and are not tried (docs/engine.md)
DRAFT_ROWS = 64


class DraftIndex:
    """One prompt's token sequences (the prompt, then responses, each a list read as it grows) by n-gram: each
    n-gram's latest occurrence, the one before it and its first, as (sequence, position after it)."""

    def __init__(self, prompt: list[int], responses: list[list[int]] = ()):
        self.seqs = [list(prompt), *responses]
        self.seen = [0] * len(self.seqs)  # tokens of each sequence indexed so far
        self.latest: dict[tuple, tuple[int, int]] = {}
        self.before: dict[tuple, tuple[int, int]] = {}
        self.first: dict[tuple, tuple[int, int]] = {}

    def follow(self, tokens: list[int]) -> None:
        """Index ``tokens`` (a row's token list) as it grows."""
        if len(self.seqs) >= MAX_SOURCES:
            self.__init__(self.seqs[0], self.seqs[-MAX_SOURCES // 2 :])
        self.seqs.append(tokens)
        self.seen.append(0)

    def _catch_up(self) -> None:
        for s, seq in enumerate(self.seqs):
            for end in range(self.seen[s] + 1, len(seq) + 1):
                for n in NGRAMS:
                    if end >= n:
                        key = tuple(seq[end - n : end])
                        if key in self.latest:
                            self.before[key] = self.latest[key]
                        self.first.setdefault(key, (s, end))
                        self.latest[key] = (s, end)
            self.seen[s] = len(seq)

    def draft(self, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens to follow the prompt and ``tokens`` (a followed row's list): what followed its
        longest matching suffix elsewhere (the latest occurrence with the most tokens after it); [] when none."""
        if k <= 0:
            return []
        self._catch_up()
        context = tokens[-NGRAMS[0] :] if len(tokens) >= NGRAMS[0] else (self.seqs[0] + tokens)[-NGRAMS[0] :]
        for n in NGRAMS:
            key = tuple(context[-n:])
            best: list[int] = []
            for hit in (self.latest.get(key), self.before.get(key), self.first.get(key)):
                if hit is not None:  # (a row's own end, or a sibling's at the same place, has nothing after it)
                    out = self.seqs[hit[0]][hit[1] : hit[1] + k]
                    best = out if len(out) > len(best) else best
            if best:
                return best
        return []


class Speculator:
    """The engine's speculation: the draft indexes (by prompt), the per-batch-size choice of drafting or not, and
    the counters the rollout's metrics read (:meth:`take_stats`)."""

    def __init__(self, k: int):
        self.k = k
        self.indexes: OrderedDict[tuple, DraftIndex] = OrderedDict()
        self.cost: dict[int, list] = {}  # batch size bucket -> [least seconds of a round without, with drafts]
        self.yield_ = float(k + 1)  # tokens a row gets per drafting round, lately (optimistic until measured)
        self.rounds: dict[int, int] = {}
        self.stats = dict.fromkeys(("row_forwards", "tokens", "drafted", "accepted", "draft_rounds", "rounds"), 0)

    def follow(self, row: Row, prompt: list[int]) -> None:
        """Draft for ``row`` from its prompt's index, and add its tokens to it."""
        key = tuple(prompt)
        index = self.indexes.pop(key, None) or DraftIndex(prompt)
        self.indexes[key] = index
        if len(self.indexes) > MAX_PROMPTS:
            self.indexes.popitem(last=False)
        index.follow(row.token_ids)
        row.drafts = index

    def width(self, bucket: int) -> int:
        """Drafted tokens per row at this batch size: ``k``, or fewer where ``k`` would pass ``DRAFT_ROWS``."""
        return max(0, min(self.k, DRAFT_ROWS // bucket - 1))

    def drafts_at(self, rows: int) -> bool:
        """Whether a busy period that starts with ``rows`` rows speculates. Not where even one drafted token per
        row passes ``DRAFT_ROWS``: such a period decodes as an engine without speculation does, on its kernels,
        and its tokens and logprobs are that engine's (the batch-invariant kernels cost 3-6 % and drafting would
        not pay there; docs/engine.md)."""
        return self.width(slots_for(rows)) > 0

    def count_plain(self, rows: int) -> None:
        """A step of ``rows`` rows in a busy period that does not speculate: one token per row, no draft."""
        s = self.stats
        s["rounds"] += 1
        s["row_forwards"] += rows
        s["tokens"] += rows

    def _choose(self, bucket: int) -> bool:
        """Draft at this batch size? When a row's recent tokens per drafting round pay for what a drafting round
        costs here against a plain one. A round's cost is the least measured (a round that repacked the weights
        or relaid the cache is not its price); each mode is measured first, and the one not chosen again every
        ``EXPLORE`` rounds. Never where a drafting round's rows pass ``DRAFT_ROWS`` with even one drafted token."""
        if not self.width(bucket):
            return False
        plain, draft = self.cost.setdefault(bucket, [None, None])
        n = self.rounds[bucket] = self.rounds.get(bucket, 0) + 1
        if plain is None or draft is None:
            return draft is None
        return (self.yield_ * plain > draft) != (n % EXPLORE == 0)

    def round(self, batch) -> list[Row]:
        """One round of ``batch``; returns the rows that finished."""
        live = [i for i, r in enumerate(batch.rows) if r.finish is None]
        if not live:
            return []
        bucket = slots_for(len(live))
        drafting = self._choose(bucket)
        t = time.perf_counter()
        finished, made, drafted, accepted = verify(batch, self.width(bucket) if drafting else 0)
        seconds = time.perf_counter() - t
        cost = self.cost.setdefault(bucket, [None, None])
        mode = drafting and drafted > 0
        cost[mode] = seconds if cost[mode] is None else min(cost[mode], seconds)
        if mode:
            self.yield_ = 0.7 * self.yield_ + 0.3 * made / len(live)
        s = self.stats
        s["rounds"] += 1
        s["row_forwards"] += len(live)
        s["tokens"] += made
        if drafted:
            s["draft_rounds"] += 1
            s["drafted"] += drafted
            s["accepted"] += accepted
        return finished

    def take_stats(self) -> dict[str, float]:
        """The metrics since the last call: ``spec_acceptance_rate`` (draft tokens that stood),
        ``spec_tokens_per_forward`` (tokens a row got per forward pass; 1 without drafts) and
        ``spec_draft_rounds_fraction`` (rounds that drafted); the counters start again."""
        s, self.stats = self.stats, dict.fromkeys(self.stats, 0)
        if not s["rounds"]:
            return {}
        return {
            "spec_acceptance_rate": s["accepted"] / max(s["drafted"], 1),
            "spec_tokens_per_forward": s["tokens"] / max(s["row_forwards"], 1),
            "spec_draft_rounds_fraction": s["draft_rounds"] / s["rounds"],
        }


def describe_speculation(k: int, running: bool) -> str:
    """The engine's start line's words on speculation (``running``: the fast decoder runs it)."""
    if not k:
        return ""
    if not running:
        return ", no speculation (it needs the kv-cache decoder)"
    return (
        f", speculative: up to {k} drafted tokens per row from the prompt's other responses, verified exactly "
        f"(batch-invariant kernels), at the batch sizes where it measures faster; a batch that starts with more "
        f"than {DRAFT_ROWS // 2} rows decodes without it"
    )


def align(batch) -> None:
    """Every running row's cache ending at one column again, as :class:`Batch` lays rows out (a row that fell
    behind is moved right, its start with it)."""
    ends = batch.ends
    if ends is None:
        return
    live = [i for i, r in enumerate(batch.rows) if r.finish is None]
    col = max((int(ends[i]) for i in live), default=batch.col)
    for i in live:
        end, start = int(ends[i]), int(batch.start[i])
        if end < col:
            for cache in (batch.keys, batch.values):
                cache[:, i, :, start + col - end : col] = cache[:, i, :, start:end].clone()
            batch.start[i] = start + col - end
    batch.col, batch.ends = col, None


def _room(batch, live: list[int], width: int) -> list[int]:
    """Columns for ``width`` more tokens in every running row, and no more cache slots than the running rows'
    bucket (:func:`slots_for`; a step's linear layers compute that many rows); returns the running rows' slots (a
    relayout moves them)."""
    slots = slots_for(len(live))
    ends = batch.ends
    if ends is not None and int(ends[live].max()) + width <= batch.keys.shape[3] and len(batch.rows) <= slots:
        return live
    align(batch)
    if batch.col + width > batch.keys.shape[3] or len(batch.rows) > slots:
        lo = int(batch.start[live].min())
        left = max(r.budget - len(r.token_ids) for r in (batch.rows[i] for i in live))
        batch._relayout(live, slots, 0, max(batch.col - lo + left + width + 1, batch.keys.shape[3]))
        live = list(range(len(live)))
    batch.ends = torch.full((len(batch.rows),), batch.col, dtype=torch.long)
    return live


def verify(batch, k: int) -> tuple[list[Row], int, int, int]:
    """Feed every running row its next token and up to ``k`` drafted ones; keep each drafted token that equals the
    token sampled before it. Returns (finished rows, tokens made, tokens drafted, drafted tokens kept)."""
    live = [i for i, r in enumerate(batch.rows) if r.finish is None]
    drafts = [_draft(batch.rows[i], k) for i in live]
    width = 1 + k if any(drafts) else 1  # (one width for every drafting round: its linear layers' row count)
    live = _room(batch, live, width)
    rows = [batch.rows[i] for i in live]
    slots = torch.tensor(live)
    tokens = torch.tensor([[int(batch.next_tokens[i]), *d, *[0] * (width - 1 - len(d))] for i, d in zip(live, drafts)])
    steps = torch.arange(width)
    logits = forward(
        batch.dec,
        tokens,
        batch.positions[slots].unsqueeze(1) + steps,
        batch.keys,
        batch.values,
        slots,
        batch.ends[slots].unsqueeze(1) + steps,
        batch.start[slots].tolist(),
        packed_rows(DRAFT_ROWS if width > 1 else len(batch.rows)),  # one packing for every drafting round
    )
    finished, fed, active = [], [0] * len(rows), list(range(len(rows)))
    for j in range(width):
        toks, lps = batch.sample(logits[torch.tensor(active), j].float(), [rows[a] for a in active])
        finished += batch._record([rows[a] for a in active], toks.tolist(), lps.tolist())
        for a, tok in zip(active, toks.tolist()):
            fed[a] = j + 1
            batch.next_tokens[live[a]] = tok
        active = [
            a for a, tok in zip(active, toks.tolist()) if rows[a].finish is None and drafts[a][j : j + 1] == [tok]
        ]
        if not active:
            break
    fed_t = torch.tensor(fed)
    batch.positions[slots] += fed_t
    batch.ends[slots] += fed_t
    batch.col = int(batch.ends[slots].max())
    drafted = sum(len(d) for d in drafts)
    return finished, sum(fed), drafted, sum(fed) - len(rows)


def _draft(row: Row, k: int) -> list[int]:
    left = row.budget - len(row.token_ids) - 1  # (a draft never takes a row past its budget)
    return row.drafts.draft(row.token_ids, min(k, left)) if row.drafts is not None else []


@torch.no_grad()
def forward(dec, tokens, positions, keys, values, slots, cols, starts: list[int], rows: int) -> torch.Tensor:
    """``tokens`` (L, J) of the rows in cache ``slots`` (L,) at ``positions`` and cache columns ``cols`` (L, J)
    through ``dec`` (a batch-invariant :class:`strop.serving.kvdecode.LlamaDecoder`); row ``l``'s token ``j``
    attends the columns ``starts[l] .. cols[l, j]``; the linear layers compute ``rows`` rows per call (the weights
    packed for it, the previous packing kept). Returns the logits (L, J, V), each computed as one decode step
    computes it."""
    L, J = tokens.shape
    dec._sync(rows, keep=True)
    x = dec.backbone.embed_tokens(tokens.reshape(-1))  # (L J, hidden)
    cos, sin = dec.backbone.rotary_emb(x, positions.reshape(-1, 1))  # (L J, 1, D): broadcasts over heads
    where = (slots.repeat_interleave(J), cols.reshape(-1))
    rows = list(zip(slots.tolist(), starts, cols[:, 0].tolist()))  # each row's cache slot, start and end column
    for i, (ln1, qkv, o_proj, ln2, gate_up, down, act) in enumerate(dec.layers):
        q, k, v = dec._split_rope(rows_linear(qkv, dec._norm(ln1, x)), cos, sin, dec.qk_norms[i])
        keys[i][where[0], :, where[1]] = k
        values[i][where[0], :, where[1]] = v
        q = q.reshape(L, J, dec.n_kv, dec.group, dec.head_dim)
        o = torch.empty_like(q)
        for (r, (slot, s, e)), j in itertools.product(enumerate(rows), range(J)):  # each as a decode step's call
            o[r, j] = attend_one(
                q[r, j], keys[i, slot, :, s : e + j + 1], values[i, slot, :, s : e + j + 1], dec.scale
            )[0]
        x = x + rows_linear(o_proj, o.reshape(L * J, -1))
        g, u = rows_linear(gate_up, dec._norm(ln2, x)).chunk(2, dim=-1)
        x = x + rows_linear(down, act(g).mul_(u))
    return rows_linear(dec.head, dec._norm(dec.backbone.norm, x)).view(L, J, -1)
