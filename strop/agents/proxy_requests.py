"""The agent proxy's request bodies, how they are read and refused, and the errors a call is answered with.

A body is read in one place (:func:`read_body`): JSON and validation errors become a
:class:`ChatInputError`, a 400 in OpenAI's shape naming the field and never quoting the input
(:func:`error_response`, whose message is cut short whatever came in).
"""

from __future__ import annotations

import json
import re
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from strop.agents.chat import ChatInputError
from strop.agents.session import Session
from strop.serving.openai import error_json, non_neutral, stops_of
from strop.serving.request import RequestError, SessionError
from strop.wire.errors import EngineRefusedError

MAX_N = 16
MAX_STOPS = 16  # stop strings per call (OpenAI takes 4)
MAX_NESTING = 64  # JSON objects and lists inside one another in a body (a tool schema: about 30 levels)
MAX_ERROR_CHARS = 300  # an error message is cut here: whatever came in, the answer is short


class SamplingRequest(BaseModel):
    """The sampling fields both generation routes take."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)  # clients send many optional fields
    model: str | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, le=MAX_N)
    max_tokens: int | None = Field(None, gt=0)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, lt=2**63)
    stream: bool = False
    stream_options: dict | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict | None = None


class ChatRequest(SamplingRequest):
    messages: Any
    tools: Any = None
    tool_choice: Any = None
    max_completion_tokens: int | None = Field(None, gt=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=0, description="only the sampled token's logprob is known")
    response_format: dict | None = None


class CompletionRequest(SamplingRequest):
    prompt: str | list[int]
    logprobs: int | None = Field(None, ge=0, le=0)
    echo: bool = False


class RewardBody(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    reward: float


class ClientGone(Exception):
    """The call's client hung up before its answer was ready: the call is dropped."""


class Busy(Exception):
    """The proxy holds or is full: answered with 429 and Retry-After."""

    def __init__(self, message: str, session: Session):
        super().__init__(message)
        self.session = session


def error_response(
    status: int, message: str, code: str | None = None, headers: dict | None = None, param: str | None = None
) -> JSONResponse:
    """Every error the proxy answers, in OpenAI's shape; the message cut short (it never carries the input)."""
    kind = "rate_limit_exceeded" if status == 429 else "invalid_request_error" if status < 500 else "server_error"
    if len(message) > MAX_ERROR_CHARS:
        message = message[: MAX_ERROR_CHARS - 3] + "..."
    return error_json(status, message, kind, code, headers, param=param)


_FIELDS = {*ChatRequest.model_fields, *CompletionRequest.model_fields, *RewardBody.model_fields}


def input_param(exc: ChatInputError) -> str | None:
    """The field a refusal names: its own, else its message's first word when that is a field path."""
    if exc.param is not None:
        return exc.param
    head = re.match(r"[a-z_]+(\[\d+\])?(\.[a-z_]+(\[\d+\])?)*", str(exc))
    return head.group(0) if head and head.group(0).split("[")[0].split(".")[0] in _FIELDS else None


def _path(keys: tuple) -> str:
    """``("messages", 0, "content")`` as ``messages[0].content`` (the first four keys: a deep path names its
    top, which is the field the caller wrote)."""
    out = ""
    for k in keys[:4]:
        out += f"[{k}]" if isinstance(k, int) else f".{str(k)[:40]}" if out else str(k)[:40]
    return out


def _check_json(data: Any) -> None:
    """Refuse, naming the field, what would fail later as a server error: a body nested more than
    MAX_NESTING deep (recursive checks and renderers overflow the stack) and text holding a lone
    surrogate (JSON's ``\\ud800`` escapes can write one; it is no Unicode text, and no tokenizer reads it)."""
    stack = [(data, ())]
    while stack:  # (a loop, not recursion: the depth is what is being checked)
        value, keys = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise ChatInputError(
                    f"{_path(keys)}: holds a lone surrogate (\\ud800-\\udfff), which is not Unicode text", _path(keys)
                ) from None
        elif isinstance(value, (dict, list)):
            if len(keys) >= MAX_NESTING:
                raise ChatInputError(f"{_path(keys)}: nested more than {MAX_NESTING} levels deep", _path(keys))
            items = list(value.items()) if isinstance(value, dict) else list(enumerate(value))
            for k, v in reversed(items):  # (reversed: the first fault found is the first in the body)
                stack.append((v, keys + (k,)))
                if isinstance(k, str):
                    stack.append((k, keys))


def read_body(raw: bytes, model: type[BaseModel]) -> BaseModel:
    """A request body as ``model``: the one place JSON and validation errors become a ChatInputError
    (a 400 naming the field, never quoting the body)."""
    try:
        data = json.loads(raw)
    except RecursionError:
        raise ChatInputError("the request body is nested too deeply") from None
    except json.JSONDecodeError as exc:
        raise ChatInputError(f"the request body is not valid JSON ({exc.msg} at character {exc.pos})") from None
    except ValueError:  # (bytes that are not UTF-8)
        raise ChatInputError("the request body is not valid JSON (not UTF-8 text)") from None
    if not isinstance(data, dict):
        raise ChatInputError("the request body must be a JSON object")
    _check_json(data)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors(include_url=False, include_input=False, include_context=False)[0]
        field = str(first["loc"][0]) if first["loc"] else None
        raise ChatInputError(f"{field}: {first['msg']}" if field else first["msg"], field) from None


def check_neutral(body: SamplingRequest) -> None:
    """Refuse a penalty or logit bias other than its neutral value (the proxy samples as the rollout does)."""
    name = non_neutral(body)
    if name is not None:
        raise ChatInputError(f"{name} is not supported by the strop proxy (only its neutral value)")


def stop_strings(body: SamplingRequest) -> list[str]:
    """The call's stop strings (``stop``: one string or a list), at most MAX_STOPS, none empty."""
    stops = stops_of(body)
    if any(not x for x in stops) or len(stops) > MAX_STOPS:
        raise ChatInputError(f"stop: at most {MAX_STOPS} non-empty strings")
    return stops


def engine_refusal(exc: BaseException) -> BaseException | None:
    """The engine's refusal of the request as malformed (the client's error, not the engine's), or None.
    (The engine reached through :class:`GuardedEngine` comes wrapped: its error is the cause.)"""
    cause = exc.__cause__ if exc.__cause__ is not None else exc
    if isinstance(cause, RequestError) and not isinstance(cause, SessionError):
        return cause
    if isinstance(cause, EngineRefusedError) and cause.status in (400, 413, 422):
        return cause
    return None
