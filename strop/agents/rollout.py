"""Agent rollouts: each sample is one run of the user's agent program against the proxy.

The generate function (:func:`generate`, installed when ``plugins.agent`` is set) opens a
session for the sample, runs the agent (``agent.workers``: a thread or a spawned process, at
most ``agent.concurrency`` at once) with the proxy's base URL, the session's key and the prompt
row, and waits for it to return, for the session to be closed idle, or for ``agent.timeout_s``.
The session's segments become the samples (:meth:`strop.agents.session.Session.samples`): the
first is the sample itself, the others (forks) travel in ``metadata['extra_samples']`` and join
its group (:func:`strop.rollout.generate.with_segments`).

An agent its session outlived (``agent.timeout_s`` passed, the session closed idle, the step full,
the run stopping) is stopped. In a worker process (:class:`ProcessRunner`) its process group is
killed, the agent and whatever it started, and a new worker serves the next session. A thread
cannot be killed (:class:`ThreadRunner`): the agent is abandoned (its result ignored, its
session's key refused, an async agent cancelled) and counted while it still runs.

Rewards: the session's (posted, or returned by the agent) with ``agent.reward='session'``; a
session without one is FAILED with the status ``no_reward``, never a silent zero. With
``agent.reward='hook'``, ``rollout.reward`` scores the segment of the agent's last call (its
last assistant message) and every segment shares that reward.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import multiprocessing
import os
import signal
import threading
import time
from collections import Counter
from typing import Any, Callable

from strop.agents.proxy import AgentProxy
from strop.agents.session import ENDINGS, Session, SessionLimits
from strop.agents.worker import call_agent as _call_agent, serve_agents
from strop.plugins import PluginError, check_result
from strop.rollout.generate import EngineError, _reward_one, fail_sample
from strop.types import SamplingParams, Sample, Status


class _ThreadCall:
    """One agent run in a thread: whether it still runs, and how to cancel it if it is async."""

    def __init__(self):
        self.running, self.cancelled = True, False
        self.loop = self.task = None

    def started(self, loop, task) -> None:  # (in the agent's thread)
        with _LOCK:
            self.loop, self.task = loop, task
            if self.cancelled:
                task.cancel()

    def cancel(self) -> None:
        with _LOCK:
            self.cancelled = True
            if self.loop is not None:
                with contextlib.suppress(RuntimeError):  # its loop closed: it has ended
                    self.loop.call_soon_threadsafe(self.task.cancel)


_LOCK = threading.Lock()  # a thread call's state, shared by the agent's thread and the run's event loop


class ThreadRunner:
    """Agents in daemon threads of this process, one per session. A thread cannot be stopped: when
    the session ends first (timeout, idle, the step full) the agent is abandoned (its result is
    ignored, its session's key refused, an async agent cancelled) and counted while it still runs.
    Up to ``concurrency`` abandoned threads may run beside the ``concurrency`` live ones; past that a
    new agent waits for one to end, and after ``agent.timeout_s`` of waiting the run stops."""

    def __init__(self, fn: Callable, path: str, concurrency: int):
        self.fn, self.path, self.concurrency = fn, path, concurrency
        self.calls: dict[asyncio.Future, _ThreadCall] = {}
        self.abandoned: set[_ThreadCall] = set()  # still running
        self.counts: Counter = Counter()

    async def ready(self, timeout_s: float) -> None:
        """Return once a new agent may start: no more than ``concurrency`` abandoned threads run."""
        deadline = time.monotonic() + timeout_s
        while self._abandoned_running() > self.concurrency:
            if time.monotonic() > deadline:
                raise PluginError(
                    f"agent hook {self.path}: {self._abandoned_running()} agent threads still run after their "
                    f"sessions ended (agent.timeout_s={timeout_s:g}, or idle), more than agent.concurrency="
                    f"{self.concurrency}, and none ended within agent.timeout_s; a thread cannot be stopped: "
                    "find why the agent hangs, or set agent.workers=processes, where it is killed"
                )
            await asyncio.sleep(0.05)

    def submit(self, worker: None, base_url: str, api_key: str, row: dict) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        future, call = loop.create_future(), _ThreadCall()

        def work():
            try:
                result, error = _call_agent(self.fn, base_url, api_key, row, call.started), None
            except BaseException as exc:  # noqa: BLE001 -- handed to the waiting coroutine
                result, error = None, exc
            finally:
                with _LOCK:
                    call.running = False
                    self.abandoned.discard(call)
            try:
                loop.call_soon_threadsafe(_settle, future, result, error)
            except RuntimeError:  # the run's event loop is gone: nobody waits any more
                pass

        self.calls[future] = call
        future.add_done_callback(lambda f: self.calls.pop(f, None))
        threading.Thread(target=work, name="strop-agent", daemon=True).start()
        return future

    def abandon(self, future: asyncio.Future) -> str:
        """The session ended before the agent returned: leave the thread, cancel an async agent."""
        call = self.calls.pop(future)
        call.cancel()
        future.cancel()
        with _LOCK:
            if call.running:
                self.abandoned.add(call)
                self.counts["agent_threads_abandoned"] += 1
        return "its thread was abandoned (a thread cannot be stopped; an async agent is cancelled)"

    def _abandoned_running(self) -> int:
        with _LOCK:
            return len(self.abandoned)

    def take_counts(self) -> dict:
        """Agents abandoned since the last call, and the abandoned threads still running now."""
        out, self.counts = dict(self.counts), Counter()
        return out | {"agent_threads_abandoned_running": self._abandoned_running()}

    def close(self) -> None:
        for future in list(self.calls):  # (daemon threads: they never hold the process open)
            with contextlib.suppress(RuntimeError):  # (the future's event loop is closed)
                self.abandon(future)


class _Worker:
    """A spawned process (:func:`strop.agents.worker.serve_agents`) that runs agents one at a time."""

    def __init__(self, mp_context, path: str):
        self.conn, theirs = mp_context.Pipe()
        self.process = mp_context.Process(target=serve_agents, args=(path, theirs, os.getpid()), name="strop-agent")
        self.process.start()
        theirs.close()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.gone = False  # its end of the pipe closed: it exited, or is exiting

    @property
    def usable(self) -> bool:
        return not self.gone and self.process.is_alive()

    def reply(self) -> asyncio.Future:
        """The worker's next message: its value, or the error it sent (or its exit)."""
        self.loop = asyncio.get_running_loop()
        future = self.loop.create_future()

        def read():
            self.loop.remove_reader(self.conn.fileno())
            try:
                kind, value = self.conn.recv()
            except EOFError:
                self.gone = True
                kind, value = "error", RuntimeError(f"the agent's worker process {self.process.pid} exited")
            except Exception as exc:  # noqa: BLE001 -- a reply that does not unpickle here
                kind, value = "error", RuntimeError(f"the agent's reply could not be read: {type(exc).__name__}: {exc}")
            _settle(future, value if kind != "error" else None, value if kind == "error" else None)

        self.loop.add_reader(self.conn.fileno(), read)
        return future

    def kill(self) -> None:
        """SIGKILL the worker's process group (the agent and what it started), reaped off the event loop."""
        if self.loop is not None and not self.conn.closed:
            self.loop.remove_reader(self.conn.fileno())
        self.conn.close()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)  # (a group's id is not reused while it has members)
        if self.process.exitcode is None:  # not reaped, so the pid is still its own (and it may have no group yet)
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.process.pid, signal.SIGKILL)
        threading.Thread(target=self.process.join, name="strop-agent-reaper", daemon=True).start()


class ProcessRunner:
    """Agents in spawned worker processes (the hook imported there by its path), each running one
    agent at a time and kept for the next (the caller bounds how many run at once). When
    a session ends before its agent returns (timeout, idle, the step full, the run stopping), the
    worker's process group is killed, so the agent and any process it started are gone, and a new
    worker takes its place when the next agent starts."""

    def __init__(self, path: str):
        self.path = path
        self.mp_context = multiprocessing.get_context("spawn")
        self.idle: list[_Worker] = []
        self.busy: dict[asyncio.Future, _Worker] = {}
        self.counts: Counter = Counter()
        atexit.register(self.close)  # before multiprocessing's own exit hook, which would wait for them

    async def ready(self, timeout_s: float) -> _Worker:
        """A worker that has imported the agent: an idle one, else a new one (given ``timeout_s`` to start)."""
        while self.idle:
            worker = self.idle.pop()
            if worker.usable:
                return worker
            worker.kill()  # (it died while idle: reaped)
        worker = _Worker(self.mp_context, self.path)
        try:
            await asyncio.wait_for(worker.reply(), timeout_s)
        except BaseException as exc:
            worker.kill()
            if isinstance(exc, asyncio.TimeoutError):
                raise TimeoutError(
                    f"agent hook {self.path}: a worker process did not import it within agent.timeout_s={timeout_s:g}"
                ) from None
            raise
        return worker

    def submit(self, worker: _Worker, base_url: str, api_key: str, row: dict) -> asyncio.Future:
        future = worker.reply()
        try:
            worker.conn.send((base_url, api_key, row))
        except OSError as exc:  # it died since it was last seen alive
            worker.kill()
            _settle(future, None, RuntimeError(f"the agent's worker process {worker.process.pid} is gone: {exc}"))
            return future
        self.busy[future] = worker
        future.add_done_callback(self._returned)
        return future

    def _returned(self, future: asyncio.Future) -> None:
        worker = self.busy.pop(future, None)
        if worker is None:  # abandoned: killed already
            return
        if future.cancelled() or not worker.usable:
            worker.kill()
        else:
            self.idle.append(worker)

    def abandon(self, future: asyncio.Future) -> str:
        """The session ended before the agent returned: kill its worker."""
        worker = self.busy.pop(future)
        worker.kill()
        future.cancel()
        self.counts["agent_workers_killed"] += 1
        return f"its worker process {worker.process.pid} was killed, with its process group"

    def take_counts(self) -> dict:
        out, self.counts = dict(self.counts), Counter()
        return out

    def close(self) -> None:
        atexit.unregister(self.close)
        for worker in [*self.idle, *self.busy.values()]:
            worker.kill()
        self.idle, self.busy = [], {}


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
