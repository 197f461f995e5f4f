"""The rollout manager: which groups each step trains on, generated how far ahead, with exact staleness.

Weight versions: the engine starts at version 0 and holds version ``k`` after the update that
follows step ``k``. A token's version is that of the weights that sampled it
(``Sample.weight_versions``). Step ``k`` trains on the weights of version ``k - 1``, so a token of
version ``v`` trained at step ``k`` has **staleness** ``k - 1 - v``: 0 in ``sync`` mode, 1 in
``one_step_off``, at most ``rollout.max_staleness`` in ``async`` (docs/rollout.md).

Modes (``rollout.mode``):

- ``sync``: a step's groups are generated, then trained on (today's path, unchanged, when there
  is no over-sampling or dynamic sampling);
- ``one_step_off``: step k+1's groups are generated while step k trains;
- ``async``: groups are generated continuously; each step takes the first ``prompts_per_step``
  that finished. A group is started only if a step it can still be trained at is free: started
  on weights of version ``w``, it is trained at step ``w + max_staleness + 1`` at the latest, so
  the manager holds (finished or generating) at most ``prompts_per_step`` groups for each step
  from the next one to that one (:meth:`RolloutManager._capacity`; AReaL bounds its rollouts the
  same way). A group with a token staler than ``max_staleness`` all the same (it finished late,
  behind groups started after it) is dropped or regenerated (``rollout.stale_groups``).

At a weight update, unfinished samples either finish on the old weights (``rollout.partial=finish``)
or are aborted and resumed on the new ones from their prompt plus the tokens they have, with the
budget they have left (``partial=resume``); the tokens keep their versions. Tokens of a resumed
sample from before the update are trained with the importance correction against their own
logprobs (``resumed_tokens=correct``) or masked out of the loss (``mask``).

Accounting: every sample generated is trained on, dropped with a reason, or still held (finished
and waiting, or being generated) -- :meth:`RolloutManager.check_accounts` verifies it every step.
"""

from __future__ import annotations

import asyncio
import math
from collections import Counter

from strop.plugins import call_hook, call_hook_sync
from strop.rollout.generate import _generate_one, score_group, with_segments
from strop.types import Sample, Status

DROP_REASONS = ("filter", "all_equal_reward", "stale", "over_sampled", "aborted_leftover", "no_trainable_sample")


def staleness(sample: Sample, step: int) -> list[int]:
    """Per-token staleness of ``sample`` if trained at ``step`` (trainer weights: version step - 1)."""
    return [step - 1 - v for v in sample.weight_versions]


class RolloutManager:
    def __init__(self, cfg, c, ctx):
        self.cfg, self.r, self.c, self.ctx = cfg, cfg.rollout, c, ctx
        self.ready: list[list[Sample]] = []  # finished groups that passed the filters, in finishing order
        self.tasks: set[asyncio.Task] = set()  # groups being generated
        self.resume_gate = asyncio.Event()  # cleared while aborted samples wait for new weights
        self.resume_gate.set()
        self.closing = False
        self.prefetch: asyncio.Task | None = None  # one_step_off: the next step's groups
        self.producer: asyncio.Task | None = None  # async: the continuous generation
        self.wake = asyncio.Event()  # async: a group finished or a step took groups
        self.generated = 0  # samples launched (each regeneration counts again)
        self.trained = 0
        self.dropped: Counter = Counter()
        self.step_dropped: Counter = Counter()
        self.step, self.step_drawn = 0, 0
        self.version = 0  # the weight version the engine was last updated to (async: what a new group samples)
        self.taken = 0  # the last step whose groups were taken
        self.collecting = 0  # async: groups the step being taken has collected so far
        self.round_held = 0  # samples of groups a round (sync / one_step_off) kept, until batch() takes them
        self.launched = 0  # launch order of groups (rounds count finished groups in this order)
        self.step_filtered_groups = 0  # async: groups a filter dropped while this step waited
        self.step_stale_groups = 0  # async: groups dropped as stale while this step waited
        self.stale_versions: Counter = Counter()  # async: the weight versions of stale tokens, for the error
        self.finished_lengths: list[int] = []  # response lengths of every sample finished since the last step
        self.ready_event = asyncio.Event()
        self.paused = False  # async: no new groups while a checkpoint drains what is in flight
        self.error: BaseException | None = None  # a group's generation failed (engine error): the step says so

    # ---- what the driver calls -------------------------------------------------------------
    @property
    def simple(self) -> bool:
        """Today's path: sync, no over-sampling, no dynamic sampling (the rollout hook sees whole steps)."""
        return self.r.mode == "sync" and self.r.over_sample == 1.0 and not self.r.dynamic_sampling

    async def batch(self, step: int) -> tuple[list[list[Sample]], dict]:
        """The groups step ``step`` trains on, and the manager's metrics for it."""
        self.step = step  # the step counters run from the previous batch() (one_step_off: the prefetch)
        if self.r.mode == "sync":
            groups = await self._round_robin(step)
        elif self.r.mode == "one_step_off":
            if self.prefetch is None:
                self.prefetch = asyncio.ensure_future(self._round_robin(step))
            groups = await self.prefetch
            self.prefetch = asyncio.ensure_future(self._round_robin(step + 1)) \
                if step < self.cfg.train.steps else None
        else:
            groups = await self._take_async(step)
        if self.r.mode != "async" and not self.simple:
            self.round_held -= sum(len(g) for g in groups)
        if self.r.mode == "sync":
            self._check_current(step, groups)
        trained = [s for g in groups for s in g if s.status.trainable]
        for g in groups:
            for s in g:
                if not s.status.trainable:
                    self._drop([s], "no_trainable_sample" if s.status != Status.FAILED else "failed")
        self.trained += len(trained)
        if self.r.resumed_tokens == "mask":
            for s in trained:
                if s.metadata.get("resumed"):
                    last = s.weight_versions[-1]
                    s.loss_mask = [m if v == last else 0 for m, v in zip(s.loss_mask, s.weight_versions)]
        metrics = self._metrics(step, groups, trained)
        take_counts = getattr(self.c.engine, "take_counts", None)  # the router: failovers and engine events
        if take_counts is not None:
            metrics |= take_counts()
        if "agent" in self.ctx.extra:  # the proxy: calls, 429s, idle sessions, bad requests; agents stopped
            metrics |= self.ctx.extra["agent"].take_counts()
        self.step_dropped, self.step_drawn = Counter(), 0
        self.taken = step
        return groups, metrics

    def _check_current(self, step: int, groups: list[list[Sample]]) -> None:
        """Sync mode: every trained token comes from the weights the engine was last updated to. A token
        of another version means an engine served weights it was never given: stop, never train on it."""
        current = getattr(self.c.engine, "weight_version", None)
        if current is None:
            return
        seen = Counter(v for g in groups for s in g if s.status.trainable
                       for v, m in zip(s.weight_versions, s.loss_mask) if m and v != current)
        if seen:
            raise RuntimeError(f"step {step}: {sum(seen.values())} trained tokens were sampled by weight versions "
                               f"{sorted(seen)}, but the engine's current version is {current}: an engine served "
                               "weights it was not updated to (rollout.mode=sync trains only on current weights)")

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
        if self.r.partial != "resume" or self.r.mode == "sync":
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
            raise RuntimeError(f"rollout accounting is off (a bug): {self.generated} samples generated but "
                               f"{self.trained} trained + {dropped} dropped + {held} held")
        return {"generated": self.generated, "trained": self.trained, "dropped": dropped, "held": held}

    async def close(self) -> None:
        self.closing = True
        self.resume_gate.set()
        for t in [self.producer, self.prefetch, *self.tasks]:
            if t is not None and not t.done():
                t.cancel()
        await asyncio.gather(*(t for t in [self.producer, self.prefetch, *self.tasks] if t is not None),
                             return_exceptions=True)

    # ---- checkpoints -------------------------------------------------------------------------
    async def pause(self) -> dict | None:
        """For a checkpoint: stop starting new groups, let what is generating finish (a short drain),
        and return what the manager holds: one_step_off's next step, async's finished groups, and the
        counters. None in sync mode, which holds nothing between steps. :meth:`resume` restarts."""
        if self.r.mode == "sync":
            return None
        self.paused = True
        prefetched = await asyncio.shield(self.prefetch) if self.prefetch is not None else None
        while self.tasks:
            await asyncio.gather(*self.tasks, return_exceptions=True)
        if self.error is not None:
            raise self.error
        return {"ready": list(self.ready), "prefetched": prefetched, "generated": self.generated,
                "trained": self.trained, "dropped": dict(self.dropped), "step_dropped": dict(self.step_dropped),
                "step_drawn": self.step_drawn, "finished_lengths": list(self.finished_lengths)}

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
            self.prefetch = asyncio.get_running_loop().create_future()
            self.prefetch.set_result(state["prefetched"])
            self.round_held = sum(len(g) for g in state["prefetched"])
        self.generated, self.trained, self.dropped = state["generated"], state["trained"], Counter(state["dropped"])
        self.step_dropped, self.step_drawn = Counter(state["step_dropped"]), state["step_drawn"]
        self.finished_lengths = list(state["finished_lengths"])

    # ---- generation of one group -------------------------------------------------------------
    def _in_flight_samples(self) -> int:
        """Samples being generated, and finished ones a round has kept for a step not yet taken."""
        return sum(len(t.group) for t in self.tasks) + self.round_held  # type: ignore[attr-defined]

    def _launch(self, group: list[Sample]) -> asyncio.Task:
        """Start generating ``group``. The task stays in ``self.tasks`` (its samples count as held)
        until whoever waits for it has counted the outcome, in the same tick: nothing is ever
        uncounted in between."""
        self.generated += len(group)
        for s in group:
            s.reset_response()
            s.metadata.pop("resumed", None)
        task = asyncio.ensure_future(self._run_group(group))
        task.group, task.order = group, self.launched  # type: ignore[attr-defined]
        self.launched += 1
        self.tasks.add(task)
        return task

    async def _sample(self, s: Sample) -> Sample:
        sampling = self.c.sampling
        while True:
            await self.resume_gate.wait()  # no request goes out while an update with partial=resume runs
            s = await _generate_one(self.ctx, s, sampling)
            if s.status == Status.ABORTED and self.r.partial == "resume" and not self.closing \
                    and not s.metadata.get("leftover"):
                if s.response_length:  # it had tokens: they are kept and the sample continues after them
                    s.metadata["resumed"] = s.metadata.get("resumed", 0) + 1
                s.status = Status.PENDING
                continue
            # a multi-turn sample the engine aborted (or answered without logprobs) starts over, off-policy
            # modes only (sync mode trains the step without it), at most 3 times
            if s.status == Status.ABORTED and ("tool_calls" in s.metadata or s.metadata.get("session_state") == "aborted") \
                    and self.r.mode != "sync" \
                    and not self.closing and not s.metadata.get("leftover") and s.metadata.get("requeued", 0) < 3:
                s.metadata["requeued"] = s.metadata.get("requeued", 0) + 1
                s.metadata.pop("extra_samples", None)  # an agent session starts over whole
                continue
            return s

    async def _run_group(self, group: list[Sample]) -> tuple[list[Sample], str | None]:
        """Generate and score ``group``: (group, None), or (group, the reason a filter drops it)."""
        done = with_segments(await asyncio.gather(*(self._sample(s) for s in group)))
        self.generated += len(done) - len(group)  # an agent session's forks are samples of the group too
        group[:] = done
        self.finished_lengths += [s.response_length for s in group]
        if any(s.metadata.get("leftover") and s.status == Status.ABORTED for s in group):
            return group, "aborted_leftover"  # stopped because the step was already full
        await score_group(self.ctx, group)
        if self.r.dynamic_sampling and len({s.reward for s in group if s.status.trainable}) <= 1:
            return group, "all_equal_reward"
        if self.ctx.filter is not None and not call_hook_sync("filter", self.ctx.filter, group=group):
            return group, "filter"
        return group, None

    def _drop(self, samples: list[Sample], reason: str) -> None:
        self.dropped[reason] += len(samples)
        self.step_dropped[reason] += len(samples)
        if reason in ("all_equal_reward", "filter"):
            self.step_filtered_groups += 1

    def _draw(self, k: int) -> list[list[Sample]]:
        n = self.r.n_samples_per_prompt
        self.step_drawn += k
        return [self.c.train_prompts.make_group(i, n, gid) for i, gid in self.c.sampler.draw(k)]

    # ---- sync and one_step_off: rounds of over-sampled groups ---------------------------------
    async def _round_robin(self, step: int) -> list[list[Sample]]:
        """``prompts_per_step`` groups: draw ``over_sample`` times what is missing, keep groups that
        pass the filters, top up for at most ``filter_max_rounds`` rounds. Once the step is full,
        sync mode aborts the rest; one_step_off lets them finish (an abort would also stop the
        evaluation that may be running beside them) and drops them as over_sampled."""
        if self.simple:
            return await self._simple_step(step)
        want, kept = self.r.prompts_per_step, []
        for _ in range(self.r.filter_max_rounds):
            pending = {self._launch(g) for g in self._draw(math.ceil((want - len(kept)) * self.r.over_sample))}
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in sorted(done, key=lambda t: t.order):  # type: ignore[attr-defined]
                    self.tasks.discard(task)
                    group, reason = task.result()  # an engine error stops the step here
                    if reason is not None:
                        self._drop(group, reason)
                    elif len(kept) < want:
                        kept.append(group)
                        self.round_held += len(group)
                    else:
                        self._drop(group, "over_sampled")
                if len(kept) == want and pending and self.r.mode == "sync":  # enough: stop the rest
                    for t in pending:
                        for smp in t.group:  # type: ignore[attr-defined]
                            smp.metadata["leftover"] = True
                    await self.c.engine.abort_all()
            if len(kept) >= want:
                break
        if not kept:
            raise RuntimeError(f"step {step}: no group passed the filters in {self.r.filter_max_rounds} rounds "
                               f"({dict(self.step_dropped)} samples dropped)")
        return kept

    async def _simple_step(self, step: int) -> list[list[Sample]]:
        """Exactly the path strop always had: the rollout hook on the step's groups (refilled when its
        filter drops some, for at most ``filter_max_rounds`` rounds)."""
        groups = []
        for _ in range(self.r.filter_max_rounds if self.ctx.filter is not None else 1):
            new = self._draw(self.r.prompts_per_step - len(groups))
            self.generated += sum(len(g) for g in new)
            got = await call_hook("rollout", self.c.hooks["rollout"], ctx=self.ctx, groups=new, sampling=self.c.sampling)
            forks = sum(s.metadata.get("segment", 0) > 0 for g in got for s in g)  # agent sessions' extra samples
            self.generated += forks
            self.finished_lengths += [s.response_length for g in got for s in g]
            filtered = sum(len(g) for g in new) + forks - sum(len(g) for g in got)
            if filtered > 0:  # the hook's filter dropped whole groups
                self.dropped["filter"] += filtered
                self.step_dropped["filter"] += filtered
            groups += got
            if len(groups) >= self.r.prompts_per_step:
                break
        return groups

    # ---- async: continuous generation -----------------------------------------------------------
    def _capacity(self) -> int:
        """Groups the manager may hold (finished, generating, or collected by the step being taken) now:
        ``prompts_per_step`` (times ``over_sample``) for each step a group started on the engine's weights
        can still be trained at, from the first step not yet taken to ``version + max_staleness + 1``.
        After a step is taken and before its update that is one step fewer, so a group started then
        never waits two steps for its turn; and none is started for a step after the run's last."""
        steps = min(self.version + self.r.max_staleness + 1, self.cfg.train.steps) - self.taken
        return max(0, math.ceil(self.r.prompts_per_step * steps * self.r.over_sample))

    async def _produce(self) -> None:
        while not self.closing:
            held = len(self.ready) + len(self.tasks) + self.collecting
            if held < self._capacity() and not self.paused:
                for group in self._draw(self._capacity() - held):
                    self._launch(group).add_done_callback(self._finished)
            self.wake.clear()
            await self.wake.wait()

    def _finished(self, task: asyncio.Task) -> None:
        """Async mode: count a finished group (ready, or dropped with its reason) as it leaves ``tasks``."""
        self.tasks.discard(task)
        if task.cancelled():
            self.dropped["cancelled"] += len(task.group)  # type: ignore[attr-defined]  (only at close)
            return
        if task.exception() is not None:
            self.error = self.error or task.exception()
            self.dropped["error"] += len(task.group)  # type: ignore[attr-defined]
        else:
            group, reason = task.result()
            if reason is not None:
                self._drop(group, reason)
            else:
                self.ready.append(group)
        self.wake.set()
        self.ready_event.set()

    async def _take_async(self, step: int) -> list[list[Sample]]:
        if self.producer is None:
            self.producer = asyncio.ensure_future(self._produce())
        out, self.step_filtered_groups, self.step_stale_groups = [], 0, 0
        self.stale_versions.clear()
        limit = math.ceil(self.r.prompts_per_step * self.r.over_sample * self.r.filter_max_rounds)
        while len(out) < self.r.prompts_per_step:
            if self.error is not None:
                raise self.error
            if self.producer.done():  # it failed: say why
                self.producer.result()
            while self.ready and len(out) < self.r.prompts_per_step:
                group = self.ready.pop(0)
                if max(max(staleness(s, step), default=0) for s in group) > self.r.max_staleness:
                    self._drop(group, "stale")
                    self.step_stale_groups += 1
                    self.stale_versions.update(v for s in group for v in s.weight_versions
                                               if step - 1 - v > self.r.max_staleness)
                    if self.r.stale_groups == "regenerate":  # the same prompts, on the current weights
                        self._launch(group).add_done_callback(self._finished)
                    continue
                out.append(group)
            self.collecting = len(out)
            if self.step_stale_groups > self._capacity() + limit:
                # more than every group held before this step could be: new groups come back stale too
                raise RuntimeError(
                    f"step {step}: {self.step_stale_groups} groups dropped as stale (tokens of weight versions "
                    f"{sorted(self.stale_versions)[:8]}, the trainer is at version {step - 1}, "
                    f"rollout.max_staleness={self.r.max_staleness}): the engines do not serve the new weights, "
                    f"so the step cannot fill ({dict(self.step_dropped)} samples dropped)")
            if len(out) < self.r.prompts_per_step and self.step_filtered_groups >= limit:
                if out:  # as the rounds of sync mode: a short step rather than no step
                    break
                raise RuntimeError(f"step {step}: no group passed the filters in {self.step_filtered_groups} "
                                   f"groups (rollout.filter_max_rounds={self.r.filter_max_rounds}; "
                                   f"{dict(self.step_dropped)} samples dropped)")
            self.wake.set()
            if len(out) < self.r.prompts_per_step:
                self.ready_event.clear()
                if not self.ready and self.error is None:
                    waiting = asyncio.ensure_future(self.ready_event.wait())
                    await asyncio.wait([waiting, self.producer], return_when=asyncio.FIRST_COMPLETED)
                    waiting.cancel()
        self.collecting = 0
        return out

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
            "dropped_fraction": sum(self.step_dropped.values()) / max(len(trained) + sum(self.step_dropped.values()), 1),
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
        parts.append(f"max_staleness {r.max_staleness}, stale groups: {r.stale_groups}")
    if r.mode != "sync":
        parts.append(f"unfinished samples at an update: {r.partial}"
                     + (f" (older tokens: {r.resumed_tokens})" if r.partial == "resume" else ""))
    if r.over_sample > 1 or r.dynamic_sampling:
        parts.append(f"over_sample {r.over_sample}" + (", dynamic sampling" if r.dynamic_sampling else ""))
    how = ", ".join(a.corrections()) or (
        "none" + (" (algo.off_policy_correction='none': tokens of older weights train as if on-policy)"
                  if r.mode != "sync" else ""))
    return "; ".join(parts) + f"; off-policy correction: {how}"
