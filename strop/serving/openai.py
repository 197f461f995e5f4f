"""The one OpenAI-compatible module strop serve and the agent proxy (:mod:`strop.agents.proxy`) both build on.

strop serve mounts its ``/v1`` routes from :mod:`strop.serving.routes_openai`; the agent proxy mounts its own
(:mod:`strop.agents.proxy_app`: a session's calls, recorded token by token). What both answer alike lives here,
as plain classes and functions, so the two servers' OpenAI surface is written once:

- request bodies (strop serve's; the proxy keeps its own, with its tighter bounds and wording):
  :class:`OpenAIBody` (the sampling fields both endpoints share, with the refusals of fields strop does not
  implement), :class:`CompletionBody`, :class:`ChatBody`; the field types ``Seed`` and ``StopString``; the
  limits ``MAX_N``, ``MAX_LOGPROBS``, ``MAX_BODY_BYTES``;
- the fields accepted at their neutral value only: ``NEUTRAL_ONLY`` and :func:`non_neutral` (each server
  words its own refusal);
- the error shape: :func:`error_json` (OpenAI's ``{"error": {message, type, ..., code}}``), :func:`error`
  (strop serve's, over it) and :class:`BodyLimit` (an ASGI wrapper refusing an over-long body with 413
  before anything parses it);
- the ``/v1/models`` answer: :func:`models_answer`;
- SSE framing: :func:`sse` (one event per chunk, ``[DONE]``, an error event when the stream fails);
- helpers over a finished completion: :func:`cut_at_stops`, :func:`finish`, :func:`usage`,
  :func:`stops_of`, :func:`include_usage`, :func:`at_most_max_logprobs`, :func:`completion_logprobs`,
  :func:`chat_logprobs`, :func:`text_message`, :func:`json_logprob`.

strop serve uses all of it. The agent proxy uses :func:`error_json`, :class:`BodyLimit`, ``MAX_BODY_BYTES``,
:func:`models_answer`, :func:`non_neutral`, :func:`sse`, :func:`cut_at_stops`, :func:`usage`,
:func:`stops_of` and :func:`include_usage`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterable, Callable, Iterable
from typing import Annotated, Any

from fastapi import HTTPException
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

from strop.serving.request import RequestError
from strop.types import Completion

MAX_N = 128  # choices per request
MAX_LOGPROBS = 20  # most likely tokens per position a request may ask for (vLLM's default max_logprobs)
MAX_BODY_BYTES = 16 << 20  # a request body; a longer one gets 413 (strop serve and the agent proxy)
NEUTRAL_ONLY = ("frequency_penalty", "presence_penalty", "logit_bias")  # accepted at their neutral value only
log = logging.getLogger("strop.serve")

Seed = Annotated[int, Field(ge=0, lt=2**64)]  # what a torch.Generator takes (negative seeds refused)
StopString = Annotated[str, Field(min_length=1)]


class OpenAIBody(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)  # OpenAI clients send many optional fields
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=2**31 - 1)  # vLLM's extension
    seed: Seed | None = None
    n: int | None = Field(None, ge=1, le=MAX_N)
    stop: StopString | list[StopString] | None = None
    stream: bool | None = False
    stream_options: dict | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict | None = None
    model: str | None = None
    ignore_eos: bool = False  # vLLM's extension: generate to max_tokens, past end-of-sequence tokens

    @model_validator(mode="after")
    def _only_neutral(self):
        name = non_neutral(self)
        if name is not None:
            raise ValueError(f"{name}={getattr(self, name)!r} is not supported by strop serve")
        return self


class CompletionBody(OpenAIBody):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(
        None,
        ge=0,
        le=2**31 - 1,
        description="0 (with echo): no generation, the prompt's logprobs only (lm-eval-harness's loglikelihood)",
    )
    logprobs: int | None = Field(
        None,
        ge=0,
        description="the sampled tokens' logprobs and, per token, the logprobs "
        f"of this many most likely tokens (at most {MAX_LOGPROBS})",
    )
    echo: bool | None = Field(
        False,
        description="the prompt before the text; with logprobs, the prompt tokens' "
        "logprobs first (the first token's null)",
    )
    best_of: int | None = None
    suffix: str | None = None
    prompt_logprobs: int | None = Field(
        None,
        ge=0,
        description="vLLM's extension: per prompt token (the first null) its logprob and those of this many most "
        f"likely tokens (at most {MAX_LOGPROBS}), as choices[].prompt_logprobs",
    )

    @model_validator(mode="after")
    def _supported(self):
        if self.suffix or self.best_of not in (None, self.n or 1):
            raise ValueError("suffix and best_of (other than n) are not supported by strop serve")
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs with stream is not supported by strop serve: ask without stream")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens 0 generates nothing: it needs echo (the prompt and its logprobs)")
        return self


class ChatBody(OpenAIBody):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: int | None = Field(None, gt=0, le=2**31 - 1)
    max_completion_tokens: int | None = Field(None, gt=0, le=2**31 - 1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(
        None, ge=0, description=f"with logprobs, the most likely tokens at each position (at most {MAX_LOGPROBS})"
    )
    response_format: dict | None = None

    @model_validator(mode="after")
    def _supported(self):
        if self.response_format not in (None, {"type": "text"}):
            raise ValueError("response_format other than {'type': 'text'} is not supported by strop serve")
        return self


def non_neutral(body) -> str | None:
    """The first of ``NEUTRAL_ONLY`` a body (strop serve's or the proxy's) sets to other than its
    neutral value, or None: strop samples without penalties or logit bias."""
    for name in NEUTRAL_ONLY:
        if getattr(body, name) not in (None, 0, 0.0, {}):
            return name
    return None


def error_json(status: int, message: str, kind: str, code, headers: dict | None = None, **fields) -> JSONResponse:
    """OpenAI's error shape, ``{"error": {"message", "type", **fields, "code"}}`` (the openai SDK reads
    ``error.message``), with ``status``: strop serve's and the agent proxy's errors alike."""
    return JSONResponse(
        status_code=status,
        content={"error": {"message": message, "type": kind, **fields, "code": code}},
        headers=headers,
    )


def error(status: int, message: str) -> JSONResponse:
    """strop serve's errors in OpenAI's shape, the status as the code; SGLang clients read the text."""
    return error_json(status, message, "invalid_request_error" if status < 500 else "internal_error", status)


def models_answer(name: str, **fields) -> dict:
    """The ``/v1/models`` answer: the one model served, as ``name``, with the server's ``fields``."""
    return {"object": "list", "data": [{"id": name, "object": "model", **fields}]}


class BodyLimit:
    """ASGI wrapper: a request body (sized or chunked) is read whole, at most ``limit()`` bytes, before
    the app sees it; a longer one gets ``error(413, message)`` (a short message that repeats none of
    the input) and the rest is never read. strop serve and the agent proxy both use it."""

    def __init__(self, app, limit: Callable[[], int], error: Callable[[int, str], Any]):
        self.app, self.limit, self.error = app, limit, error

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit, body, more = self.limit(), bytearray(), True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > limit:
                answer = self.error(413, f"the request body is over {limit} bytes")
                return await answer(scope, receive, send)
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        return await self.app(scope, replay, send)


def stops_of(body: OpenAIBody) -> list[str]:
    return [body.stop] if isinstance(body.stop, str) else list(body.stop or [])


def finish(out: Completion) -> str:
    return out.finish_reason  # "stop", "length" or "abort" (aborted: its tokens so far), as vLLM answers


def usage(prompts, completion_tokens: int) -> dict:
    prompt = sum(len(p) for p in prompts)
    return {"prompt_tokens": prompt, "completion_tokens": completion_tokens, "total_tokens": prompt + completion_tokens}


def include_usage(body: OpenAIBody) -> bool:
    """A stream that asked for the usage chunk at its end (``stream_options.include_usage``)."""
    return bool((body.stream_options or {}).get("include_usage"))


def at_most_max_logprobs(name: str, n: int | None) -> None:
    if n is not None and n > MAX_LOGPROBS:  # (vLLM's max_logprobs refusal: 400)
        raise HTTPException(
            status_code=400,
            detail=f"{name}: {n} is above {MAX_LOGPROBS}, the most likely "
            "tokens per position strop serve returns at most",
        )


def completion_logprobs(
    ids: list[int], logprobs: list, tops: list, token_text: Callable[[int], str], offset: int = 0
) -> dict:
    """OpenAI's (and vLLM's) completion logprobs: per token its text (``token_text``), its logprob, a dict
    of the token and its most likely alternatives by text (None where a token has no logprob: an
    echoed prompt's first), and its offset in the text (cumulative token lengths from ``offset``)."""
    tokens = [token_text(t) for t in ids]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    top = [
        None
        if lp is None
        else {token: json_logprob(lp), **{token_text(a): json_logprob(v) for a, v in (alternatives or {}).items()}}
        for token, lp, alternatives in zip(tokens, logprobs, tops)
    ]
    return {
        "tokens": tokens,
        "token_logprobs": [None if lp is None else json_logprob(lp) for lp in logprobs],
        "top_logprobs": top,
        "text_offset": offsets,
    }


def chat_logprobs(ids: list[int], logprobs: list[float], tops: list, token_text: Callable[[int], str]) -> dict:
    """OpenAI's chat logprobs: per token its text, bytes, logprob and its most likely tokens, most likely first."""

    def entry(t: int, lp: float) -> dict:
        text = token_text(t)
        return {"token": text, "logprob": json_logprob(lp), "bytes": list(text.encode())}

    return {
        "content": [
            {**entry(t, lp), "top_logprobs": [entry(a, v) for a, v in (alternatives or {}).items()], "token_id": t}
            for t, lp, alternatives in zip(ids, logprobs, tops)
        ]
    }


def json_logprob(logprob: float) -> float:
    return max(logprob, -9999.0)  # -inf is no JSON number; OpenAI and vLLM send -9999.0


def sse(chunks: Iterable[dict] | AsyncIterable[dict]) -> StreamingResponse:
    """Server-sent events, one per chunk as it comes (a list, or an async iterator whose chunks are
    sent as they are made), then ``[DONE]``. An iterator that fails ends the stream with an error
    event (OpenAI's error shape), as vLLM's does: the status line went out with the first chunk."""

    async def events():
        try:
            if isinstance(chunks, AsyncIterable):
                async for chunk in chunks:
                    yield f"data: {json.dumps(chunk)}\n\n"
            else:
                for chunk in chunks:
                    yield f"data: {json.dumps(chunk)}\n\n"
        except Exception as exc:
            log.warning("strop serve: a stream failed: %s: %s", type(exc).__name__, exc)
            status = 400 if isinstance(exc, RequestError) else 500
            yield f"data: {json.dumps({'error': {'message': f'{type(exc).__name__}: {exc}', 'code': status}})}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


def cut_at_stops(out: Completion, stops: list[str], decode) -> tuple[Completion, str, str | None]:
    """``out`` cut after the first of ``stops`` its text holds: (completion, its text up to and
    without the stop string, the stop string matched or None). The tokens keep the stop string
    (and their logprobs stay paired with them); the text does not."""
    text = decode(out.token_ids)
    hits = [(text.find(s), s) for s in stops if s in text]
    if not hits:
        return out, text, None
    _, matched = min(hits)
    keep = _tokens_through(lambda k: any(s in decode(out.token_ids[:k]) for s in stops), len(out.token_ids))
    cut = out.cut(keep)
    text = decode(cut.token_ids)
    return cut, text[: min(text.find(s) for s in stops if s in text)], matched


def _tokens_through(contains, n: int) -> int:
    """The fewest leading tokens whose text ``contains`` a stop string (``contains(n)`` holds):
    a binary search, as the decoded prefix only grows."""
    lo, hi = 1, n
    while lo < hi:
        mid = (lo + hi) // 2
        if contains(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def text_message(i: int, message: dict) -> dict:
    """A chat message with its content as one string (OpenAI's list of text parts joined)."""
    content = message.get("content")
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise HTTPException(status_code=400, detail=f"messages[{i}].content: only text parts are supported")
        message = {**message, "content": "".join(p["text"] for p in content)}
    elif content is not None and not isinstance(content, str):
        raise HTTPException(status_code=400, detail=f"messages[{i}].content must be a string or a list of text parts")
    return message


def vllm_prompt_logprobs(ids: list[int], logprobs: list, tops: list, token_text) -> list:
    """vLLM's ``prompt_logprobs``: per prompt position (the first None) ``{token id: {"logprob", "rank",
    "decoded_token"}}``, the prompt's own token always there, with the most likely tokens asked for. ``rank``
    is known for a listed token (1 + how many listed tokens are likelier), else None."""
    out: list = [None]
    for t, lp, top in zip(ids[1:], logprobs[1:], tops[1:]):
        entries = dict(top or {})
        entries.setdefault(t, lp)
        listed = sorted(entries.values(), reverse=True)
        out.append(
            {
                str(k): {
                    "logprob": v,
                    "rank": 1 + sum(x > v for x in listed) if top and k in top else None,
                    "decoded_token": token_text(k),
                }
                for k, v in entries.items()
            }
        )
    return out
