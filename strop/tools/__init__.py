"""Tools a model may call during a multi-turn rollout: plain functions with a JSON schema.

Built in: ``python`` (runs model-written code in :mod:`strop.tools.sandbox`) and ``calculator``
(arithmetic on numbers, evaluated from the syntax tree; no code runs). Users add their own with the
``plugins.tools`` hook: a function of the ``tools`` config section returning a list of
:class:`Tool` (checked by :func:`check_tools`; docs/plugins.md).

A call is text the model wrote, parsed by :func:`parse_tool_call`: a Hermes/Qwen-style
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` or a fenced ```python block (the
python tool). Anything a tool raises becomes a message back to the model (``Error: ...``):
a tool's failure is an observation, not a failed sample.
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import json
import math
import operator
import re
import threading
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from strop.callables import PluginError, is_async


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict  # JSON schema of the arguments object
    fn: Callable[..., Awaitable[str] | str]  # called with the arguments as keywords; returns text
    timeout_s: float | None = None  # this tool's own wall-clock limit (default: the ToolSet's)

    def schema(self) -> dict:
        """The OpenAI / Hermes function description a chat template takes (``tools=[...]``)."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict
    end: int  # index in the text just past the call (the model's tokens after it are not kept)


HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
FENCED_PYTHON = re.compile(r"```(?:python|py)\s*\n(.*?)```", re.DOTALL)


def parse_tool_call(text: str) -> ToolCall | None:
    """The first complete tool call in ``text``, or None (a final answer). A malformed
    ``<tool_call>`` body is still a call (to the tool ``invalid``), so the model is told."""
    hermes, fenced = HERMES_CALL.search(text), FENCED_PYTHON.search(text)
    first = min((m for m in (hermes, fenced) if m), key=lambda m: m.start(), default=None)
    if first is None:
        return None
    if first is fenced:
        return ToolCall("python", {"code": fenced.group(1)}, fenced.end())
    try:
        name, args = hermes_body(hermes.group(1))
    except HERMES_ERRORS as exc:
        return ToolCall(
            "invalid", {"error": f"could not parse the tool call: {type(exc).__name__}: {exc}"}, hermes.end()
        )
    return ToolCall(name, args, hermes.end())


HERMES_ERRORS = (ValueError, KeyError, TypeError, RecursionError)  # RecursionError: JSON nested too deep


def hermes_body(body: str) -> tuple[str, dict]:
    """The (name, arguments) of a ``<tool_call>`` body; one of HERMES_ERRORS if it is not one."""
    call = json.loads(body)
    name, args = call["name"], call.get("arguments", {})
    if isinstance(args, str):
        args = json.loads(args)
    if not isinstance(name, str) or not isinstance(args, dict):
        raise TypeError("name must be a string and arguments an object")
    return name, args


# ---- calculator --------------------------------------------------------------------------------
_MAX_BITS = 10_000  # the largest integer (about 3,000 digits) any step may produce, so every step is fast


def _too_large(what: str) -> ValueError:
    return ValueError(
        f"result too large: {what} would exceed {_MAX_BITS} bits (about {int(_MAX_BITS * math.log10(2))} digits)"
    )


def _check_size(value: Any) -> Any:
    if isinstance(value, int) and value.bit_length() > _MAX_BITS:
        raise _too_large("a step")
    return value


def _power(base: Any, exponent: Any) -> Any:
    """``base ** exponent``, refused before computing when the integer result would be too large
    (``bits ≈ exponent × log2|base|``); float and complex powers take constant time."""
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0 and abs(base) > 1:
        if exponent * math.log2(abs(base)) > _MAX_BITS:
            raise _too_large(f"a power ({abs(base).bit_length()}-bit base, exponent {exponent})")
    return base**exponent


def _round(x: Any, ndigits: Any = None) -> Any:
    """``round`` with ``ndigits`` bounded: rounding an integer to -n digits computes 10**n."""
    if isinstance(ndigits, int) and abs(ndigits) * math.log2(10) > _MAX_BITS:
        raise _too_large(f"rounding to {ndigits} digits")
    return round(x) if ndigits is None else round(x, ndigits)


_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: _power,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCS = {
    "sqrt": math.sqrt,
    "abs": abs,
    "round": _round,
    "floor": math.floor,
    "ceil": math.ceil,
    "log": math.log,
    "exp": math.exp,
    "sin": math.sin,
    "cos": math.cos,
    "tan": math.tan,
}
_CONSTS = {"pi": math.pi, "e": math.e}


def _eval(node: ast.AST) -> float | int:
    """Every step's operands are at most ``_MAX_BITS`` bits, so + - * / // % take microseconds
    and only ``**`` and ``round`` need a check before they run; every result is checked after."""
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return _check_size(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        return _check_size(_BINARY[type(node.op)](_eval(node.left), _eval(node.right)))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.Name) and node.id in _CONSTS:
        return _CONSTS[node.id]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCS and not node.keywords:
        return _check_size(_FUNCS[node.func.id](*[_eval(a) for a in node.args]))
    raise ValueError(f"unsupported expression: {ast.dump(node)[:80]}")


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression (numbers, + - * / // % **, sqrt, log, ...; no names).
    Integers are exact up to ``_MAX_BITS`` bits; a step past it is refused (a power or a rounding,
    the only steps that can take long, before it runs), so no input holds the interpreter (and the
    event loop, which waits for the GIL) for long."""
    if len(expression) > 500:
        raise ValueError("expression longer than 500 characters")
    value = _eval(ast.parse(expression, mode="eval"))
    return str(int(value) if isinstance(value, float) and value.is_integer() and abs(value) < 1e15 else value)


CALCULATOR = Tool(
    "calculator",
    "Evaluate an arithmetic expression and return the number.",
    {
        "type": "object",
        "properties": {"expression": {"type": "string", "description": "e.g. (17 + 5) * 3 / 2"}},
        "required": ["expression"],
    },
    calculate,
)


def python_tool(sandbox) -> Tool:
    """The python tool over ``sandbox`` (a :class:`strop.tools.sandbox.Sandbox`): runs the code,
    returns what it printed, with markers for errors, truncation and timeouts."""

    async def run(code: str) -> str:
        result = await sandbox.run_python(code)
        return result.message() or "(no output)"

    return Tool(
        "python",
        "Run Python code in a sandbox and return what it prints (stdout and stderr).",
        {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
        run,
        timeout_s=sandbox.limits.timeout_s + 30,
    )  # the sandbox's own limit kills the code first


class ToolSet:
    """The tools of a run by name; :meth:`call` turns every failure into a message for the model.

    Sync tool functions run in threads of their own (at most ``threads`` at once), never in the
    event loop and never in the default executor that the engine's work goes through, so slow
    or hung tools cannot queue generation. Every call has a wall-clock limit (``timeout_s``, or
    the tool's own); past it the model reads a timeout error. A hung sync function cannot be
    killed: its thread (a daemon) keeps its slot until it returns."""

    def __init__(
        self, tools: list[Tool], origin: dict[str, str] | None = None, *, threads: int = 8, timeout_s: float = 10.0
    ):
        self.origin = origin or {}  # tool name -> where it came from ("tools hook pkg:fn"), for errors
        names = [t.name for t in tools]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"tool names must be unique: {sorted(dup)} occur twice")
        self.tools = {t.name: t for t in tools}
        self.threads, self.timeout_s = threads, timeout_s
        self._slots: asyncio.Semaphore | None = None  # made in the running loop

    def schemas(self) -> list[dict]:
        return [t.schema() for t in self.tools.values()]

    async def _in_thread(self, fn: Callable, kwargs: dict) -> Any:
        """``fn(**kwargs)`` in a daemon thread; the slot is given back when the thread ends."""
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.threads)
        loop = asyncio.get_running_loop()
        await self._slots.acquire()
        done: asyncio.Future = loop.create_future()

        def settle(result, error):
            self._slots.release()
            if not done.done():  # the caller may have stopped waiting (timeout)
                done.set_exception(error) if error is not None else done.set_result(result)

        def work():
            try:
                result, error = fn(**kwargs), None
            except BaseException as exc:  # handed to the awaiting coroutine, which decides
                result, error = None, exc
            try:
                loop.call_soon_threadsafe(settle, result, error)
            except RuntimeError:  # the loop is closed: the run ended while this tool hung
                pass

        threading.Thread(target=work, name=f"strop-tool-{getattr(fn, '__name__', 'fn')}", daemon=True).start()
        return await done

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
            return (
                f"Error: tool {call.name!r} takes {sorted(tool.parameters.get('properties', {}))}"
                + (f"; missing {missing}" if missing else "")
                + (f"; unknown {unknown}" if unknown else "")
            ), False
        limit = tool.timeout_s or self.timeout_s
        try:
            if is_async(tool.fn):
                out = await asyncio.wait_for(tool.fn(**call.arguments), limit)
            else:
                out = await asyncio.wait_for(self._in_thread(tool.fn, call.arguments), limit)
                if inspect.isawaitable(out):
                    out = await asyncio.wait_for(out, limit)
        except asyncio.TimeoutError:
            return f"Error: tool {call.name!r} gave no result within {limit:g} s", False
        except Exception as exc:  # the tool's own failure is an observation for the model
            return f"Error: {type(exc).__name__}: {exc}", False
        if not isinstance(out, str):  # a bug in the tool, not the model's doing: stop loudly
            where = f"{self.origin[call.name]}: " if call.name in self.origin else ""
            raise PluginError(
                f"{where}tool {call.name!r} returned {type(out).__name__} ({out!r:.60}); a tool returns text"
            )
        return out, True


def describe_tools(system_prompt: str | None, tools: ToolSet) -> str:
    """``system_prompt`` followed by the tools' schemas and how to call them (the Hermes / Qwen
    convention: one JSON schema per line inside ``<tools>``, calls in ``<tool_call>``)."""
    lines = "\n".join(json.dumps(schema) for schema in tools.schemas())
    block = (
        "You may call tools. The available tools, as JSON schemas:\n<tools>\n" + lines + "\n</tools>\n"
        'To call one, write <tool_call>{"name": <tool name>, "arguments": <arguments object>}</tool_call> and '
        "stop; its output comes back inside <tool_response></tool_response>."
    )
    return f"{system_prompt}\n\n{block}" if system_prompt else block


_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_-]{0,63}")


def check_tools(tools: Any) -> None:
    """Raise TypeError / ValueError, naming the tool, unless ``tools`` is a non-empty list of
    :class:`Tool` with unique names, object schemas, and functions that take their arguments."""
    if not isinstance(tools, (list, tuple)):
        raise TypeError(f"returned {type(tools).__name__}; expected a list of strop.tools.Tool")
    if not tools:
        raise ValueError("returned no tools")
    names = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, Tool):
            raise TypeError(f"item {i} is a {type(tool).__name__}, not a strop.tools.Tool")
        where = f"tool {i} ({tool.name!r})"
        if not isinstance(tool.name, str) or not _NAME.fullmatch(tool.name) or tool.name == "invalid":
            raise ValueError(
                f"{where}: a name must be 1-64 letters, digits, '_' or '-', starting with a letter "
                "or '_' (and not 'invalid', which strop uses for unparsable calls)"
            )
        if not isinstance(tool.description, str) or not tool.description.strip():
            raise ValueError(f"{where}: the description is empty; the model reads it to know what the tool does")
        names.append(tool.name)
        p = tool.parameters
        props = p.get("properties", {}) if isinstance(p, dict) else None
        schema_shape = "({'type': 'object', 'properties': {name: {'type': ...}}, 'required': [names]})"
        if not isinstance(p, dict) or p.get("type") != "object" or not isinstance(props, dict):
            raise ValueError(
                f"{where}: parameters must be a JSON schema of an object {schema_shape}, got " + repr(p)[:120]
            )
        bad = [k for k, v in props.items() if not isinstance(v, dict)]
        if bad:
            raise ValueError(f"{where}: properties {bad} must each be a schema object like {{'type': 'string'}}")
        required = p.get("required", [])
        if not isinstance(required, list) or not all(isinstance(k, str) for k in required):
            raise ValueError(f"{where}: 'required' must be a list of property names, got {required!r:.80}")
        extra = [k for k in required if k not in props]
        if extra:
            raise ValueError(f"{where}: required {extra} not among its properties {sorted(props)}")
        if not callable(tool.fn):
            raise TypeError(f"{where}: fn is a {type(tool.fn).__name__}, not a function")
        try:
            sig = inspect.signature(tool.fn)
        except (TypeError, ValueError):
            continue  # a builtin without a readable signature: it is called and its errors shown
        params = sig.parameters
        any_kw = any(q.kind == q.VAR_KEYWORD for q in params.values())
        by_name = {n for n, q in params.items() if q.kind in (q.POSITIONAL_OR_KEYWORD, q.KEYWORD_ONLY)}
        missing = [k for k in props if k not in by_name and not any_kw]
        needs = [
            n
            for n, q in params.items()
            if q.default is q.empty and n not in props and q.kind not in (q.VAR_POSITIONAL, q.VAR_KEYWORD)
        ]
        if missing or needs:
            raise ValueError(
                f"{where}: its function {getattr(tool.fn, '__name__', tool.fn)}{sig} "
                + (
                    f"does not take the schema's properties {missing} by keyword"
                    if missing
                    else f"requires {needs}, which the schema does not give"
                )
            )
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"tool names must be unique: {dup} occur twice")
