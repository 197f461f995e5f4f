"""Routed experts in the fast decoder (Qwen3-MoE), and the routes they record.

A token's MLP is its router's top-k experts, weighted by the router's softmax over those k (renormalised where the
model says so), as the model's own sparse block computes it. The decoder batches the dispatch: the tokens of a step
(or a prefill) are sorted by expert, and each expert that any token chose runs once, on all of its tokens (two
matmuls; on a CPU all experts in one ``torch._grouped_mm`` call each, which computes the bits per-expert ``F.linear``
calls compute here), instead of once per token. Each token's expert outputs are summed in expert order, as the
model's block sums them.

Every call records its choice: the experts (``top_k`` ids) each token was routed to, per MoE layer. The engine keeps
them per row as ``Completion.routed_experts``, an int16 tensor ``[tokens, moe layers, top_k]`` over the prompt and
every response token fed back in (all but the last one), the layout vLLM returns with
``--enable-return-routed-experts``: what a trainer needs to replay the engine's routes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


GROUPED = hasattr(torch, "_grouped_mm")  # torch's grouped matmul: one call for every expert's rows


def is_routed(mlp) -> bool:
    """Whether a decoder layer's ``mlp`` is a routed-experts block this module runs (Qwen3-MoE's layout: a
    ``gate`` router with ``weight`` (experts, hidden) and ``experts`` with 3-D ``gate_up_proj`` and ``down_proj``)."""
    experts, gate = getattr(mlp, "experts", None), getattr(mlp, "gate", None)
    return (
        experts is not None
        and gate is not None
        and all(hasattr(experts, a) for a in ("gate_up_proj", "down_proj", "act_fn"))
        and all(hasattr(gate, a) for a in ("weight", "top_k", "norm_topk_prob"))
    )


class RoutedExperts:
    """One layer's routed MLP (``block``: the model's sparse block), reading its parameters at every call (an
    update in place is seen at the next step)."""

    def __init__(self, block):
        self.router, self.experts = block.gate, block.experts
        self.top_k, self.renormalise = self.router.top_k, self.router.norm_topk_prob

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``h`` (N, hidden) -> the chosen experts (N, top_k) and their weights (N, top_k), as the model's router."""
        logits = F.linear(h, self.router.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalise:
            weights /= weights.sum(dim=-1, keepdim=True)
        return chosen, weights.to(logits.dtype)

    def __call__(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``h`` (..., hidden) -> the layer's output (..., hidden) and the experts each token took (..., top_k)."""
        shape = h.shape
        h = h.reshape(-1, shape[-1])
        chosen, weights = self.route(h)
        flat = chosen.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert, tokens in order
        counts = torch.bincount(flat, minlength=self.experts.gate_up_proj.shape[0])
        tokens = order // self.top_k
        x = h[tokens]
        gate_up, down, act = self.experts.gate_up_proj, self.experts.down_proj, self.experts.act_fn
        if GROUPED and h.device.type == "cpu":  # every expert's rows in one call (per-expert F.linear's bits here)
            offs = counts.cumsum(0).to(torch.int32)
            g, u = torch._grouped_mm(x, gate_up.transpose(1, 2), offs=offs).chunk(2, dim=-1)
            y = torch._grouped_mm(act(g) * u, down.transpose(1, 2), offs=offs)
        else:  # one pair of calls per expert that any token chose
            parts, start = [], 0
            for expert, n in enumerate(counts.tolist()):
                if n:
                    g, u = F.linear(x[start : start + n], gate_up[expert]).chunk(2, dim=-1)
                    parts.append(F.linear(act(g) * u, down[expert]))
                    start += n
            y = torch.cat(parts)
        y = y * weights.reshape(-1)[order, None]
        out = torch.zeros_like(h).index_add_(0, tokens, y.to(h.dtype))  # each token's experts summed in expert order
        return out.reshape(shape), chosen.reshape(*shape[:-1], self.top_k)


def record_prompt_routes(routes: list[torch.Tensor], rows, which: list[int], prompts: list[list[int]], P: int) -> None:
    """After a prefill of left-padded unique prompts (``routes``: one (prompts, P, top_k) per MoE layer; none for a
    dense model): each row's prompt routes, from its prompt's (``which``)."""
    if routes:
        stacked = torch.stack(routes, dim=-2).to(torch.int16)  # (prompts, P, layers, top_k)
        for row, j, prompt in zip(rows, which, prompts):
            row.routes = [stacked[j, P - len(prompt) :]]


def record_step_routes(routes: list[torch.Tensor], rows, slots: list[int]) -> None:
    """After a decode step (``routes``: one (cache slots, top_k) per MoE layer): the routes of each running row's
    fed token (``rows`` in cache ``slots``)."""
    if routes:
        stacked = torch.stack(routes, dim=-2).to(torch.int16)  # (slots, layers, top_k)
        for row, slot in zip(rows, slots):
            row.routes.append(stacked[slot])


def row_routes(parts: list[torch.Tensor]) -> torch.Tensor | None:
    """A row's recorded routes (its prompt's, then one per step) as one int16 tensor [tokens, layers, top_k]."""
    return torch.cat([p.reshape(-1, *p.shape[-2:]) for p in parts]) if parts else None
