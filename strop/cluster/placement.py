"""The placement plan: which node holds which trainer ranks and which engines, as Ray bundles.

A pure function of the cluster's nodes (their total resources) and what the run asks for, so it
is tested on made-up clusters and printed before anything starts. Trainer ranks are packed onto
as few nodes as possible, in rank order (rank 0 on the node that holds the most of them, the
ranks of one node neighbours), because their collectives are the run's heaviest traffic.
Disaggregated engines get bundles of their own, on nodes without trainer ranks first; colocated
engine i shares trainer rank i's bundle (on a GPU: the trainer's and the engine's fractions of
one device, as slime colocates). A plan that cannot fit names the resource that is missing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

EPS = 1e-9


class PlacementError(RuntimeError):
    """The cluster cannot hold what the run asks for; the message names the missing resource."""


@dataclass(frozen=True)
class Node:
    """A node of the cluster: its id, its address and its total resources (CPU, GPU, custom ones)."""

    id: str
    address: str
    resources: dict[str, float]


@dataclass
class Bundle:
    """One reservation on one node: the trainer rank and/or the engine it holds."""

    node: str
    resources: dict[str, float]
    rank: int | None = None
    engine: int | None = None


@dataclass
class Plan:
    bundles: list[Bundle] = field(default_factory=list)
    nodes: list[Node] = field(default_factory=list)

    def rank_bundle(self, rank: int) -> int:
        return next(i for i, b in enumerate(self.bundles) if b.rank == rank)

    def engine_bundle(self, engine: int) -> int:
        return next(i for i, b in enumerate(self.bundles) if b.engine == engine)

    def node_of_rank(self, rank: int) -> str:
        return self.bundles[self.rank_bundle(rank)].node

    def local_rank(self, rank: int) -> int:
        """The rank's index among the trainer ranks of its node (LOCAL_RANK)."""
        node = self.node_of_rank(rank)
        return sorted(b.rank for b in self.bundles if b.rank is not None and b.node == node).index(rank)

    def table(self) -> str:
        """node | trainer ranks | engines | resources, one line per node that holds anything."""
        rows = [("node", "address", "trainer ranks", "engines", "resources")]
        for n in self.nodes:
            mine = [b for b in self.bundles if b.node == n.id]
            if not mine:
                continue
            ranks = [b.rank for b in mine if b.rank is not None]
            engines = [b.engine for b in mine if b.engine is not None]
            total: dict[str, float] = {}
            for b in mine:
                for k, v in b.resources.items():
                    total[k] = total.get(k, 0.0) + v
            rows.append(
                (
                    n.id[:12],
                    n.address,
                    _ranges(ranks) or "-",
                    _ranges(engines) or "-",
                    ", ".join(f"{k} {_num(v)}" for k, v in sorted(total.items())),
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def colocated_bundle(trainer: dict[str, float], engine: dict[str, float]) -> dict[str, float]:
    """What trainer rank i and engine i share: the sum of both, with GPUs rounded up to whole devices
    (two bundles of 0.6 GPU each must not land on one GPU)."""
    out = {k: trainer.get(k, 0.0) + engine.get(k, 0.0) for k in {*trainer, *engine}}
    if out.get("GPU"):
        out["GPU"] = float(math.ceil(out["GPU"] - EPS))
    return {k: v for k, v in out.items() if v > 0}


def plan_placement(
    nodes: list[Node],
    trainer_ranks: int,
    trainer: dict[str, float],
    engines: int = 0,
    engine: dict[str, float] | None = None,
    placement: str = "disaggregated",
) -> Plan:
    """The bundles for ``trainer_ranks`` ranks needing ``trainer`` each and ``engines`` engines needing
    ``engine`` each, on ``nodes``; a :class:`PlacementError` naming the missing resource if they do not fit."""
    engine = engine or {}
    if placement not in ("colocated", "disaggregated"):
        raise ValueError(f"placement must be 'colocated' or 'disaggregated', got {placement!r}")
    if not nodes:
        raise PlacementError("the cluster has no live node")
    colocated = placement == "colocated"
    if colocated and engines > trainer_ranks:
        raise PlacementError(f"colocated: {engines} engines need as many trainer ranks, got {trainer_ranks}")
    free = {n.id: dict(n.resources) for n in nodes}
    plan = Plan(nodes=list(nodes))
    rank_need = colocated_bundle(trainer, engine) if colocated else {k: v for k, v in trainer.items() if v > 0}
    what = "trainer rank + its engine" if colocated and engines else "trainer rank"
    # trainer ranks: the nodes that hold the most of them first, so they span as few nodes as possible
    order = sorted(nodes, key=lambda n: -_fits(free[n.id], rank_need))
    if sum(_fits(free[n.id], rank_need) for n in nodes) < trainer_ranks:
        raise PlacementError(_missing(nodes, free, rank_need, trainer_ranks, what))
    rank = 0
    for n in order:
        while rank < trainer_ranks and _fits(free[n.id], rank_need):
            _take(free[n.id], rank_need)
            plan.bundles.append(
                Bundle(n.id, dict(rank_need), rank=rank, engine=rank if colocated and rank < engines else None)
            )
            rank += 1
    if colocated or not engines:
        return plan
    need = {k: v for k, v in engine.items() if v > 0}
    holds_ranks = {b.node for b in plan.bundles}
    order = sorted(nodes, key=lambda n: (n.id in holds_ranks, -_fits(free[n.id], need)))
    if sum(_fits(free[n.id], need) for n in nodes) < engines:
        raise PlacementError(_missing(nodes, free, need, engines, "engine", after=f"{trainer_ranks} trainer ranks"))
    e = 0
    for n in order:
        while e < engines and _fits(free[n.id], need):
            _take(free[n.id], need)
            plan.bundles.append(Bundle(n.id, dict(need), engine=e))
            e += 1
    return plan


def _fits(free: dict[str, float], need: dict[str, float]) -> int:
    """How many bundles of ``need`` fit in ``free``."""
    counts = [math.floor(free.get(k, 0.0) / v + EPS) for k, v in need.items() if v > 0]
    return min(counts) if counts else 1 << 30


def _take(free: dict[str, float], need: dict[str, float]) -> None:
    for k, v in need.items():
        free[k] = free.get(k, 0.0) - v


def _missing(nodes, free, need, count: int, what: str, after: str = "") -> str:
    """The resource that stops ``count`` bundles of ``need`` from fitting, phrased for the user."""
    placed_after = f" (after placing {after})" if after else ""
    for key, amount in need.items():
        have = [(n, free[n.id].get(key, 0.0)) for n in nodes]
        fit = sum(math.floor(h / amount + EPS) for _, h in have)
        if fit < count:
            if not any(h > 0 for _, h in have):
                return (
                    f"missing resource {key!r}: {count} x {what} need {key} {_num(amount)} each, and no node "
                    f"has {key}{placed_after}"
                )
            where = ", ".join(f"{n.id[:12]} ({n.address}) {_num(h)}" for n, h in have)
            return (
                f"missing resource {key!r}: {count} x {what} need {key} {_num(amount)} each; the nodes hold "
                f"room for {fit}{placed_after}: {key} free per node: {where}"
            )
    where = "; ".join(f"{n.id[:12]}: " + ", ".join(f"{k} {_num(free[n.id].get(k, 0.0))}" for k in need) for n in nodes)
    return (
        f"{count} x {what} needing {_fmt(need)} each do not fit on any combination of nodes{placed_after} "
        f"(no single node holds one of each: {where})"
    )


def _fmt(resources: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {_num(v)}" for k, v in sorted(resources.items())) + "}"


def _num(v: float) -> str:
    return f"{v:g}"


def _ranges(xs: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    out, xs = [], sorted(xs)
    i = 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        out.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ", ".join(out)
