"""Routing replay (R3) in the trainer: each routed-experts layer takes the experts the engine chose for a token,
not the ones its live router would choose, while the gate weights come from the live router.

The engine records its choices (:mod:`strop.serving.moe`, ``Completion.routed_experts``). In the trainer's forward a
hook on every router replaces the router's (weights, experts) by (the live router's softmax gathered at the replayed
experts, renormalised where the model renormalises; the replayed experts). Only the discrete choice is replayed: the
gradient reaches the router through the softmax, and it reaches every replayed expert, also one that the live top-k
would not have picked (taking the weights after the live top-k's zeroing would give that expert no weight and no
gradient). A token without recorded routes (-1) keeps the live router's choice.

The hook also counts, per layer, the router decisions where the live router disagrees with the replayed one: the
fraction of replayed (token, expert) decisions that are not among the live top-k.
"""

from __future__ import annotations

import contextlib

import torch

NO_ROUTE = -1


def routers(model) -> list[torch.nn.Module]:
    """The routers of ``model``'s routed-experts layers, in layer order (Qwen3-MoE's layout: a layer's ``mlp`` with
    ``experts`` and a ``gate`` router that has ``weight``, ``top_k`` and ``norm_topk_prob``)."""
    out = []
    for module in model.modules():
        gate, experts = getattr(module, "gate", None), getattr(module, "experts", None)
        if experts is not None and all(hasattr(gate, a) for a in ("weight", "top_k", "norm_topk_prob")):
            out.append(gate)
    return out


class RoutingReplay:
    """Replay hooks on ``model``'s routers; :meth:`replaying` sets the routes of one forward. With
    ``replace=False`` the hooks only count: the live router routes, and the disagreement with the engine's routes
    is measured all the same."""

    @classmethod
    def of_policy(cls, model, replace: bool = True) -> "RoutingReplay | None":
        """The trainer's: replaying (algo.routing_replay), refused for a model without routed-experts layers; or
        only measuring, for a routed-experts model (None for any other)."""
        if not replace:
            return cls(model, replace=False) if routers(model) else None
        if not routers(model):
            kind = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
            raise ValueError(
                f"algo.routing_replay=true: the model ({kind}) has no routed-experts layers that strop replays "
                "(Qwen3-MoE's layout: an mlp with experts and a gate router); it routes nothing to replay"
            )
        return cls(model)

    def around(self, batch: dict):
        """The forward of a collated micro-batch with its routes (``batch['routes']``, laid out as its tokens)."""
        if "routes" not in batch and not self.replace:
            return contextlib.nullcontext()  # nothing recorded to measure against
        if "routes" not in batch:
            raise ValueError("algo.routing_replay=true: a micro-batch without routed experts reached the policy")
        return self.replaying(batch["routes"])

    def check(self, samples) -> None:
        """Refuse a step with a sample that carries no routes (an engine that did not record them, a samples
        file without them): its tokens would route live, silently unlike the rest."""
        for s in samples:
            if s.routed_experts is None and not self.replace:
                continue
            if s.routed_experts is None:
                raise ValueError(
                    f"algo.routing_replay=true: sample group={s.group_id} index={s.index} carries no routed experts "
                    "(its engine recorded none: strop's decoder records them for a routed-experts model, vLLM and "
                    "SGLang servers when started with --enable-return-routed-experts)"
                )
            n, k = len(self.routers), self.routers[0].top_k
            if s.routed_experts.dim() == 2 and s.routed_experts.shape[1] == n * k:  # SGLang's flat [tokens, n * k]
                s.routed_experts = s.routed_experts.reshape(-1, n, k)
            if s.routed_experts.shape[1] != n:
                raise ValueError(
                    f"routed experts: sample group={s.group_id} index={s.index} has routes for "
                    f"{s.routed_experts.shape[1]} routed-experts layers, but the model has {len(self.routers)}"
                )

    def count_into(self, stats) -> None:
        """The disagreement counted since the last call into a step's stats (a fraction summed over ranks):
        ``routing_disagreement`` and ``routing_disagreement_layer{i}``."""
        counts, self.counts = self.counts, torch.zeros_like(self.counts)
        if not self.replace and not counts[:, 1].any():
            return  # (measuring, and no sample carried routes)
        stats.ratio("routing_disagreement", float(counts[:, 0].sum()), float(counts[:, 1].sum()))
        for i, (bad, total) in enumerate(counts.tolist()):
            stats.ratio(f"routing_disagreement_layer{i}", bad, total)

    def __init__(self, model, replace: bool = True):
        self.routers, self.replace = routers(model), replace
        self.routes: torch.Tensor | None = None  # (tokens, layers, top_k) of the running forward, flattened
        self.counts = torch.zeros(len(self.routers), 2, dtype=torch.float64)  # per layer: disagreeing, decisions
        self._handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(self.routers)]

    def close(self) -> None:
        for h in self._handles:
            h.remove()

    @contextlib.contextmanager
    def replaying(self, routes: torch.Tensor | None):
        """Within it, forwards replay ``routes`` ((..., layers, top_k) laid out as the forward's tokens: the router
        sees them flattened in the same order; None: the live routers choose)."""
        if routes is not None and routes.shape[-2] != len(self.routers):
            raise ValueError(
                f"routes for {routes.shape[-2]} routed-experts layers, but the model has {len(self.routers)}"
            )
        self.routes = None if routes is None else routes.reshape(-1, *routes.shape[-2:])
        try:
            yield
        finally:
            self.routes = None

    def _hook(self, layer: int):
        def hook(module, args, output):
            if self.routes is None:
                return output
            logits, _, live = output
            replay = self.routes[:, layer].to(device=live.device, dtype=torch.long)
            if replay.shape[0] != live.shape[0]:
                raise ValueError(f"routes for {replay.shape[0]} tokens, but the router saw {live.shape[0]}")
            known = (replay >= 0).all(dim=-1, keepdim=True)
            chosen = torch.where(known, replay, live)
            probs = torch.softmax(logits, dim=-1, dtype=torch.float)
            weights = probs.gather(-1, chosen)
            if module.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            with torch.no_grad():
                missing = ~(chosen.unsqueeze(-1) == live.unsqueeze(-2)).any(-1)  # replayed, not in the live top-k
                self.counts[layer, 0] += float((missing & known).sum())
                self.counts[layer, 1] += float(known.sum()) * chosen.shape[-1]
            return (logits, weights.to(logits.dtype), chosen) if self.replace else output

        return hook

    def take_metrics(self) -> dict[str, float]:
        """``routing_disagreement`` (all layers) and ``routing_disagreement_layer{i}`` since the last call: the
        fraction of replayed router decisions the live router would not have made; {} when nothing was replayed."""
        counts, self.counts = self.counts, torch.zeros_like(self.counts)
        if not counts[:, 1].sum():
            return {}
        out = {"routing_disagreement": float(counts[:, 0].sum() / counts[:, 1].sum())}
        for i, (bad, total) in enumerate(counts.tolist()):
            if total:
                out[f"routing_disagreement_layer{i}"] = bad / total
        return out
