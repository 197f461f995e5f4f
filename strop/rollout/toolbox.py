"""The tools a multi-turn rollout offers, built from the run's tools settings and its ``tools`` hook (strop.setup
assembles them before any model loads): the python tool's sandbox, the calculator, the hook's own tools, and the
turn limits, as the RolloutContext's extra."""

from __future__ import annotations

import logging
from typing import Callable

from strop.config import Config
from strop.plugins import PluginError, call_hook_sync
from strop.rollout.multiturn import TurnLimits
from strop.tools import CALCULATOR, ToolSet, python_tool
from strop.tools.sandbox import Limits, Sandbox

log = logging.getLogger(__name__)


def make_tools(cfg: Config, hook: Callable | None = None) -> dict:
    """The tools of ``tools.enabled`` (the python tool's sandbox chosen now: refused here when
    there is no isolation and it was not turned off by name), the ``plugins.tools`` hook's
    tools, and the turn limits."""
    t = cfg.tools
    tools = []
    if "python" in t.enabled:
        box = Sandbox(
            Limits(
                timeout_s=t.timeout_s,
                cpu_s=t.cpu_s,
                memory_mb=t.memory_mb,
                processes=t.processes,
                memory_total_mb=t.memory_total_mb,
                tmp_mb=t.tmp_mb,
                tmp_files=t.tmp_files,
            ),
            isolation=t.sandbox,
            max_concurrency=t.concurrency,
            nested_userns=t.nested_userns,
        )
        log.info(f"strop: tools: python in {box.describe()}")
        tools.append(python_tool(box))
    if "calculator" in t.enabled:
        tools.append(CALCULATOR)
    origin = {}  # tool name -> where it came from, for errors
    if hook is not None:
        own = call_hook_sync("tools", hook, config=t)
        origin = {x.name: f"tools hook {cfg.plugins.tools}" for x in own}
        clash = sorted({x.name for x in own} & {x.name for x in tools})
        if clash:
            raise PluginError(
                f"tools hook {cfg.plugins.tools!r} gives tool(s) {clash}, which tools.enabled "
                f"({t.enabled}) already has: rename yours or drop the built-in"
            )
        tools += own
        log.info(f"strop: tools: {', '.join(x.name for x in own)} from {cfg.plugins.tools}")
    return {
        "tools": ToolSet(tools, origin, threads=t.tool_threads, timeout_s=t.timeout_s),
        "call_reward": (t.call_reward, t.max_call_reward),
        "turn_limits": TurnLimits(
            max_turns=t.max_turns,
            max_turn_tokens=t.max_turn_tokens,
            output_chars=t.output_chars,
            output_tokens=t.output_tokens,
        ),
    }
