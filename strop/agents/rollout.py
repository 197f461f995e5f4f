"""Agent rollouts: each sample is one run of the user's agent program against the proxy.

The generate function (:func:`generate`, installed when ``plugins.agent`` is set) opens a
session for the sample, runs the agent (``agent.workers``: a thread or a spawned process, at
most ``agent.concurrency`` at once) with the proxy's base URL, the session's key and the prompt
row, and waits for it to return, for the session to be closed idle, or for ``agent.timeout_s``.
The session's segments become the samples (:meth:`strop.agents.session.Session.samples`): the
first is the sample itself, the others (forks) travel in ``metadata['extra_samples']`` and join
its group (:func:`strop.rollout.generate.with_segments`).

Rewards: the session's (posted, or returned by the agent) with ``agent.reward='session'``; a
session without one is FAILED with the status ``no_reward``, never a silent zero. With
``agent.reward='hook'``, ``rollout.reward`` scores the segment of the agent's last call (its
last assistant message) and every segment shares that reward.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import multiprocessing
import threading
from typing import Any, Callable

from strop.agents.proxy import AgentProxy
from strop.agents.session import ENDINGS, Session, SessionLimits
from strop.plugins import PluginError, check_result, import_path
from strop.types import SamplingParams, Sample, Status


def _call_agent(fn: Callable, base_url: str, api_key: str, row: dict) -> Any:
    """In a worker: call the agent, running an async one to completion in this thread."""
    result = fn(base_url=base_url, api_key=api_key, row=row)
    if inspect.isawaitable(result):
        result = asyncio.run(_await(result))
    return result


async def _await(awaitable):
    return await awaitable


def _call_agent_by_path(path: str, base_url: str, api_key: str, row: dict) -> Any:
    """In a worker process: import the agent by its path, then call it."""
    return _call_agent(import_path(path, "agent"), base_url, api_key, row)


class AgentRunner:
    """Runs agent programs in daemon threads (one per session; ``agent.concurrency`` bounds them) or
    in a pool of spawned worker processes. An agent still running when the run ends never holds
    the process open: its thread is a daemon, the worker processes are ended."""

    def __init__(self, fn: Callable, path: str, workers: str, concurrency: int):
        self.fn, self.path = fn, path
        self.processes = workers == "processes"
        self.pool = concurrent.futures.ProcessPoolExecutor(
            concurrency, mp_context=multiprocessing.get_context("spawn")) if self.processes else None

    def submit(self, base_url: str, api_key: str, row: dict) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        if self.processes:
            future = loop.run_in_executor(self.pool, _call_agent_by_path, self.path, base_url, api_key, row)
        else:
            future = loop.create_future()

            def work():
                try:
                    result, error = _call_agent(self.fn, base_url, api_key, row), None
                except BaseException as exc:  # noqa: BLE001 -- handed to the waiting coroutine
                    result, error = None, exc
                try:
                    loop.call_soon_threadsafe(_settle, future, result, error)
                except RuntimeError:  # the run's event loop is gone: nobody waits any more
                    pass

            threading.Thread(target=work, name="strop-agent", daemon=True).start()
        # an agent left behind (idle, timed out, the run stopping) may still fail: nobody waits for it
        future.add_done_callback(lambda f: f.cancelled() or f.exception())
        return future

    def close(self) -> None:
        if self.pool is not None:
            for proc in list(getattr(self.pool, "_processes", {}).values()):  # (agents still running)
                proc.terminate()
            self.pool.shutdown(wait=False, cancel_futures=True)


def _settle(future: asyncio.Future, result, error) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def prompt_row(sample: Sample, system_prompt: str | None, template: str = "{prompt}") -> dict:
    """What the agent gets: the prompt, as text and as chat messages, the label and the metadata."""
    if isinstance(sample.prompt, list):
        messages = [dict(m) for m in sample.prompt]
    else:
        messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
            {"role": "user", "content": template.format(prompt=sample.prompt)}]
    meta = {k: v for k, v in sample.metadata.items() if isinstance(v, (str, int, float, bool, type(None)))}
    return {"prompt": sample.prompt, "messages": messages, "label": sample.label, "metadata": meta}


class AgentRollout:
    """The run's agent side: the proxy (started on first use, in the run's event loop), the
    workers, and what a session's end makes of its sample."""

    def __init__(self, cfg, engine, tokenizer, agent_fn: Callable, *, context_window: int,
                 stop_token_ids: list[int]):
        a = cfg.agent
        self.cfg, self.a = cfg, a
        limits = SessionLimits(max_calls=a.max_calls, max_call_tokens=a.max_call_tokens,
                               max_response_tokens=cfg.rollout.max_new_tokens, context_window=context_window)
        self.proxy = AgentProxy(engine, tokenizer, limits=limits, max_calls_in_flight=a.max_calls_in_flight,
                                retry_after_s=a.retry_after_s, idle_timeout_s=a.idle_timeout_s,
                                stop_token_ids=stop_token_ids, model_name=cfg.model.path, port=a.port,
                                cut_after_tool_calls=a.cut_after_tool_calls, describe_tools=a.describe_tools)
        self.runner = AgentRunner(agent_fn, cfg.plugins.agent, a.workers, a.concurrency)
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

    async def run(self, ctx, sample: Sample, sampling: SamplingParams) -> Sample:
        await self.start()
        sample.reset_response()
        async with self.slots:  # a session opens when a worker is free: its idle clock starts with the agent
            session = self.proxy.open(sample, sampling)
            try:
                result, error = await self._run_agent(session, sample)
            finally:
                self.proxy.forget(session)
        if session.engine_error is not None:  # the engine failed, not the sample: the run stops
            from strop.rollout.generate import EngineError

            raise EngineError(f"agent session {session.id}: {session.engine_error}") from session.engine_error
        return await self._finish(ctx, session, sample, result, error)

    async def _run_agent(self, session: Session, sample: Sample) -> tuple[Any, BaseException | None]:
        """Run the agent until it returns, its session ends (idle) or agent.timeout_s passes."""
        row = prompt_row(sample, self.cfg.data.system_prompt, self.cfg.data.prompt_template) | {"session_id": session.id}
        work = self.runner.submit(self.proxy.base_url, session.key, row)
        ended = asyncio.ensure_future(session.ended.wait())
        try:
            done, _ = await asyncio.wait([work, ended], timeout=self.a.timeout_s,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            ended.cancel()
        if work not in done:  # idle-closed or out of time: the worker is left to notice (its calls get 409)
            work.cancel()
            if not done:
                self.proxy.end(session, "timeout", f"the agent ran past agent.timeout_s={self.a.timeout_s:g}")
                self.proxy.counts["agent_sessions_timed_out"] += 1
            return None, None
        try:
            return work.result(), None
        except Exception as exc:  # the agent's own failure: this sample only
            return None, exc

    async def _finish(self, ctx, session: Session, sample: Sample, result: Any, error: BaseException | None) -> Sample:
        from strop.rollout.generate import fail_sample

        if error is not None and session.state == "open" and session.last_rejected:
            # it gave up on the proxy's 429: backpressure, not the sample's own failure
            self.proxy.end(session, "aborted", f"the agent stopped after the proxy answered 429: "
                           f"{type(error).__name__}: {error}")
            self.proxy.counts["agent_sessions_gave_up_on_429"] += 1
        if error is not None and session.state == "open":
            self.proxy.end(session, "agent_error", f"{type(error).__name__}: {error}")
        if session.state in ("open", "capped") and error is None:
            reward = check_result("agent", self.runner.fn, {"row": None}, result) if result is not None else None
            if reward is not None and session.reward is not None and reward != session.reward:
                raise PluginError(f"agent hook {self.cfg.plugins.agent}: session {session.id} posted reward "
                                  f"{session.reward} and the agent returned {reward}: give one")
            if reward is not None:
                session.reward = reward
        if session.reward is None and self.a.reward == "session" and session.state in ("open", "capped"):
            why = (f"the session was capped ({session.reason}) and the agent then raised {type(error).__name__}: "
                   f"{error}; " if error is not None else "")
            self.proxy.end(session, "no_reward", why + "the session ended without a reward (post it to "
                           "/v1/sessions/{id}/reward or return it; or set agent.reward='hook')")
            self.proxy.counts["agent_sessions_no_reward"] += 1
        self.proxy.end(session, "completed")
        samples = session.samples()
        if not samples:  # no call was made: nothing to train
            sample.metadata.update(agent_session=session.id, session_state=session.state, segments=0,
                                   session_calls=0, session_reason=session.reason)
            if ENDINGS.get(session.state) == Status.ABORTED:  # the proxy's doing (429s, idle, timeout), not the agent's
                sample.status = Status.ABORTED
                return sample
            return fail_sample(ctx, sample, "agent", error or RuntimeError(
                f"agent session {session.id} made no model call ({session.state}{': ' + session.reason if session.reason else ''})"))
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
        for name in ("response_ids", "rollout_logprobs", "loss_mask", "weight_versions", "reward", "status",
                     "response_text", "metadata"):
            setattr(sample, name, getattr(first, name))
        sample.check()
        sample.metadata["extra_samples"] = samples[1:]
        sample.metadata["reward_given"] = True
        for s in samples[1:]:
            s.metadata["reward_given"] = True
        return sample

    async def _score(self, ctx, session: Session, samples: list[Sample]) -> None:
        """agent.reward='hook': the reward hook scores the segment of the last call; all share it."""
        last = next(s for seg, s in zip(session.segments, samples) if seg is session.last_segment)
        if not last.status.trainable:
            return
        from strop.rollout.generate import _reward_one

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
                s.response_text = ctx.tokenizer.decode(seg.tip.choices[0].completion.token_ids, skip_special_tokens=True)
            s.metadata["transcript"] = ctx.tokenizer.decode(s.response_ids, skip_special_tokens=False)


async def generate(ctx, sample: Sample, sampling: SamplingParams) -> Sample:
    """The agent generate function (``plugins.generate``-compatible): needs ``ctx.extra['agent']``."""
    agent: AgentRollout = ctx.extra["agent"]
    return await agent.run(ctx, sample, sampling)


