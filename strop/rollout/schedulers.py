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
import logging
import math
import time
from collections import Counter

from strop.engines.base import Versioned
from strop.plugins import call_hook
from strop.types import Sample

log = logging.getLogger(__name__)


def staleness(sample: Sample, step: int) -> list[int]:
    """Per-token staleness of ``sample`` if trained at ``step`` (trainer weights: version step - 1)."""
    return [step - 1 - v for v in sample.weight_versions]


class Rounds:
    """Sync and one_step_off: rounds of over-sampled groups, topped up until the step is full."""

    def __init__(self, manager):
        self.m, self.r = manager, manager.r
        self.prefetch: asyncio.Future | None = None  # one_step_off: the next step's groups
        self.kept: list[list[Sample]] = []  # the groups the round being generated has kept so far

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

    def take_diagnostics(self) -> dict:
        """Pacing diagnostics of the step just taken (sync: none, nothing generates between steps)."""
        return {}

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
        self.kept = kept  # (what one_step_off's diagnostics count as finished and waiting)
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

    def __init__(self, manager):
        super().__init__(manager)
        self.prefetched_at: float | None = None  # when the next step's groups were all ready
        self.diagnostics: dict = {}

    async def next(self, step: int) -> list[list[Sample]]:
        if self.prefetch is None:
            self._start(step)
        done = self.prefetch.done()
        self.diagnostics = {  # when the trainer asks: groups finished and waiting, generating, and their bound
            "rollout_queue_groups": len(self.prefetch.result()) if done else len(self.kept),
            "rollout_inflight_groups": len(self.m.tasks),
            "rollout_max_inflight": math.ceil(self.r.prompts_per_step * self.r.over_sample),
        }
        groups = await self.prefetch
        blocked = time.perf_counter() - self.prefetched_at if done and self.prefetched_at is not None else 0.0
        self.diagnostics["rollout_backpressure_seconds"] = blocked
        if step < self.m.cfg.train.steps:
            self._start(step + 1)
        else:
            self.prefetch = None
        return self.took(groups)

    def _start(self, step: int) -> None:
        self.prefetched_at = None
        self.prefetch = asyncio.ensure_future(self.round_robin(step))
        self.prefetch.add_done_callback(lambda _f: setattr(self, "prefetched_at", time.perf_counter()))

    def take_diagnostics(self) -> dict:
        out, self.diagnostics = self.diagnostics, {}
        return out


class AsyncScheduler:
    """``async``: groups are generated continuously. A group is started only if a step it can still be
    trained at is free: started on weights of version ``w``, it is trained at step ``w + max_staleness + 1``
    at the latest (its *deadline*), so at most ``prompts_per_step`` groups are held (finished or generating)
    for each step from the next one to that one (:meth:`capacity`; AReaL bounds its rollouts the same way).

    ``stale_groups='wait'`` (pacing, the default): a step takes ready groups earliest deadline first and
    keeps a place for each group whose deadline it is that is still generating, waiting for it; under the
    bound above no group then turns stale, so none is dropped for it. ``drop`` / ``regenerate``: a step
    takes groups in finishing order, and a group with a token staler than ``max_staleness`` (it finished
    late, behind groups started after it) is dropped or regenerated."""

    def __init__(self, manager):
        self.m, self.r = manager, manager.r
        self.producer: asyncio.Task | None = None  # the continuous generation
        self.ready_event = asyncio.Event()
        self.collecting = 0  # groups the step being taken has collected so far
        self.step_stale_groups = 0  # groups dropped as stale while this step waited
        self.stale_versions: Counter = Counter()  # the weight versions of stale tokens, for the error
        self.blocked_since: float | None = None  # generation held back by the bound since (perf_counter)
        self.blocked = 0.0  # seconds generation was held back by the bound since the last step's take
        self.diagnostics: dict = {}

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

    def deadline(self, group: list[Sample]) -> float:
        """The last step ``group`` can train at: its oldest token's version + max_staleness + 1."""
        versions = [v for s in group for v in s.weight_versions]
        return min(versions) + self.r.max_staleness + 1 if versions else math.inf

    def due_generating(self, step: int) -> list[asyncio.Task]:
        """``wait``: the groups still generating whose deadline is ``step`` (started on weights
        ``step - max_staleness - 1``): the step keeps a place for each."""
        if self.r.stale_groups != "wait":
            return []
        return [t for t in self.m.tasks if t.version + self.r.max_staleness + 1 == step]  # type: ignore[attr-defined]

    async def _produce(self) -> None:
        m = self.m
        while not m.closing:
            held, room = len(m.ready) + len(m.tasks) + self.collecting, self.capacity()
            if held < room and not m.paused:
                for group in m.draw(room - held):
                    m.launch(group).add_done_callback(self._finished)
                self._blocked(False)
            elif not m.paused and m.version + self.r.max_staleness + 1 <= m.cfg.train.steps:
                # nothing generating, held back by the staleness bound (not by the run's end or a checkpoint)
                self._blocked(not m.tasks)
            m.wake.clear()
            await m.wake.wait()

    def _blocked(self, now_blocked: bool) -> None:
        """Generation is (or is no longer) idle, held back by the bound: ``rollout_backpressure_seconds``."""
        if now_blocked and self.blocked_since is None:
            self.blocked_since = time.perf_counter()
        elif not now_blocked and self.blocked_since is not None:
            self.blocked += time.perf_counter() - self.blocked_since
            self.blocked_since = None

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
        """Move finished groups into ``out`` until the step is full (``wait``: earliest deadline first,
        leaving the places of due groups still generating); drop (or regenerate) stale ones."""
        m, wait = self.m, self.r.stale_groups == "wait"
        if wait:
            m.ready.sort(key=self.deadline)  # (stable: in finishing order among equal deadlines)
        due = len(self.due_generating(step))
        while m.ready and len(out) < self.r.prompts_per_step:
            if wait and self.deadline(m.ready[0]) > step and len(out) + due >= self.r.prompts_per_step:
                break  # the places left are those of the groups due now, still generating
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

    def take_diagnostics(self) -> dict:
        out, self.diagnostics = self.diagnostics, {}
        return out

    async def next(self, step: int) -> list[list[Sample]]:
        m = self.m
        if self.producer is None:
            self.producer = asyncio.ensure_future(self._produce())
        self.diagnostics = {  # when the trainer asks: groups finished and waiting, generating, and their bound
            "rollout_queue_groups": len(m.ready),
            "rollout_inflight_groups": len(m.tasks),
            "rollout_max_inflight": self.capacity(),
        }
        out, m.step_filtered_groups, self.step_stale_groups = [], 0, 0
        self.stale_versions.clear()
        straggling: float | None = None  # since when the step waits only on due groups still generating
        straggled, warned = 0.0, False
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
                due = self.due_generating(step)
                if due and len(out) + len(m.ready) + len(due) >= self.r.prompts_per_step:
                    straggling = straggling if straggling is not None else time.perf_counter()
                elif straggling is not None:
                    straggled, straggling = straggled + time.perf_counter() - straggling, None
                self.ready_event.clear()
                if m.error is None:
                    waiting = asyncio.ensure_future(self.ready_event.wait())
                    timeout = None
                    if straggling is not None and not warned:
                        timeout = max(0.0, straggling + self.r.straggler_warning_seconds - time.perf_counter())
                    await asyncio.wait([waiting, self.producer], timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
                    waiting.cancel()
                    if straggling is not None and not warned and not self.ready_event.is_set():
                        warned = self._warn_straggler(step, len(out), straggling)
        self.collecting = 0
        now = time.perf_counter()
        if self.blocked_since is not None:  # (the time so far counts for this step)
            self.blocked, self.blocked_since = self.blocked + now - self.blocked_since, now
        self.diagnostics["rollout_backpressure_seconds"], self.blocked = self.blocked, 0.0
        self.diagnostics["rollout_straggler_wait_seconds"] = straggled + (now - straggling if straggling else 0.0)
        return out

    def _warn_straggler(self, step: int, ready: int, since: float) -> bool:
        due = self.due_generating(step)
        if not due or time.perf_counter() - since < self.r.straggler_warning_seconds:
            return False
        oldest = min(t.started for t in due)  # type: ignore[attr-defined]
        log.warning(
            f"strop: step {step} has waited {time.perf_counter() - since:.0f}s on {len(due)} group(s) still "
            f"generating that it is the last step able to train (started on weights {due[0].version}, "  # type: ignore[attr-defined]
            f"{time.perf_counter() - oldest:.0f}s ago); its other {ready} groups are ready "
            f"(rollout.straggler_warning_seconds={self.r.straggler_warning_seconds:g}; stale_groups='drop' "
            "trains without them, dropping them)"
        )
        return True


SCHEDULERS = {"sync": SyncScheduler, "one_step_off": OneStepOffScheduler, "async": AsyncScheduler}
