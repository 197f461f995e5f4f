"""The rollout manager: which groups each step trains on, generated how far ahead, with exact staleness.

Weight versions: the engine starts at version 0 and holds version ``k`` after the update that
follows step ``k``. A token's version is that of the weights that sampled it
(``Sample.weight_versions``). Step ``k`` trains on the weights of version ``k - 1``, so a token of
version ``v`` trained at step ``k`` has **staleness** ``k - 1 - v``: 0 in ``sync`` mode, 1 in
``one_step_off``, at most ``rollout.max_staleness`` in ``async`` (docs/rollout.md).

Modes (``rollout.mode``), each a scheduler of strop.rollout.schedulers behind one ``next(step)``:

- ``sync``: a step's groups are generated, then trained on (today's path, unchanged, when there
  is no over-sampling or dynamic sampling);
- ``one_step_off``: step k+1's groups are generated while step k trains;
- ``async``: groups are generated continuously; each step takes the first ``prompts_per_step``
  that finished, never more held than the staleness bound leaves room for
  (:meth:`strop.rollout.schedulers.AsyncScheduler.capacity`); a group staler than
  ``max_staleness`` all the same is dropped or regenerated (``rollout.stale_groups``).

At a weight update, unfinished samples either finish on the old weights (``rollout.partial=finish``)
or are aborted and resumed on the new ones from their prompt plus the tokens they have, with the
budget they have left (``partial=resume``), or stay in the engine, frozen while the weights load, and
continue on the new ones (``partial=keep``, the embedded engine's keep pause); the tokens keep their versions. Tokens of a resumed
sample from before the update are trained with the importance correction against their own
logprobs (``resumed_tokens=correct``) or masked out of the loss (``mask``).

Accounting: every sample generated is trained on, dropped with a reason, or still held (finished
and waiting, or being generated) -- :meth:`RolloutManager.check_accounts` verifies it every step.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter

from strop.engines.base import Counted
from strop.plugins import call_hook_sync
from strop.rollout.generate import _generate_one, failed_group, score_group, settle
from strop.rollout.schedulers import SCHEDULERS, staleness
from strop.types import Sample, Status

DROP_REASONS = (
    "filter",
    "failed_group",
    "all_equal_reward",
    "stale",
    "over_sampled",
    "aborted_leftover",
    "no_trainable_sample",
)


class RolloutManager:
    """Launches, counts and holds the groups its scheduler (``rollout.mode``) asks for; what a step
    trains on, with its metrics; weight updates around what is generating; checkpoints of what it holds."""

    def __init__(self, cfg, c, ctx):
        self.cfg, self.r, self.c, self.ctx = cfg, cfg.rollout, c, ctx
        self.ready: list[list[Sample]] = []  # finished groups that passed the filters, in finishing order
        self.tasks: set[asyncio.Task] = set()  # groups being generated
        self.resume_gate = asyncio.Event()  # cleared while aborted samples wait for new weights
        self.resume_gate.set()
        self.closing = False
        self.wake = asyncio.Event()  # async: a group finished or a step took groups
        self.generated = 0  # samples launched (each regeneration counts again)
        self.trained = 0
        self.dropped: Counter = Counter()
        self.step_dropped: Counter = Counter()
        self.step, self.step_drawn = 0, 0
        self.version = 0  # the weight version the engine was last updated to (async: what a new group samples)
        self.taken = 0  # the last step whose groups were taken
        self.round_held = 0  # samples of groups a round (sync / one_step_off) kept, until batch() takes them
        self.launched = 0  # launch order of groups (rounds count finished groups in this order)
        self.step_filtered_groups = 0  # async: groups a filter dropped while this step waited
        self.finished_lengths: list[int] = []  # response lengths of every sample finished since the last step
        self.paused = False  # async: no new groups while a checkpoint drains what is in flight
        self.error: BaseException | None = None  # a group's generation failed (engine error): the step says so
        self.scheduler = SCHEDULERS[self.r.mode](self)

    # ---- what the driver calls -------------------------------------------------------------
    async def batch(self, step: int) -> tuple[list[list[Sample]], dict]:
        """The groups step ``step`` trains on, and the manager's metrics for it."""
        self.step = step  # the step counters run from the previous batch() (one_step_off: the prefetch)
        asked = time.perf_counter()
        groups = await self.scheduler.next(step)
        waited = time.perf_counter() - asked  # the trainer, starved of groups
        trained = [s for g in groups for s in g if s.status.trainable]
        for g in groups:
            for s in g:
                if not s.status.trainable:
                    self.drop([s], "no_trainable_sample" if s.status != Status.FAILED else "failed")
        self.trained += len(trained)
        if self.r.resumed_tokens == "mask":
            for s in trained:
                if s.metadata.get("resumed") or len(set(s.weight_versions)) > 1:  # (resumed, or kept)
                    last = s.weight_versions[-1]
                    s.loss_mask = [m if v == last else 0 for m, v in zip(s.loss_mask, s.weight_versions)]
        metrics = self._metrics(step, groups, trained) | {"rollout_wait_seconds": waited}
        metrics |= self.scheduler.take_diagnostics()
        take_counts = (
            self.c.engine.take_counts if isinstance(self.c.engine, Counted) else None
        )  # the router: failovers and engine events
        if take_counts is not None:
            metrics |= take_counts()
        metrics |= self.ctx.take_counts()  # failures, retries, groups dropped for a failed member
        if "judge" in self.ctx.extra:  # reward.endpoint: calls, retries, rule-scored, failures by cause
            metrics |= self.ctx.extra["judge"].take_counts()
        if "agent" in self.ctx.extra:  # the proxy: calls, 429s, idle sessions, bad requests; agents stopped
            metrics |= self.ctx.extra["agent"].take_counts()
        self.step_dropped, self.step_drawn = Counter(), 0
        self.taken = step
        return groups, metrics

    async def update_weights(self, update, version: int) -> None:
        """Run ``update()``, the engine's update to weight ``version``. With ``partial=resume`` outside
        sync mode, in one piece: no new request goes out, what is generating is aborted (its samples
        keep their tokens), the weights load, then the aborted samples continue on them. Async mode
        starts the groups the new version makes room for."""
        agent = self.ctx.extra.get("agent")
        if agent is not None:  # agents' calls get 429 (and retry) while the weights change
            async with agent.proxy.hold("weight update"):
                await self._update(update)
        else:
            await self._update(update)
        self.version = version
        self.wake.set()

    async def _update(self, update) -> None:
        if self.r.partial == "keep" and self.r.mode != "sync":
            # the engine's keep pause: what is generating freezes, the weights load, it continues on them from
            # its tokens so far (recomputed, never from a cache of the old weights), each token keeping its version
            await self.c.engine.pause("keep")
            try:
                await update()
            finally:
                self.c.engine.resume()
        elif self.r.partial != "resume" or self.r.mode == "sync":
            await update()
        else:
            self.resume_gate.clear()
            try:
                if self.tasks:
                    await self.c.engine.abort_all()
                await update()
            finally:
                self.resume_gate.set()

    async def accounts(self) -> dict[str, int]:
        """:meth:`check_accounts`, in the event loop that changes them."""
        return self.check_accounts()

    def check_accounts(self) -> dict[str, int]:
        """Every generated sample is trained, dropped with a reason, or held: raise if not."""
        held = sum(len(g) for g in self.ready) + self._in_flight_samples()
        dropped = sum(self.dropped.values())
        if self.generated != self.trained + dropped + held:
            raise RuntimeError(
                f"rollout accounting is off (a bug): {self.generated} samples generated but "
                f"{self.trained} trained + {dropped} dropped + {held} held"
            )
        return {"generated": self.generated, "trained": self.trained, "dropped": dropped, "held": held}

    async def close(self) -> None:
        self.closing = True
        self.resume_gate.set()
        for t in [*self.scheduler.background(), *self.tasks]:
            if t is not None and not t.done():
                t.cancel()
        await asyncio.gather(
            *(t for t in [*self.scheduler.background(), *self.tasks] if t is not None), return_exceptions=True
        )

    # ---- checkpoints -------------------------------------------------------------------------
    async def pause(self) -> dict | None:
        """For a checkpoint: stop starting new groups, let what is generating finish (a short drain),
        and return what the manager holds: one_step_off's next step, async's finished groups, and the
        counters. None in sync mode, which holds nothing between steps. :meth:`resume` restarts."""
        if self.r.mode == "sync":
            return None
        self.paused = True
        prefetched = await self.scheduler.prefetched()
        while self.tasks:
            await asyncio.gather(*self.tasks, return_exceptions=True)
        if self.error is not None:
            raise self.error
        return {
            "ready": list(self.ready),
            "prefetched": prefetched,
            "generated": self.generated,
            "trained": self.trained,
            "dropped": dict(self.dropped),
            "step_dropped": dict(self.step_dropped),
            "step_drawn": self.step_drawn,
            "finished_lengths": list(self.finished_lengths),
        }

    async def resume(self) -> None:
        self.paused = False
        self.wake.set()

    async def load(self, state: dict | None, step: int) -> None:
        """Take back what :meth:`pause` returned (a run resumed after ``step``, whose weights the engine
        gets next)."""
        self.taken = self.step = self.version = step
        if not state:
            return
        self.ready = state["ready"]
        if state["prefetched"] is not None:
            self.scheduler.load(state["prefetched"])
        self.generated, self.trained, self.dropped = state["generated"], state["trained"], Counter(state["dropped"])
        self.step_dropped, self.step_drawn = Counter(state["step_dropped"]), state["step_drawn"]
        self.finished_lengths = list(state["finished_lengths"])

    # ---- generation of one group -------------------------------------------------------------
    def _in_flight_samples(self) -> int:
        """Samples being generated, and finished ones a round has kept for a step not yet taken."""
        return sum(len(t.group) for t in self.tasks) + self.round_held  # type: ignore[attr-defined]

    def launch(self, group: list[Sample]) -> asyncio.Task:
        """Start generating ``group``. The task stays in ``self.tasks`` (its samples count as held)
        until whoever waits for it has counted the outcome, in the same tick: nothing is ever
        uncounted in between."""
        self.generated += len(group)
        for s in group:
            s.reset_response()
            s.metadata.pop("resumed", None)
        task = asyncio.ensure_future(self._run_group(group))
        task.group, task.order = group, self.launched  # type: ignore[attr-defined]
        task.version, task.started = self.version, time.perf_counter()  # type: ignore[attr-defined]
        self.launched += 1
        self.tasks.add(task)
        return task

    async def _sample(self, ctx, s: Sample, sampling) -> Sample:
        while True:
            await self.resume_gate.wait()  # no request goes out while an update with partial=resume runs
            s = await _generate_one(self.ctx, s, sampling)
            if (
                s.status == Status.ABORTED
                and self.r.partial == "resume"
                and not self.closing
                and not s.metadata.get("leftover")
            ):
                if s.response_length:  # it had tokens: they are kept and the sample continues after them
                    s.metadata["resumed"] = s.metadata.get("resumed", 0) + 1
                s.status = Status.PENDING
                continue
            # a multi-turn sample the engine aborted (or answered without logprobs) starts over, off-policy
            # modes only (sync mode trains the step without it), at most 3 times
            if (
                s.status == Status.ABORTED
                and ("tool_calls" in s.metadata or s.metadata.get("session_state") == "aborted")
                and self.r.mode != "sync"
                and not self.closing
                and not s.metadata.get("leftover")
                and s.metadata.get("requeued", 0) < 3
            ):
                s.metadata["requeued"] = s.metadata.get("requeued", 0) + 1
                s.metadata.pop("extra_samples", None)  # an agent session starts over whole
                continue
            return s

    async def _run_group(self, group: list[Sample]) -> tuple[list[Sample], str | None]:
        """Generate and score ``group``: (group, None), or (group, the reason a filter drops it)."""
        settled = await asyncio.gather(*(settle(self.ctx, s, self.c.sampling, self._sample) for s in group))
        done = [x for d in settled for x in d]
        self.generated += len(done) - len(group)  # an agent session's forks are samples of the group too
        group[:] = done
        self.finished_lengths += [s.response_length for s in group]
        if any(s.metadata.get("leftover") and s.status == Status.ABORTED for s in group):
            return group, "aborted_leftover"  # stopped because the step was already full
        await score_group(self.ctx, group)
        if failed_group(self.ctx, group):  # a member failed past rollout.sample_retries: never a partial group
            return group, "failed_group"
        if self.r.dynamic_sampling and len({s.reward for s in group if s.status.trainable}) <= 1:
            return group, "all_equal_reward"
        if self.ctx.filter is not None and not call_hook_sync("filter", self.ctx.filter, group=group):
            return group, "filter"
        return group, None

    def drop(self, samples: list[Sample], reason: str) -> None:
        self.dropped[reason] += len(samples)
        self.step_dropped[reason] += len(samples)
        if reason in ("all_equal_reward", "filter"):
            self.step_filtered_groups += 1

    def draw(self, k: int) -> list[list[Sample]]:
        n = self.r.n_samples_per_prompt
        self.step_drawn += k
        return [self.c.train_prompts.make_group(i, n, gid) for i, gid in self.c.sampler.draw(k)]

    # ---- metrics ----------------------------------------------------------------------------------
    def _metrics(self, step: int, groups, trained: list[Sample]) -> dict:
        tok = [st for s in trained for st, m in zip(staleness(s, step), s.loss_mask) if m]
        histogram = Counter(tok)
        lengths, self.finished_lengths = self.finished_lengths, []
        out = {
            "staleness_mean": sum(tok) / max(len(tok), 1),
            "staleness_max": max(tok, default=0),
            "samples_trained": len(trained),
            "samples_dropped": sum(self.step_dropped.values()),
            "dropped_fraction": sum(self.step_dropped.values())
            / max(len(trained) + sum(self.step_dropped.values()), 1),
            "samples_held": sum(len(g) for g in self.ready) + self._in_flight_samples(),
            "resumed_fraction": sum(1 for s in trained if s.metadata.get("resumed")) / max(len(trained), 1),
            "response_length_trained_mean": sum(s.response_length for s in trained) / max(len(trained), 1),
            "samples_finished": len(lengths),
            "groups_drawn": self.step_drawn,
        }
        if lengths:  # (none finished since the last step: a mean of nothing is not reported as 0)
            out["response_length_generated_mean"] = sum(lengths) / len(lengths)
        for reason, n in self.step_dropped.items():
            out[f"dropped/{reason}"] = n
        out["staleness_histogram"] = {str(k): v for k, v in sorted(histogram.items())}
        return out


def describe(cfg) -> str:
    """One line: the mode, and how tokens of older weights are corrected (printed at start)."""
    r, a = cfg.rollout, cfg.algo
    parts = [f"rollout {r.mode}"]
    if r.mode == "async":
        bound = math.ceil(r.prompts_per_step * (r.max_staleness + 1) * r.over_sample)
        parts.append(
            f"max_staleness {r.max_staleness}, at most {bound} groups in flight, stale groups: {r.stale_groups}"
            + (
                " (paced: a step waits for the groups due at it; none dropped as stale)"
                if r.stale_groups == "wait"
                else ""
            )
        )
    if r.mode != "sync":
        parts.append(
            f"unfinished samples at an update: {r.partial}"
            + (f" (older tokens: {r.resumed_tokens})" if r.partial == "resume" else "")
        )
    if r.over_sample > 1 or r.dynamic_sampling:
        parts.append(f"over_sample {r.over_sample}" + (", dynamic sampling" if r.dynamic_sampling else ""))
    how = ", ".join(a.corrections()) or (
        "none"
        + (
            " (algo.off_policy_correction='none': tokens of older weights train as if on-policy)"
            if r.mode != "sync"
            else ""
        )
    )
    return "; ".join(parts) + f"; off-policy correction: {how}"
