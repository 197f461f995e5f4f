"""What the hook loader (strop.plugins) and the tool runner (strop.tools) both need, kept below both
so that the arrows between them point one way (plugins checks a tools hook's result with tools)."""

from __future__ import annotations

import inspect
from typing import Callable


class PluginError(ValueError):
    """A plugin does not match its hook's contract (raised at load time or on a bad result)."""


def is_async(fn: Callable) -> bool:
    """An ``async def`` function, or an object whose ``__call__`` is one."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))  # noqa: B004 (the method itself)
