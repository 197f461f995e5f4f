"""The embedded engine's fallback path, for models the fast decoder does not support: Hugging Face's
forward with a ``DynamicCache`` and static batches (prompts left-padded, finished rows dropped). A
batch-invariant engine decodes each request of a batch alone (padding and the batch's size would
change its numbers)."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from strop.types import Completion, SamplingParams


def decode_static(
    engine,
    prompts: list[list[int]],
    samplings: list[SamplingParams],
    request_ids: list[str | None],
    listeners: list | None = None,
) -> list[Completion]:
    """The fallback path's static batch of ``engine`` (:class:`strop.serving.embedded.EmbeddedEngine`).
    ``listeners``: per row None or (top_logprobs, fn), fn called from this thread with (token, logprob,
    top alternatives or None) as each token is decoded."""
    abort_gen, listeners = engine._abort_gen, listeners or [None] * len(prompts)
    if engine.batch_invariant and len(prompts) > 1:
        return [
            _decode(engine, [p], [s], [rid], [li], abort_gen)[0]
            for p, s, rid, li in zip(prompts, samplings, request_ids, listeners)
        ]
    return _decode(engine, prompts, samplings, request_ids, listeners, abort_gen)


@torch.no_grad()
def _decode(engine, prompts, samplings, request_ids, listeners, abort_gen: int) -> list[Completion]:
    """One static batch; ``abort_gen``: the engine's abort generation it started in (an abort_all
    since then ends it)."""
    n, version = len(prompts), engine.weight_version
    # per-row budgets: never run past the context window
    budgets = [min(s.max_new_tokens, engine.context_window - len(p)) for p, s in zip(prompts, samplings)]
    max_len = max(len(p) for p in prompts)
    input_ids = torch.full((n, max_len), engine.pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((n, max_len), dtype=torch.long)
    for i, p in enumerate(prompts):  # left padding keeps every row's next token at the end
        input_ids[i, max_len - len(p) :] = torch.tensor(p)
        attention_mask[i, max_len - len(p) :] = 1
    dev = engine.device
    input_ids, attention_mask = input_ids.to(dev), attention_mask.to(dev)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)

    temperature = torch.tensor([s.temperature for s in samplings], dtype=torch.float32, device=dev)
    top_p = torch.tensor([s.top_p for s in samplings], dtype=torch.float32, device=dev)
    top_k = torch.tensor([min(s.top_k, engine.vocab_size) for s in samplings], dtype=torch.long, device=dev)
    stop_sets = [set(s.stop_token_ids or engine.default_stop_token_ids) for s in samplings]
    generators = [torch.Generator().manual_seed(s.seed) if s.seed is not None else None for s in samplings]
    top_n = max((li[0] for li in listeners if li is not None), default=0)

    out_ids: list[list[int]] = [[] for _ in range(n)]
    out_lp: list[list[float]] = [[] for _ in range(n)]
    finish: list[str | None] = [None] * n
    active = torch.arange(n, device=dev)  # original row index of each row still in the batch
    cache = DynamicCache(config=engine.model.config)
    step_ids, step_pos, mask = input_ids, position_ids, attention_mask

    while len(active) > 0:
        out = engine.model(
            input_ids=step_ids,
            attention_mask=mask,
            position_ids=step_pos,
            use_cache=True,
            **{engine._cache_kwarg: cache},
            logits_to_keep=1,
        )
        logits = out.logits[:, -1, :].float()  # (B, V)
        rows = active.tolist()
        tokens, logprobs, *top = engine._sample(
            logits, temperature[active], top_p[active], top_k[active], [generators[r] for r in rows], top_n
        )
        top_values, top_ids = (t.tolist() for t in top[0]) if top else ([None] * len(rows),) * 2
        keep = []
        for j, (r, tok, lp) in enumerate(zip(rows, tokens.tolist(), logprobs.tolist())):
            out_ids[r].append(tok)
            out_lp[r].append(lp)
            if listeners[r] is not None:
                k = listeners[r][0]
                listeners[r][1](tok, lp, dict(zip(top_ids[j][:k], top_values[j][:k])) if k else None)
            if tok in stop_sets[r]:
                finish[r] = "stop"
            elif len(out_ids[r]) >= budgets[r]:
                finish[r] = "length"
            elif engine._abort_gen != abort_gen or request_ids[r] in engine._aborted_ids:
                finish[r] = "abort"
            else:
                keep.append(j)
        if not keep:
            break
        if len(keep) < len(rows):  # drop finished rows from the batch and the cache
            idx = torch.tensor(keep, device=dev)
            cache.batch_select_indices(idx)
            active, tokens, mask, step_pos = active[idx], tokens[idx], mask[idx], step_pos[idx]
        step_ids = tokens.view(-1, 1)
        mask = torch.cat([mask, torch.ones((len(active), 1), dtype=mask.dtype, device=dev)], dim=1)
        step_pos = step_pos[:, -1:] + 1
    return [Completion(out_ids[i], out_lp[i], finish[i], version) for i in range(n)]
