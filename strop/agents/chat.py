"""OpenAI chat messages to tokens and back, for the agent proxy.

Three jobs, each pure (a tokenizer in, text or ids out):

- :func:`check_messages` / :func:`check_tools_schema`: the caller's input, checked, every
  failure a :class:`ChatInputError` naming the message and field;
- :class:`ChatRenderer`: messages (and tools) to prompt text with the model's chat template.
  Templates that know tools (Qwen, Llama 3.1, SmolLM3: their source mentions ``tools``) get
  them as they are; the others (SmolLM2's ChatML) get strop's own framing, the same as
  strop's multi-turn rollout: the tools' schemas in the system prompt, calls as
  ``<tool_call>{json}</tool_call>`` in the assistant's text, tool results as a user turn inside
  ``<tool_response>``;
- :func:`parse_reply`: the model's text to an assistant message, its ``<tool_call>`` blocks
  (Hermes / Qwen format, the one the tools are described in) as OpenAI ``tool_calls``;

The exact-token logic (which tokens a call reuses) lives in :mod:`strop.agents.session`;
this module only says what the template makes of a message list.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from strop.tools import FENCED_PYTHON, HERMES_CALL, HERMES_ERRORS, hermes_body

ROLES = ("system", "developer", "user", "assistant", "tool")
_IGNORED_NULLS = ("refusal", "audio", "function_call", "annotations", "reasoning_content")


class ChatInputError(ValueError):
    """The caller's messages, tools or parameters are malformed: answered with a 400. ``param``: the
    field at fault (OpenAI's ``error.param``), else read from the message's first word when that is a
    field path (``messages[2].content: ...``)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def _text(i: int, content: Any, role: str) -> str:
    """A message's content as one string (OpenAI's list of text parts joined; None is empty)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        if all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            return "".join(p["text"] for p in content)
        raise ChatInputError(f"messages[{i}].content: only text parts ({{'type': 'text', 'text': ...}}) are supported")
    raise ChatInputError(
        f"messages[{i}].content ({role}) must be a string, a list of text parts or null, not {type(content).__name__}"
    )


def _tool_calls(i: int, calls: Any) -> list[dict]:
    """An assistant message's ``tool_calls``, checked: [{id, name, arguments (a dict)}]."""
    if not isinstance(calls, list):
        raise ChatInputError(f"messages[{i}].tool_calls must be a list")
    out = []
    for j, call in enumerate(calls):
        where = f"messages[{i}].tool_calls[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ChatInputError(f"{where} needs function.name (a string)")
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args or "{}")
            except (ValueError, RecursionError) as exc:
                raise ChatInputError(f"{where}.function.arguments is not valid JSON: {exc}") from exc
        if not isinstance(args, dict):
            raise ChatInputError(f"{where}.function.arguments must be a JSON object")
        out.append({"id": str(call.get("id") or ""), "name": fn["name"], "arguments": args})
    return out


def check_messages(messages: Any) -> list[dict]:
    """The caller's messages in one normal form: ``{role, content (str), tool_calls?, tool_call_id?,
    name?}``. Fields OpenAI clients send as null (refusal, audio, ...) are dropped; anything else
    malformed is a :class:`ChatInputError` naming the message."""
    if not isinstance(messages, list) or not messages:
        raise ChatInputError("messages must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ChatInputError(f"messages[{i}] must be an object with a role")
        role = m.get("role")
        if role not in ROLES:
            raise ChatInputError(f"messages[{i}].role must be one of {', '.join(ROLES)}")
        known = {"role", "content", "name", "tool_calls", "tool_call_id", *_IGNORED_NULLS}
        unknown = sorted(k for k in m if k not in known)
        if unknown:
            raise ChatInputError(f"messages[{i}] has unknown field(s) {unknown}")
        for k in _IGNORED_NULLS:
            if m.get(k) not in (None, [], ""):
                raise ChatInputError(f"messages[{i}].{k} is not supported by the strop proxy (only null)")
        norm: dict = {"role": role, "content": _text(i, m.get("content"), role)}
        if m.get("name") is not None:
            if not isinstance(m["name"], str):
                raise ChatInputError(f"messages[{i}].name must be a string")
            norm["name"] = m["name"]
        if m.get("tool_calls"):
            if role != "assistant":
                raise ChatInputError(f"messages[{i}]: only assistant messages carry tool_calls")
            norm["tool_calls"] = _tool_calls(i, m["tool_calls"])
        if role == "tool":
            if not isinstance(m.get("tool_call_id", ""), str):
                raise ChatInputError(f"messages[{i}].tool_call_id must be a string")
            norm["tool_call_id"] = m.get("tool_call_id") or ""
        elif role != "assistant" and m.get("content") is None:
            raise ChatInputError(f"messages[{i}] ({role}) needs content")
        out.append(norm)
    return out


def check_tools_schema(tools: Any) -> list[dict]:
    """OpenAI ``tools``: a list of ``{"type": "function", "function": {name, description?,
    parameters?}}`` whose parameters are a valid JSON Schema (checked with ``jsonschema``)."""
    import jsonschema

    if not isinstance(tools, list):
        raise ChatInputError("tools must be a list")
    out = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise ChatInputError(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ChatInputError(f"tools[{i}].function.name must be a non-empty string")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise ChatInputError(f"tools[{i}].function.parameters must be a JSON Schema object")
        where = f"tools[{i}].function.parameters"
        try:
            jsonschema.validators.validator_for(params).check_schema(params)
        except jsonschema.SchemaError as exc:  # (its message quotes the schema: the keyword and place say enough)
            at = "/".join(str(k) for k in exc.absolute_path)[:80] or "its top level"
            raise ChatInputError(f"{where} is not a valid JSON Schema: {at} fails {exc.validator!r}") from exc
        except RecursionError as exc:
            raise ChatInputError(f"{where} is nested too deeply to check") from exc
        out.append(
            {
                "type": "function",
                "function": {"name": fn["name"], "description": fn.get("description", ""), "parameters": params},
            }
        )
    return out


def describe_schemas(schemas: list[dict]) -> str:
    """The tools and the call format, for templates that do not take tools (strop's multi-turn wording)."""
    lines = "\n".join(json.dumps(s) for s in schemas)
    text = (
        "You may call tools. The available tools, as JSON schemas:\n<tools>\n" + lines + "\n</tools>\n"
        'To call one, write <tool_call>{"name": <tool name>, "arguments": <arguments object>}</tool_call> and '
        "stop; its output comes back inside <tool_response></tool_response>."
    )
    if any(s["function"]["name"] == "python" for s in schemas):
        text += " The python tool can also be called by writing a ```python code block."
    return text


def call_text(call: dict) -> str:
    """A tool call as the model writes it: a fenced block for the python tool's code, else Hermes."""
    if call["name"] == "python" and set(call["arguments"]) == {"code"}:
        return f"```python\n{call['arguments']['code']}```"
    return "<tool_call>" + json.dumps({"name": call["name"], "arguments": call["arguments"]}) + "</tool_call>"


class ChatRenderer:
    """Messages to prompt text with the tokenizer's chat template (see the module docstring)."""

    SENTINEL = "\x00strop-sentinel\x00"

    def __init__(self, tokenizer, *, describe_tools: bool = True):
        """``describe_tools=False``: the prompt carries no description of the tools (no schemas in the
        system prompt, none handed to a template that renders them), for agents whose own system
        prompt tells the model how to call; the tools are still parsed from its replies."""
        self.tokenizer, self.describe_tools = tokenizer, describe_tools
        source = tokenizer.chat_template or ""
        if not source:
            raise ValueError("the agent proxy needs a tokenizer with a chat template")
        self.native_tools = "tools" in source  # the template renders tools and tool_calls itself

    def _framed(self, messages: list[dict], tools: list[dict] | None) -> list[dict]:
        """For templates without tools: strop's framing (module docstring)."""
        out = []
        for m in messages:
            if m["role"] == "assistant" and m.get("tool_calls"):
                calls = "".join(call_text(c) for c in m["tool_calls"])
                out.append({"role": "assistant", "content": m["content"] + calls})
            elif m["role"] == "tool":
                out.append({"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
            else:
                out.append({"role": "system" if m["role"] == "developer" else m["role"], "content": m["content"]})
        if tools and self.describe_tools:
            block = describe_schemas(tools)
            if out and out[0]["role"] == "system":
                out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{block}"}
            else:
                out.insert(0, {"role": "system", "content": block})
        return out

    def _native(self, messages: list[dict]) -> list[dict]:
        out = []
        for m in messages:
            m = dict(m)
            if m.get("tool_calls"):  # HF templates take arguments as a dict
                m["tool_calls"] = [
                    {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                    for c in m["tool_calls"]
                ]
            out.append(m)
        return out

    def render(self, messages: list[dict], tools: list[dict] | None = None, *, generation_prompt: bool = True) -> str:
        """Prompt text of checked ``messages`` (``check_messages``); template errors are the caller's input."""
        if self.native_tools:
            msgs, kw = self._native(messages), ({"tools": tools} if tools and self.describe_tools else {})
        else:
            msgs, kw = self._framed(messages, tools), {}
        try:
            return self.tokenizer.apply_chat_template(
                msgs, tokenize=False, add_generation_prompt=generation_prompt, **kw
            )
        except Exception as exc:  # the template rejected these messages (e.g. roles out of order)
            raise ChatInputError(
                f"messages: the model's chat template rejected them: {type(exc).__name__}: {exc}"
            ) from exc

    def closing(self, messages: list[dict], tools: list[dict] | None) -> str:
        """What the template writes after an assistant message's content (ChatML: ``<|im_end|>\\n``)."""
        probe = messages + [{"role": "assistant", "content": self.SENTINEL}]
        text = self.render(probe, tools, generation_prompt=False)
        return text[text.rindex(self.SENTINEL) + len(self.SENTINEL) :]

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))


def _call_spans(text: str, tool_names: set[str]) -> list[tuple[int, int, str, dict]]:
    """The well-formed tool calls in ``text``, in order: (start, end, name, arguments)."""
    found = []
    for m in HERMES_CALL.finditer(text):
        try:
            found.append((m.start(), m.end(), *hermes_body(m.group(1))))
        except HERMES_ERRORS:
            continue
    if "python" in tool_names:
        found += [
            (m.start(), m.end(), "python", {"code": m.group(1)})
            for m in FENCED_PYTHON.finditer(text)
            if not any(a <= m.start() < b for a, b, _, _ in found)
        ]
    return sorted(found, key=lambda f: f[0])


def calls_end(text: str, tool_names: set[str]) -> int | None:
    """Where the model's first tool calls end in ``text`` (a run of calls with only space between
    them counts as one: parallel calls), or None without a call."""
    spans = _call_spans(text, tool_names) if tool_names else []
    if not spans:
        return None
    end = spans[0][1]
    for start, stop, _, _ in spans[1:]:
        if text[end:start].strip():
            break
        end = stop
    return end


def parse_reply(text: str, tool_names: set[str]) -> tuple[str | None, list[dict]]:
    """The model's text as (content, tool_calls). With tools in the request, each well-formed
    ``<tool_call>{"name", "arguments"}</tool_call>`` becomes an OpenAI tool call and leaves the
    content, as does a fenced ```python block when a tool named ``python`` is offered (its
    ``code`` argument: the convention of strop's multi-turn rollout, and what small models
    write unprompted). A malformed call stays in the content: the agent sees what the model wrote."""
    found = _call_spans(text, tool_names) if tool_names else []
    if not found:
        return text, []
    kept, last, calls = [], 0, []
    for start, end, name, args in found:
        kept.append(text[last:start])
        last = end
        calls.append(
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": name, "arguments": json.dumps(args)},
            }
        )
    content = ("".join(kept) + text[last:]).strip()
    return content or None, calls


def message_key(message: dict) -> tuple:
    """What must agree for an assistant message the agent sends back to be the one the proxy
    returned: the content (surrounding space ignored) and the calls' names and arguments (their
    ids are the client's to keep or remake)."""
    calls = tuple((c["name"], json.dumps(c["arguments"], sort_keys=True)) for c in message.get("tool_calls", []))
    return message["role"], message["content"].strip(), calls
