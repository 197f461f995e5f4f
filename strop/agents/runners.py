"""Where agents run: :class:`ThreadRunner` (daemon threads of this process) and :class:`ProcessRunner`
(spawned worker processes, killed with their process group when a session outlives its agent).

:class:`strop.agents.rollout.AgentRollout` picks one by ``agent.workers``; each has the same
surface: ``ready`` (a slot to start an agent in), ``submit``, ``abandon``, ``take_counts``, ``close``.
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
from typing import Callable

from strop.agents.worker import call_agent as _call_agent, serve_agents
from strop.plugins import PluginError


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
        with _LOCK:  # (before cancelling: a cancelled async agent may end at once, and it was abandoned all the same)
            if call.running:
                self.abandoned.add(call)
                self.counts["agent_threads_abandoned"] += 1
        call.cancel()
        future.cancel()
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
