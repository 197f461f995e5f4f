"""Tools a model may call during a multi-turn rollout: plain functions with a JSON schema.

Built in: ``python`` (runs model-written code in :mod:`strop.tools.sandbox`) and ``calculator``
(arithmetic on numbers, evaluated from the syntax tree; no code runs). Users add their own as a
``plugins.tools`` hook: a module-level list of :class:`Tool`.

A call is text the model wrote, parsed by :func:`parse_tool_call`: a Hermes/Qwen-style
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` or a fenced ```python block (the
python tool). Anything a tool raises becomes a message back to the model (``Error: ...``):
a tool's failure is an observation, not a failed sample.
"""

from __future__ import annotations

import ast
import json
import math
import operator
import re
from dataclasses import dataclass
from typing import Any, Awaitable, Callable


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict  # JSON schema of the arguments object
    fn: Callable[..., Awaitable[str] | str]  # called with the arguments as keywords; returns text

    def schema(self) -> dict:
        """The OpenAI / Hermes function description a chat template takes (``tools=[...]``)."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict
    end: int  # index in the text just past the call (the model's tokens after it are not kept)


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_FENCED = re.compile(r"```(?:python|py)\s*\n(.*?)```", re.DOTALL)


def parse_tool_call(text: str) -> ToolCall | None:
    """The first complete tool call in ``text``, or None (a final answer). A malformed
    ``<tool_call>`` body is still a call (to the tool ``invalid``), so the model is told."""
    hermes, fenced = _HERMES.search(text), _FENCED.search(text)
    first = min((m for m in (hermes, fenced) if m), key=lambda m: m.start(), default=None)
    if first is None:
        return None
    if first is fenced:
        return ToolCall("python", {"code": fenced.group(1)}, fenced.end())
    try:
        body = json.loads(hermes.group(1))
        name, args = body["name"], body.get("arguments", {})
        if isinstance(args, str):
            args = json.loads(args)
        if not isinstance(name, str) or not isinstance(args, dict):
            raise TypeError("name must be a string and arguments an object")
    except (ValueError, KeyError, TypeError) as exc:
        return ToolCall("invalid", {"error": f"could not parse the tool call: {type(exc).__name__}: {exc}"},
                        hermes.end())
    return ToolCall(name, args, hermes.end())


# ---- calculator --------------------------------------------------------------------------------
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCS = {"sqrt": math.sqrt, "abs": abs, "round": round, "floor": math.floor, "ceil": math.ceil, "log": math.log,
          "exp": math.exp, "sin": math.sin, "cos": math.cos, "tan": math.tan}
_CONSTS = {"pi": math.pi, "e": math.e}


def _eval(node: ast.AST) -> float | int:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 1000:
            raise ValueError("exponent too large")
        return _BINARY[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.Name) and node.id in _CONSTS:
        return _CONSTS[node.id]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCS and not node.keywords:
        return _FUNCS[node.func.id](*[_eval(a) for a in node.args])
    raise ValueError(f"unsupported expression: {ast.dump(node)[:80]}")


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression (numbers, + - * / // % **, sqrt, log, ...; no names)."""
    if len(expression) > 500:
        raise ValueError("expression longer than 500 characters")
    value = _eval(ast.parse(expression, mode="eval"))
    return str(int(value) if isinstance(value, float) and value.is_integer() and abs(value) < 1e15 else value)


CALCULATOR = Tool("calculator", "Evaluate an arithmetic expression and return the number.",
                  {"type": "object", "properties": {"expression": {"type": "string", "description":
                   "e.g. (17 + 5) * 3 / 2"}}, "required": ["expression"]}, calculate)


def python_tool(sandbox) -> Tool:
    """The python tool over ``sandbox`` (a :class:`strop.tools.sandbox.Sandbox`): runs the code,
    returns what it printed, with markers for errors, truncation and timeouts."""

    async def run(code: str) -> str:
        result = await sandbox.run_python(code)
        return result.message() or "(no output)"

    return Tool("python", "Run Python code in a sandbox and return what it prints (stdout and stderr).",
                {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}, run)


class ToolSet:
    """The tools of a run by name; :meth:`call` turns every failure into a message for the model."""

    def __init__(self, tools: list[Tool]):
        names = [t.name for t in tools]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"tool names must be unique: {sorted(dup)} occur twice")
        self.tools = {t.name: t for t in tools}

    def schemas(self) -> list[dict]:
        return [t.schema() for t in self.tools.values()]

    async def call(self, call: ToolCall) -> tuple[str, bool]:
        """Run ``call``: (text for the model, whether the tool succeeded)."""
        if call.name == "invalid":
            return f"Error: {call.arguments['error']}", False
        tool = self.tools.get(call.name)
        if tool is None:
            return f"Error: unknown tool {call.name!r}; available: {', '.join(sorted(self.tools))}", False
        required = tool.parameters.get("required", [])
        missing = [k for k in required if k not in call.arguments]
        unknown = [k for k in call.arguments if k not in tool.parameters.get("properties", {})]
        if missing or unknown:
            return (f"Error: tool {call.name!r} takes {sorted(tool.parameters.get('properties', {}))}"
                    + (f"; missing {missing}" if missing else "") + (f"; unknown {unknown}" if unknown else "")), False
        try:
            out = tool.fn(**call.arguments)
            if hasattr(out, "__await__"):
                out = await out
            return str(out), True
        except Exception as exc:  # the tool's own failure is an observation for the model
            return f"Error: {type(exc).__name__}: {exc}", False


def as_tools(value: Any) -> list[Tool]:
    """A ``plugins.tools`` hook's value: a Tool, a list of Tools, or a function returning either."""
    if callable(value) and not isinstance(value, Tool):
        value = value()
    items = [value] if isinstance(value, Tool) else list(value)
    bad = [type(x).__name__ for x in items if not isinstance(x, Tool)]
    if bad:
        raise TypeError(f"a tools hook must give strop.tools.Tool objects, got {bad}")
    return items
