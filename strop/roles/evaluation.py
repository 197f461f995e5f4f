"""The evaluation role: greedy accuracy and mean reward on the held-out prompts, before training and every
``eval.every`` steps."""

from __future__ import annotations

import time

from strop.observe.metrics import eval_metrics
from strop.roles.placement import RANK0
from strop.roles.rank0 import Rank0
from strop.rollout.generate import rollout_groups


class Evaluation:
    """Rank 0 evaluates at step 0 (:meth:`at`), then after every ``eval.every``-th step and the last (:meth:`after`)."""

    placement = RANK0

    def __init__(self, desk: Rank0):
        self.desk = desk

    def after(self, step: int) -> None:
        cfg = self.desk.cfg
        if step == cfg.train.steps or (cfg.eval.every and step % cfg.eval.every == 0):
            self.at(step)

    def at(self, step: int) -> dict | None:
        """Greedy accuracy on the held-out prompts (the fraction whose reward reaches ``eval.accuracy_threshold``)
        and their mean reward, logged at ``step`` and returned (None: no held-out prompts); the scored groups
        are kept in ``self.groups``."""
        d, c = self.desk, self.desk.c
        if c.eval_prompts is None:
            return None
        t = time.perf_counter()
        groups = [c.eval_prompts.make_group(i, 1, group_id=-1 - i) for i in range(len(c.eval_prompts))]
        training_counts = d.ctx.take_counts()  # (the step's failures and retries stay the step's)
        groups = d.loop.run(rollout_groups(d.ctx, groups, c.eval_sampling, apply_filter=False))
        seconds = time.perf_counter() - t
        row = {"step": step, **eval_metrics(groups, d.cfg.eval.accuracy_threshold), "eval_seconds": seconds}
        row |= {f"eval_{k}": v for k, v in d.ctx.take_counts().items()}
        d.ctx.counts.update(training_counts)
        if any("tool_calls" in g[0].metadata for g in groups):  # multi-turn: how often the answer used a tool
            row["eval_tool_call_fraction"] = sum(g[0].metadata.get("tool_calls", 0) > 0 for g in groups) / len(groups)
        if any("agent_session" in g[0].metadata for g in groups):  # agents: calls per session, how sessions ended
            row["eval_agent_calls_per_session"] = sum(g[0].metadata.get("session_calls", 0) for g in groups) / len(
                groups
            )
            row["eval_agent_multi_call_fraction"] = sum(
                g[0].metadata.get("session_calls", 0) > 1 for g in groups
            ) / len(groups)
        d.log.log(row)
        d.progress.update(eval_acc=row["eval_accuracy"])
        self.groups = groups
        return row
