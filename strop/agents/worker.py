"""Where an agent program runs: :func:`call_agent` in a worker thread, :func:`serve_agents` in a
worker process (``agent.workers=processes``).

This module imports nothing heavy (no torch, no web server): a worker process spawned for agents
starts in the time its agent's own imports take.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import os
import pickle
from typing import Any, Callable

from strop.process import die_with_parent


def call_agent(fn: Callable, base_url: str, api_key: str, row: dict, started: Callable | None = None) -> Any:
    """Call the agent, running an async one to completion in this thread. ``started(loop, task)``
    is told where an async agent runs, so that it can be cancelled from another thread."""
    result = fn(base_url=base_url, api_key=api_key, row=row)
    if inspect.isawaitable(result):
        result = asyncio.run(_await(result, started))
    return result


async def _await(awaitable, started: Callable | None = None):
    if started is not None:
        started(asyncio.get_running_loop(), asyncio.current_task())
    return await awaitable


def serve_agents(path: str, conn, parent: int) -> None:
    """A worker process: import the agent (``module:function``, checked by the run at start-up),
    say so, then run one call at a time until the pipe closes."""
    os.setsid()  # a process group of its own: a stopped agent is killed with what it started
    die_with_parent(parent)
    try:
        module, sep, attr = path.partition(":")
        if not sep:
            module, _, attr = path.rpartition(".")
        fn = getattr(importlib.import_module(module), attr)
    except BaseException as exc:  # noqa: BLE001 -- the run says why
        conn.send(("error", _sendable(exc)))
        return
    conn.send(("ready", None))
    while True:
        try:
            base_url, api_key, row = conn.recv()
        except EOFError:
            return
        try:
            reply = ("ok", call_agent(fn, base_url, api_key, row))
            pickle.dumps(reply)
        except BaseException as exc:  # noqa: BLE001 -- the agent's failure goes back to its sample
            reply = ("error", _sendable(exc))
        conn.send(reply)


def _sendable(exc: BaseException) -> Exception:
    """``exc``, or its name and message when it does not survive pickling (many exceptions with
    required arguments do not) or is no ``Exception`` (an agent's ``sys.exit`` fails its sample,
    not the run)."""
    try:
        if isinstance(exc, Exception):
            pickle.loads(pickle.dumps(exc))
            return exc
    except Exception:  # noqa: BLE001
        pass
    return RuntimeError(f"{type(exc).__name__}: {exc}")
