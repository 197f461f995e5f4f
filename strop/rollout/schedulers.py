"""The three rollout modes (``rollout.mode``), each a small scheduler behind one ``next(step)``: the groups
step ``step`` trains on. They generate through the rollout manager (strop.rollout.manager), which launches,
counts and holds the groups; a scheduler decides when groups start and which a step takes.

- :class:`SyncScheduler` (``sync``): a step's groups are generated, then trained on;
- :class:`OneStepOffScheduler` (``one_step_off``): step k+1's groups are generated while step k trains;
- :class:`AsyncScheduler` (``async``): groups are generated continuously, each step takes the first
  ``prompts_per_step`` that finished, never one staler than ``rollout.max_staleness``.
"""

from __future__ import annotations

import asyncio
import math
from collections import Counter

from strop.engines.base import Versioned
from strop.plugins import call_hook
from strop.types import Sample


def staleness(sample: Sample, step: int) -> list[int]:
    """Per-token staleness of ``sample`` if trained at ``step`` (trainer weights: version step - 1)."""
    return [step - 1 - v for v in sample.weight_versions]


class Rounds:
    """Sync and one_step_off: rounds of over-sampled groups, topped up until the step is full."""

    def __init__(self, manager):
        self.m, self.r = manager, manager.r
        self.prefetch: asyncio.Future | None = None  # one_step_off: the next step's groups

    @property
    def simple(self) -> bool:
        """Today's path: sync, no over-sampling, no dynamic sampling (the rollout hook sees whole steps)."""
        return self.r.mode == "sync" and self.r.over_sample == 1.0 and not self.r.dynamic_sampling

    def background(self) -> list[asyncio.Future | None]:
        """What the scheduler runs between steps (stopped at close)."""
        return [self.prefetch]

    async def prefetched(self) -> list[list[Sample]] | None:
        """For a checkpoint: the next step's groups, generated ahead (None: none)."""
        return await asyncio.shield(self.prefetch) if self.prefetch is not None else None

    def load(self, prefetched: list[list[Sample]]) -> None:
        """A resumed run's next step, generated before its checkpoint."""
        self.prefetch = asyncio.get_running_loop().create_future()
        self.prefetch.set_result(prefetched)
        self.m.round_held = sum(len(g) for g in prefetched)

    def took(self, groups: list[list[Sample]]) -> list[list[Sample]]:
        """The step took ``groups``: a round no longer holds them."""
        if not self.simple:
            self.m.round_held -= sum(len(g) for g in groups)
        return groups

    async def round_robin(self, step: int) -> list[list[Sample]]:
        """``prompts_per_step`` groups: draw ``over_sample`` times what is missing, keep groups that
        pass the filters, top up for at most ``filter_max_rounds`` rounds. Once the step is full,
        sync mode aborts the rest; one_step_off lets them finish (an abort would also stop the
        evaluation that may be running beside them) and drops them as over_sampled."""
        if self.simple:
            return await self._simple_step(step)
        m = self.m
        want, kept = self.r.prompts_per_step, []
        for _ in range(self.r.filter_max_rounds):
            pending = {m.launch(g) for g in m.draw(math.ceil((want - len(kept)) * self.r.over_sample))}
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in sorted(done, key=lambda t: t.order):  # type: ignore[attr-defined]
                    m.tasks.discard(task)
                    group, reason = task.result()  # an engine error stops the step here
                    if reason is not None:
                        m.drop(group, reason)
                    elif len(kept) < want:
                        kept.append(group)
                        m.round_held += len(group)
                    else:
                        m.drop(group, "over_sampled")
                if len(kept) == want and pending and self.r.mode == "sync":  # enough: stop the rest
                    for t in pending:
                        for smp in t.group:  # type: ignore[attr-defined]
                            smp.metadata["leftover"] = True
                    await m.c.engine.abort_all()
            if len(kept) >= want:
                break
        if not kept:
            raise RuntimeError(
                f"step {step}: no group passed the filters in {self.r.filter_max_rounds} rounds "
                f"({dict(m.step_dropped)} samples dropped)"
            )
        return kept

    async def _simple_step(self, step: int) -> list[list[Sample]]:
        """Exactly the path strop always had: the rollout hook on the step's groups (refilled when its
        filter drops some, or a group is dropped for a member that failed past its retries, for at most
        ``filter_max_rounds`` rounds)."""
        m = self.m
        groups = []
        for _ in range(self.r.filter_max_rounds):
            new = m.draw(self.r.prompts_per_step - len(groups))
            m.generated += sum(len(g) for g in new)
            failed_before = (m.ctx.counts["samples_in_failed_groups"], m.ctx.counts["_forks_in_failed_groups"])
            got = await call_hook("rollout", m.c.hooks["rollout"], ctx=m.ctx, groups=new, sampling=m.c.sampling)
            forks = sum(s.metadata.get("segment", 0) > 0 for g in got for s in g)  # agent sessions' extra samples
            m.generated += forks
            m.finished_lengths += [s.response_length for g in got for s in g]
            failed = m.ctx.counts["samples_in_failed_groups"] - failed_before[0]  # (their forks included)
            m.generated += m.ctx.counts["_forks_in_failed_groups"] - failed_before[1]
            filtered = sum(len(g) for g in new) + forks - sum(len(g) for g in got) - failed
            for reason, n in (("failed_group", failed), ("filter", filtered)):
                if n > 0:  # the hook dropped whole groups: a member failed, or its filter said so
                    m.dropped[reason] += n
                    m.step_dropped[reason] += n
            groups += got
            if len(groups) >= self.r.prompts_per_step or (m.ctx.filter is None and not failed):
                break
        return groups


class SyncScheduler(Rounds):
    """``sync``: the step's groups, generated now on the weights the engine was last updated to."""

    async def next(self, step: int) -> list[list[Sample]]:
        groups = self.took(await self.round_robin(step))
        self._check_current(step, groups)
        return groups

    def _check_current(self, step: int, groups: list[list[Sample]]) -> None:
        """Every trained token comes from the weights the engine was last updated to. A token of another
        version means an engine served weights it was never given: stop, never train on it."""
        current = self.m.c.engine.weight_version if isinstance(self.m.c.engine, Versioned) else None
        if current is None:
            return
        seen = Counter(
            v
            for g in groups
            for s in g
            if s.status.trainable
            for v, m in zip(s.weight_versions, s.loss_mask)
            if m and v != current
        )
        if seen:
            raise RuntimeError(
                f"step {step}: {sum(seen.values())} trained tokens were sampled by weight versions "
                f"{sorted(seen)}, but the engine's current version is {current}: an engine served "
                "weights it was not updated to (rollout.mode=sync trains only on current weights)"
            )


class OneStepOffScheduler(Rounds):
    """``one_step_off``: the step's groups were generated while the step before trained; the next step's
    start as this one is taken."""

    async def next(self, step: int) -> list[list[Sample]]:
        if self.prefetch is None:
            self.prefetch = asyncio.ensure_future(self.round_robin(step))
        groups = await self.prefetch
        self.prefetch = asyncio.ensure_future(self.round_robin(step + 1)) if step < self.m.cfg.train.steps else None
        return self.took(groups)


class AsyncScheduler:
    """``async``: groups are generated continuously. A group is started only if a step it can still be
    trained at is free: started on weights of version ``w``, it is trained at step ``w + max_staleness + 1``
    at the latest, so at most ``prompts_per_step`` groups are held (finished or generating) for each step
    from the next one to that one (:meth:`capacity`; AReaL bounds its rollouts the same way). A group with
    a token staler than ``max_staleness`` all the same (it finished late, behind groups started after it)
    is dropped or regenerated (``rollout.stale_groups``)."""

    def __init__(self, manager):
        self.m, self.r = manager, manager.r
        self.producer: asyncio.Task | None = None  # the continuous generation
        self.ready_event = asyncio.Event()
        self.collecting = 0  # groups the step being taken has collected so far
        self.step_stale_groups = 0  # groups dropped as stale while this step waited
        self.stale_versions: Counter = Counter()  # the weight versions of stale tokens, for the error

    def background(self) -> list[asyncio.Future | None]:
        return [self.producer]

    async def prefetched(self) -> None:
        return None

    def load(self, prefetched: list[list[Sample]]) -> None:
        raise RuntimeError(
            "resume: the checkpoint holds the next step's groups of rollout.mode=one_step_off, "
            "which rollout.mode=async has no place for"
        )

    def capacity(self) -> int:
        """Groups the manager may hold (finished, generating, or collected by the step being taken) now:
        ``prompts_per_step`` (times ``over_sample``) for each step a group started on the engine's weights
        can still be trained at, from the first step not yet taken to ``version + max_staleness + 1``.
        After a step is taken and before its update that is one step fewer, so a group started then
        never waits two steps for its turn; and none is started for a step after the run's last."""
        m = self.m
        steps = min(m.version + self.r.max_staleness + 1, m.cfg.train.steps) - m.taken
        return max(0, math.ceil(self.r.prompts_per_step * steps * self.r.over_sample))

    async def _produce(self) -> None:
        m = self.m
        while not m.closing:
            held = len(m.ready) + len(m.tasks) + self.collecting
            if held < self.capacity() and not m.paused:
                for group in m.draw(self.capacity() - held):
                    m.launch(group).add_done_callback(self._finished)
            m.wake.clear()
            await m.wake.wait()

    def _finished(self, task: asyncio.Task) -> None:
        """Count a finished group (ready, or dropped with its reason) as it leaves ``tasks``."""
        m = self.m
        m.tasks.discard(task)
        if task.cancelled():
            m.dropped["cancelled"] += len(task.group)  # type: ignore[attr-defined]  (only at close)
            return
        if task.exception() is not None:
            m.error = m.error or task.exception()
            m.dropped["error"] += len(task.group)  # type: ignore[attr-defined]
        else:
            group, reason = task.result()
            if reason is not None:
                m.drop(group, reason)
            else:
                m.ready.append(group)
        m.wake.set()
        self.ready_event.set()

    def _take_ready(self, step: int, out: list) -> None:
        """Move finished groups into ``out`` until the step is full; drop (or regenerate) stale ones."""
        m = self.m
        while m.ready and len(out) < self.r.prompts_per_step:
            group = m.ready.pop(0)
            if max(max(staleness(s, step), default=0) for s in group) > self.r.max_staleness:
                m.drop(group, "stale")
                self.step_stale_groups += 1
                self.stale_versions.update(
                    v for s in group for v in s.weight_versions if step - 1 - v > self.r.max_staleness
                )
                if self.r.stale_groups == "regenerate":  # the same prompts, on the current weights
                    m.launch(group).add_done_callback(self._finished)
                continue
            out.append(group)

    async def next(self, step: int) -> list[list[Sample]]:
        m = self.m
        if self.producer is None:
            self.producer = asyncio.ensure_future(self._produce())
        out, m.step_filtered_groups, self.step_stale_groups = [], 0, 0
        self.stale_versions.clear()
        limit = math.ceil(self.r.prompts_per_step * self.r.over_sample * self.r.filter_max_rounds)
        while len(out) < self.r.prompts_per_step:
            if m.error is not None:
                raise m.error
            if self.producer.done():  # it failed: say why
                self.producer.result()
            self._take_ready(step, out)
            self.collecting = len(out)
            if self.step_stale_groups > self.capacity() + limit:
                # more than every group held before this step could be: new groups come back stale too
                raise RuntimeError(
                    f"step {step}: {self.step_stale_groups} groups dropped as stale (tokens of weight versions "
                    f"{sorted(self.stale_versions)[:8]}, the trainer is at version {step - 1}, "
                    f"rollout.max_staleness={self.r.max_staleness}): the engines do not serve the new weights, "
                    f"so the step cannot fill ({dict(m.step_dropped)} samples dropped)"
                )
            if len(out) < self.r.prompts_per_step and m.step_filtered_groups >= limit:
                if out:  # as the rounds of sync mode: a short step rather than no step
                    break
                raise RuntimeError(
                    f"step {step}: no group passed the filters in {m.step_filtered_groups} "
                    f"groups (rollout.filter_max_rounds={self.r.filter_max_rounds}; "
                    f"{dict(m.step_dropped)} samples dropped)"
                )
            m.wake.set()
            if len(out) < self.r.prompts_per_step:
                self.ready_event.clear()
                if not m.ready and m.error is None:
                    waiting = asyncio.ensure_future(self.ready_event.wait())
                    await asyncio.wait([waiting, self.producer], return_when=asyncio.FIRST_COMPLETED)
                    waiting.cancel()
        self.collecting = 0
        return out


SCHEDULERS = {"sync": SyncScheduler, "one_step_off": OneStepOffScheduler, "async": AsyncScheduler}
