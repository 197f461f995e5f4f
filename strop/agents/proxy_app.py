"""The agent proxy's HTTP application: its routes (:mod:`strop.agents.proxy` lists them) and how
every failure is answered (OpenAI's error shape, :func:`strop.agents.proxy_requests.error_response`)."""

from __future__ import annotations

import asyncio
import logging
import math

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from strop.agents.chat import ChatInputError, check_messages, check_tools_schema
from strop.agents.proxy_answers import chat_answer, completion_answer
from strop.agents.proxy_requests import (
    Busy,
    ChatRequest,
    ClientGone,
    CompletionRequest,
    RewardBody,
    check_neutral,
    error_response,
    input_param,
    read_body,
)
from strop.agents.proxy_stream import stream
from strop.agents.session import ChatState, Session, SessionLimitError
from strop.serving.openai import models_answer
from strop.types import Sample, SamplingParams

log = logging.getLogger("strop.agents")


def create_app(proxy) -> FastAPI:
    """The routes of ``proxy`` (an :class:`strop.agents.proxy.AgentProxy`), in its event loop."""
    app = FastAPI(title="strop agent proxy", docs_url=None, redoc_url=None, openapi_url=None)
    _answer_errors(app, proxy)
    _call_routes(app, proxy)
    _session_routes(app, proxy)
    return app


def _answer_errors(app: FastAPI, proxy) -> None:
    """Every failure in OpenAI's shape: the client's (4xx, counted as bad requests), the proxy's holds
    (429 with Retry-After) and a fault (502, logged)."""

    @app.exception_handler(RequestValidationError)
    async def _bad(request: Request, exc: RequestValidationError):  # (a path parameter: bodies are read_body's)
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", ()) if x not in ("body", "path"))
        proxy.counts["agent_bad_requests"] += 1
        return error_response(400, f"{where}: {first.get('msg', 'invalid')}", param=where or None)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        if 400 <= exc.status_code < 500:
            proxy.counts["agent_bad_requests"] += 1
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(ChatInputError)
    async def _input(request: Request, exc: ChatInputError):
        proxy.counts["agent_bad_requests"] += 1
        return error_response(400, str(exc), param=input_param(exc))

    @app.exception_handler(ClientGone)
    async def _gone(request: Request, exc: ClientGone):
        return error_response(499, str(exc))  # (nobody reads it)

    @app.exception_handler(SessionLimitError)
    async def _limit(request: Request, exc: SessionLimitError):
        proxy.counts["agent_session_limit_calls"] += 1
        return error_response(400, f"{exc}; the session generates no more", code="session_limit")

    @app.exception_handler(Busy)
    async def _busy(request: Request, exc: Busy):
        proxy.counts["agent_calls_rejected_busy"] += 1
        exc.session.last_rejected = True  # an agent that gives up on it did not fail by its own work
        wait = max(proxy.retry_after_s, 0.001)
        return error_response(
            429,
            f"{exc}: retry after {wait:g} s",
            headers={"Retry-After": str(max(1, math.ceil(wait))), "retry-after-ms": str(int(wait * 1000))},
        )

    @app.exception_handler(Exception)
    async def _fault(request: Request, exc: Exception):
        if isinstance(exc, (RecursionError, UnicodeError)):  # what the input's depth or text did: its fault
            proxy.counts["agent_bad_requests"] += 1
            return error_response(
                400,
                "the request is nested too deeply"
                if isinstance(exc, RecursionError)
                else "the request holds text that is not valid Unicode",
            )
        log.exception("agent proxy: %s %s failed", request.method, request.url.path)
        return error_response(502, f"{type(exc).__name__}: {exc}")


def _call_routes(app: FastAPI, proxy) -> None:
    """What an agent calls with its session's key: generation, and what the proxy serves."""

    @app.get("/health")
    async def health(request: Request):  # a key, as every route: it tells how busy the run is
        proxy.authorise(request)
        return {"status": "ok", "sessions": len(proxy.sessions), "in_flight": proxy.in_flight}

    @app.get("/v1/models")
    async def models(request: Request):
        proxy.authorise(request)
        return models_answer(proxy.model_name, owned_by="strop")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await _chat(proxy, request)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _completions(proxy, request)


async def _chat(proxy, request: Request):
    s = proxy.session_for(request)
    body = read_body(await request.body(), ChatRequest)
    check_neutral(body)
    messages = check_messages(body.messages)
    tools = check_tools_schema(body.tools) if body.tools else None
    if body.tool_choice not in (None, "auto", "none"):
        raise ChatInputError("tool_choice: only 'auto' and 'none' (the proxy cannot force a call)")
    if body.response_format not in (None, {"type": "text"}):
        raise ChatInputError("response_format other than {'type': 'text'} is not supported")
    # tool_choice='none': the tools stay in the prompt (as with OpenAI), the reply is not parsed for calls
    callable_names = set() if body.tool_choice == "none" else {t["function"]["name"] for t in tools or []}
    text = proxy.renderer.render(messages, tools)
    ids = s.continuation(proxy.renderer, messages, tools, text) if s.segments else None
    if ids is None:
        ids = proxy.renderer.encode(text)
    state, asked = ChatState(messages, tools, text), body.max_completion_tokens or body.max_tokens
    if body.stream:
        return await stream(proxy, request, s, ids, body, asked, state, callable_names)
    call, cut = await proxy.generate(request, s, ids, body, asked, state, callable_names)
    # (decoding: beside the loop)
    return await asyncio.to_thread(chat_answer, proxy.tokenizer, proxy.model_name, body, call, cut)


async def _completions(proxy, request: Request):
    s = proxy.session_for(request)
    body = read_body(await request.body(), CompletionRequest)
    check_neutral(body)
    if body.echo:
        raise ChatInputError("echo is not supported by the strop proxy")
    if isinstance(body.prompt, str):
        ids = list(proxy.tokenizer(body.prompt, add_special_tokens=True)["input_ids"])
        if not ids:  # (the engine would refuse it)
            raise ChatInputError("prompt: the text makes no tokens: give at least one")
    else:
        vocab = len(proxy.tokenizer)
        if not body.prompt or any(t < 0 or t >= vocab for t in body.prompt):
            raise ChatInputError(f"prompt: token ids must be a non-empty list in [0, {vocab})")
        ids = list(body.prompt)
    if body.stream:
        return await stream(proxy, request, s, ids, body, body.max_tokens or 16, None, set())
    call, cut = await proxy.generate(request, s, ids, body, body.max_tokens or 16, None, set())
    return completion_answer(proxy.model_name, body, call, cut)


def _record(sess: Session, samples: list[Sample] | None = None) -> dict:
    """A session's state, as the admin routes answer it; with ``samples``, its segments as samples."""
    out = {
        "id": sess.id,
        "state": sess.state,
        "reason": sess.reason,
        "reward": sess.reward,
        "calls": sess.calls,
        "forks": sess.forks,
    }
    if samples is not None:
        out["samples"] = [
            {
                "prompt_ids": x.prompt_ids,
                "response_ids": x.response_ids,
                "rollout_logprobs": x.rollout_logprobs,
                "loss_mask": x.loss_mask,
                "weight_versions": x.weight_versions,
                "status": x.status.value,
                "segment": x.metadata["segment"],
            }
            for x in samples
        ]
    return out


def _session_routes(app: FastAPI, proxy) -> None:
    """The /v1/sessions routes: the admin's (a standalone proxy) and a session's reward."""

    def admin(request: Request) -> None:
        if not proxy.is_admin(request):
            raise HTTPException(
                401 if proxy.admin_token else 404,
                "session management needs the proxy's admin token"
                if proxy.admin_token
                else "sessions are opened by the training run here",
            )

    @app.post("/v1/sessions")
    async def open_session(request: Request):
        admin(request)
        sess = proxy.open(Sample(prompt="", prompt_ids=[0]), proxy.sampling or SamplingParams())
        return {"id": sess.id, "api_key": sess.key, "base_url": proxy.base_url}

    def admin_session(request: Request, sid: str) -> Session:
        admin(request)
        if sid not in proxy.by_id:
            raise HTTPException(404, f"session {sid}: no such session")
        return proxy.by_id[sid]

    @app.get("/v1/sessions/{sid}")
    async def session_state(sid: str, request: Request):
        sess = admin_session(request, sid)
        return _record(sess, sess.samples())  # (as if it closed now: the session goes on unchanged)

    @app.post("/v1/sessions/{sid}/close")
    async def close_session(sid: str, request: Request):
        sess = admin_session(request, sid)
        proxy.end(sess, "completed")  # (one that ended already, idle, keeps its ending)
        out = _record(sess, sess.samples())
        proxy.forget(sess)  # collected: freed
        return out

    @app.post("/v1/sessions/{sid}/reward")
    async def reward(sid: str, request: Request):
        s = proxy.session_for(request)
        body = read_body(await request.body(), RewardBody)
        if s.id != sid:
            target = proxy.by_id.get(sid)
            raise HTTPException(
                403 if target else 404,
                f"session {sid}: " + ("this API key belongs to another session" if target else "no such session"),
            )
        if s.state not in ("open", "capped"):
            raise HTTPException(409, f"session {sid} is closed ({s.state}): its reward can no longer change")
        s.reward = float(body.reward)
        s.touch()
        return {"session": sid, "reward": s.reward}
