"""Agent rollouts: each sample is one run of the user's agent program against the proxy.

The generate function (:func:`generate`, installed when ``plugins.agent`` is set) opens a
session for the sample, runs the agent (``agent.workers``: a thread or a spawned process, at
most ``agent.concurrency`` at once) with the proxy's base URL, the session's key and the prompt
row, and waits for it to return, for the session to be closed idle, or for ``agent.timeout_s``.
The session's segments become the samples (:meth:`strop.agents.session.Session.samples`): the
first is the sample itself, the others (forks) travel in ``metadata['extra_samples']`` and join
its group (:func:`strop.rollout.generate.with_segments`).

An agent its session outlived (``agent.timeout_s`` passed, the session closed idle, the step full,
the run stopping) is stopped. In a worker process (:class:`strop.agents.runners.ProcessRunner`) its process group is
killed, the agent and whatever it started, and a new worker serves the next session. A thread
cannot be killed (:class:`strop.agents.runners.ThreadRunner`): the agent is abandoned (its result ignored, its
session's key refused, an async agent cancelled) and counted while it still runs.

Rewards: the session's (posted, or returned by the agent) with ``agent.reward='session'``; a
session without one is FAILED with the status ``no_reward``, never a silent zero. With
``agent.reward='hook'``, ``rollout.reward`` scores the segment of the agent's last call (its
last assistant message) and every segment shares that reward.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable

from strop.agents.proxy import AgentProxy
from strop.agents.runners import ProcessRunner, ThreadRunner
from strop.agents.session import ENDINGS, Session, SessionLimits
from strop.plugins import PluginError, check_result
from strop.rollout.generate import EngineError, _reward_one, fail_sample
from strop.types import SamplingParams, Sample, Status


def prompt_row(sample: Sample, system_prompt: str | None, template: str = "{prompt}") -> dict:
    """What the agent gets: the prompt, as text and as chat messages, the label and the metadata."""
    if isinstance(sample.prompt, list):
        messages = [dict(m) for m in sample.prompt]
    else:
        messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
            {"role": "user", "content": template.format(prompt=sample.prompt)}
        ]
    meta = {k: v for k, v in sample.metadata.items() if isinstance(v, (str, int, float, bool, type(None)))}
    return {"prompt": sample.prompt, "messages": messages, "label": sample.label, "metadata": meta}


class AgentRollout:
    """The run's agent side: the proxy (started on first use, in the run's event loop), the
    workers, and what a session's end makes of its sample."""

    def __init__(self, cfg, engine, tokenizer, agent_fn: Callable, *, context_window: int, stop_token_ids: list[int]):
        a = cfg.agent
        self.cfg, self.a = cfg, a
        limits = SessionLimits(
            max_calls=a.max_calls,
            max_call_tokens=a.max_call_tokens,
            max_response_tokens=cfg.rollout.max_new_tokens,
            context_window=context_window,
        )
        self.proxy = AgentProxy(
            engine,
            tokenizer,
            limits=limits,
            max_calls_in_flight=a.max_calls_in_flight,
            retry_after_s=a.retry_after_s,
            idle_timeout_s=a.idle_timeout_s,
            stop_token_ids=stop_token_ids,
            model_name=cfg.model.path,
            port=a.port,
            cut_after_tool_calls=a.cut_after_tool_calls,
            describe_tools=a.describe_tools,
        )
        self.agent_fn = agent_fn
        self.runner = (
            ProcessRunner(cfg.plugins.agent)
            if a.workers == "processes"
            else ThreadRunner(agent_fn, cfg.plugins.agent, a.concurrency)
        )
        self.slots: asyncio.Semaphore | None = None
        self.starting: asyncio.Lock | None = None

    async def start(self) -> None:
        if self.slots is None:
            self.slots, self.starting = asyncio.Semaphore(self.a.concurrency), asyncio.Lock()
        async with self.starting:
            await self.proxy.start()

    async def close(self) -> None:
        await self.proxy.close()
        self.runner.close()

    def take_counts(self) -> dict:
        """The proxy's counts and the workers' (agents stopped or abandoned) since the last call."""
        return self.proxy.take_counts() | self.runner.take_counts()

    async def run(self, ctx, sample: Sample, sampling: SamplingParams) -> Sample:
        await self.start()
        sample.reset_response()
        row = prompt_row(sample, self.cfg.data.system_prompt, self.cfg.data.prompt_template)
        async with self.slots:  # a session opens when a worker is ready: its idle clock starts with the agent
            worker = await self.runner.ready(self.a.timeout_s)
            session = self.proxy.open(sample, sampling)
            try:
                result, error = await self._run_agent(session, worker, row | {"session_id": session.id})
            finally:
                self.proxy.forget(session)
        if session.engine_error is not None:  # the engine failed, not the sample: the run stops
            raise EngineError(f"agent session {session.id}: {session.engine_error}") from session.engine_error
        return await self._finish(ctx, session, sample, result, error)

    async def _run_agent(self, session: Session, worker, row: dict) -> tuple[Any, BaseException | None]:
        """Run the agent until it returns, its session ends (idle, the step full) or agent.timeout_s
        passes. An agent its session outlived is stopped: its process killed, or its thread abandoned."""
        work = self.runner.submit(worker, self.proxy.base_url, session.key, row)
        ended = asyncio.ensure_future(session.ended.wait())
        timed_out = False
        try:
            done, _ = await asyncio.wait([work, ended], timeout=self.a.timeout_s, return_when=asyncio.FIRST_COMPLETED)
            timed_out = not done
        finally:
            ended.cancel()
            if timed_out:  # its calls are refused from now on
                self.proxy.end(session, "timeout", f"the agent ran past agent.timeout_s={self.a.timeout_s:g}")
                self.proxy.counts["agent_sessions_timed_out"] += 1
            if not work.done():  # (also when this coroutine is cancelled: the run or the step stops)
                stopped = self.runner.abandon(work)
                if timed_out:
                    session.reason += f": {stopped}"
        if work.cancelled():
            return None, None
        try:
            return work.result(), None
        except Exception as exc:  # the agent's own failure: this sample only
            return None, exc

    async def _finish(self, ctx, session: Session, sample: Sample, result: Any, error: BaseException | None) -> Sample:
        self._settle_reward(session, result, error)
        samples = session.samples()
        if not samples:  # no call was made: nothing to train
            sample.metadata.update(
                agent_session=session.id,
                session_state=session.state,
                segments=0,
                session_calls=0,
                session_reason=session.reason,
            )
            if ENDINGS.get(session.state) == Status.ABORTED:  # the proxy's doing (429s, idle, timeout), not the agent's
                sample.status = Status.ABORTED
                return sample
            return fail_sample(
                ctx,
                sample,
                "agent",
                error
                or RuntimeError(
                    f"agent session {session.id} made no model call ({session.state}{': ' + session.reason if session.reason else ''})"
                ),
            )
        if error is not None and session.state == "agent_error":
            for s in samples:
                fail_sample(ctx, s, "agent", error)
        elif session.state == "no_reward":
            for s in samples:
                fail_sample(ctx, s, "reward", RuntimeError(f"agent session {session.id}: {session.reason}"))
        self._finish_texts(ctx, session, samples)
        if error is None and self.a.reward == "hook":
            await self._score(ctx, session, samples)
        first = samples[0]
        # the rollout's sample object carries the first segment; the others join its group
        sample.prompt_ids = first.prompt_ids
        for name in (
            "response_ids",
            "rollout_logprobs",
            "loss_mask",
            "weight_versions",
            "reward",
            "status",
            "response_text",
            "metadata",
        ):
            setattr(sample, name, getattr(first, name))
        sample.check()
        sample.metadata["extra_samples"] = samples[1:]
        sample.metadata["reward_given"] = True
        for s in samples[1:]:
            s.metadata["reward_given"] = True
        return sample

    def _settle_reward(self, session: Session, result: Any, error: BaseException | None) -> None:
        """End ``session`` by what its agent did: gave up on a 429, raised, or returned (its reward, if any,
        agreeing with a posted one); a session that must carry a reward and has none ends ``no_reward``."""
        if error is not None and session.state == "open" and session.last_rejected:
            # it gave up on the proxy's 429: backpressure, not the sample's own failure
            self.proxy.end(
                session, "aborted", f"the agent stopped after the proxy answered 429: {type(error).__name__}: {error}"
            )
            self.proxy.counts["agent_sessions_gave_up_on_429"] += 1
        if error is not None and session.state == "open":
            self.proxy.end(session, "agent_error", f"{type(error).__name__}: {error}")
        if session.state in ("open", "capped") and error is None:
            reward = check_result("agent", self.agent_fn, {"row": None}, result) if result is not None else None
            if reward is not None and session.reward is not None and reward != session.reward:
                raise PluginError(
                    f"agent hook {self.cfg.plugins.agent}: session {session.id} posted reward "
                    f"{session.reward} and the agent returned {reward}: give one"
                )
            if reward is not None:
                session.reward = reward
        if session.reward is None and self.a.reward == "session" and session.state in ("open", "capped"):
            why = (
                f"the session was capped ({session.reason}) and the agent then raised {type(error).__name__}: {error}; "
                if error is not None
                else ""
            )
            self.proxy.end(
                session,
                "no_reward",
                why + "the session ended without a reward (post it to "
                "/v1/sessions/{id}/reward or return it; or set agent.reward='hook')",
            )
            self.proxy.counts["agent_sessions_no_reward"] += 1
        self.proxy.end(session, "completed")

    async def _score(self, ctx, session: Session, samples: list[Sample]) -> None:
        """agent.reward='hook': the reward hook scores the segment of the last call; all share it."""
        last = next(s for seg, s in zip(session.segments, samples) if seg is session.last_segment)
        if not last.status.trainable:
            return
        await _reward_one(ctx, last)
        for s in samples:
            if s.status.trainable:
                s.reward = last.reward if last.status.trainable else None
                if not last.status.trainable:
                    s.status, s.metadata["error"] = Status.FAILED, last.metadata.get("error")

    @staticmethod
    def _finish_texts(ctx, session: Session, samples: list[Sample]) -> None:
        """response_text: the segment's last assistant turn (what a reward reads); transcript: all of it."""
        for seg, s in zip(session.segments, samples):
            if seg.tip.choices:
                s.response_text = ctx.tokenizer.decode(
                    seg.tip.choices[0].completion.token_ids, skip_special_tokens=True
                )
            s.metadata["transcript"] = ctx.tokenizer.decode(s.response_ids, skip_special_tokens=False)


async def generate(ctx, sample: Sample, sampling: SamplingParams) -> Sample:
    """The agent generate function (``plugins.generate``-compatible): needs ``ctx.extra['agent']``."""
    agent: AgentRollout = ctx.extra["agent"]
    return await agent.run(ctx, sample, sampling)
