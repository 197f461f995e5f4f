"""A streamed call of the agent proxy (``"stream": true``): server-sent events, a chunk per token.

Live where the engine reports tokens as it decodes them (``GuardedEngine.streams``: the embedded
engine): each token's chunk goes out as it is decoded (:class:`LiveAnswer` says what waits), and a
client that hangs up before the end aborts the engine's requests and the call is not recorded (the
rule for hung-up clients). Otherwise (HTTP engines) the chunks go out once the whole answer is in.
"""

from __future__ import annotations

import asyncio
import uuid

from fastapi import HTTPException, Request
from fastapi.responses import StreamingResponse

from strop.agents.proxy_answers import (
    LiveAnswer,
    end_chunks,
    markers,
    replayed_chunks,
    role_chunks,
    stream_head,
    token_chunk,
)
from strop.agents.proxy_requests import ClientGone, SamplingRequest, stop_strings
from strop.agents.session import ChatState, Session
from strop.serving.openai import sse
from strop.types import Completion, SamplingParams


async def stream(
    proxy,
    request: Request,
    s: Session,
    prompt_ids: list[int],
    body: SamplingRequest,
    asked: int | None,
    chat: ChatState | None,
    tool_names: set[str],
) -> StreamingResponse:
    """A streamed answer of ``proxy`` (an :class:`strop.agents.proxy.AgentProxy`): per choice a chunk
    per token, then its end (tool calls, finish reason): the tokens, text and logprobs of the plain
    call, and the same call recorded."""
    head = stream_head(chat, proxy.model_name)
    marks = markers(tool_names) if chat is not None else ()
    special = set(proxy.tokenizer.all_special_ids) if marks else set()

    def answers(stops: list[str]) -> list[LiveAnswer]:
        return [LiveAnswer(proxy.decode_text, stops, marks, special) for _ in range(body.n)]

    if not proxy.engine.streams:
        call, cut = await proxy.generate(request, s, prompt_ids, body, asked, chat, tool_names)
        return sse(
            await asyncio.to_thread(
                replayed_chunks, proxy.tokenizer, head, body, call, cut, answers(stop_strings(body))
            )
        )
    stops, jobs = proxy.start_call(s, prompt_ids, body, asked)
    live = _LiveCall(proxy, request, s, prompt_ids, body, chat, tool_names, head, stops, jobs)
    first = await live.begin()
    return sse(live.chunks(first, answers(stops)))


class _LiveCall:
    """One call streamed as the engine decodes it: its engine requests, their tokens and answers as
    they come (one queue, in order), and the chunks they make."""

    def __init__(
        self,
        proxy,
        request: Request,
        s: Session,
        prompt_ids: list[int],
        body: SamplingRequest,
        chat: ChatState | None,
        tool_names: set[str],
        head: dict,
        stops: list[str],
        jobs: list[SamplingParams],
    ):
        self.proxy, self.request, self.s, self.prompt_ids, self.body = proxy, request, s, prompt_ids, body
        self.chat, self.tool_names, self.head, self.stops, self.jobs = chat, tool_names, head, stops, jobs
        self.queue: asyncio.Queue = asyncio.Queue()
        self.rids = [f"proxy-{uuid.uuid4().hex}" for _ in jobs]
        self.tasks: list[asyncio.Future] = []

    async def _run(self, i: int, sampling: SamplingParams) -> None:
        try:
            out = await self.proxy.engine.generate(
                self.prompt_ids,
                sampling,
                affinity=self.s.id,
                request_id=self.rids[i],
                on_token=lambda *token: self.queue.put_nowait((i, token)),
            )
        except Exception as exc:  # (answered by the stream, in order after the tokens heard)
            out = exc
        self.queue.put_nowait((i, out))

    async def begin(self) -> tuple:
        """Start the engine's requests; their first report (before the status line: a request the
        engine refuses is still a 400)."""
        self.tasks = [asyncio.ensure_future(self._run(i, p)) for i, p in enumerate(self.jobs)]
        first = await self.queue.get()
        if isinstance(first[1], BaseException):
            for rid in self.rids:
                await self.proxy.engine.abort(rid)
            await asyncio.gather(*self.tasks)
            self.proxy.generated(self.s)
            self.proxy.engine_failed(self.s, first[1])
        return first

    async def chunks(self, first: tuple, views: list[LiveAnswer]):
        """The stream's chunks: the role, each token's as it is heard, then the ends once recorded."""
        proxy, s, head, body, chat = self.proxy, self.s, self.head, self.body, self.chat
        outs: list[Completion | None] = [None] * len(self.jobs)
        generating, settled = True, False  # settled: the call was recorded, or its failure answered for
        item = first
        try:
            if chat is not None:  # the role first, a chunk per choice
                for chunk in role_chunks(head, len(self.jobs)):
                    yield chunk
            while True:
                i, got = item
                if isinstance(got, BaseException):
                    settled = True
                    proxy.engine_failed(s, got)
                if isinstance(got, Completion):
                    outs[i] = got
                else:
                    for token, logprob, text in views[i].push(got[0], got[1]):
                        yield token_chunk(proxy.tokenizer, head, body, chat, i, token, logprob, text)
                if all(out is not None for out in outs):
                    break
                item = await self.queue.get()
            generating = False
            proxy.generated(s)
            try:
                call, cut = await proxy.record(
                    self.request, s, self.prompt_ids, outs, self.stops, chat, self.tool_names
                )
            except (HTTPException, ClientGone):  # (each answered for there)
                settled = True
                raise
            settled = True
            for chunk in await asyncio.to_thread(end_chunks, proxy.tokenizer, head, body, call, cut, views):
                yield chunk
        finally:  # the client hung up (or the stream failed): nothing decodes for nobody
            for i, rid in enumerate(self.rids):
                if outs[i] is None:
                    await proxy.engine.abort(rid)
            if generating:
                proxy.generated(s)
            if not settled:  # a hung-up client's call is not recorded
                proxy.drop_call(s)
