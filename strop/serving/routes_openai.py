"""strop serve's OpenAI-compatible routes over the one :class:`strop.serving.service.ServeService`:
  GET  /v1/models
  POST /v1/completions, /v1/chat/completions  (token ids, logprobs and up to 20 top logprobs included;
                                              echo; stream (a chunk per decoded token), stop, n)
The request bodies, error shape, /v1/models answer, SSE framing and completion helpers are
:mod:`strop.serving.openai`'s, the OpenAI-compatible module the agent proxy builds on too."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import StreamingResponse

from strop.serving.openai import (
    ChatBody,
    CompletionBody,
    OpenAIBody,
    at_most_max_logprobs,
    chat_logprobs,
    completion_logprobs,
    cut_at_stops,
    finish,
    include_usage,
    models_answer,
    sse,
    stops_of,
    text_message,
    usage,
    vllm_prompt_logprobs,
)
from strop.serving.service import ServeService, sampling_of, seeds, service_of
from strop.serving.textstream import StreamedText
from strop.types import Completion, SamplingParams
from strop.wire.routes import vllm_routes

log = logging.getLogger("strop.serve")
router = APIRouter()


@router.get("/v1/models")
async def models(request: Request):
    svc = service_of(request)
    out = models_answer(svc.model_name, created=0, owned_by="strop", max_model_len=svc.engine.context_window)
    if svc.lora_name:  # the adapter merged into its weights, as vLLM and SGLang list theirs
        out["data"].append({"id": svc.lora_name, "object": "model", "parent": svc.model_name, "owned_by": "strop"})
    return out


NO_STOP = [-1]  # a stop token no model has: the engine's end-of-sequence tokens do not apply


def openai_jobs(prompts: list[list[int]], body: OpenAIBody, max_tokens: int) -> list[tuple[int, SamplingParams]]:
    """n jobs per prompt (prompt-major, as OpenAI numbers choices): [(prompt index, sampling)]."""
    return [
        (
            p,
            sampling_of(
                body.temperature, body.top_p, body.top_k, max_tokens, NO_STOP if body.ignore_eos else None, seed
            ),
        )
        for p in range(len(prompts))
        for seed in seeds(body.seed, body.n or 1)
    ]


async def openai_choices(svc: ServeService, prompts: list[list[int]], body: OpenAIBody, max_tokens: int, top: int = 0):
    """n choices per prompt: [(prompt index, completion, text, top alternatives per token)]."""
    jobs = openai_jobs(prompts, body, max_tokens)
    outs = await asyncio.gather(*(svc.complete(prompts[p], s, None, stops_of(body), top=top) for p, s in jobs))
    return [(p, out, text, tops) for (p, _), (out, text, _, tops) in zip(jobs, outs)]


async def streamed(
    svc: ServeService, prompts: list[list[int]], jobs: list[tuple[int, SamplingParams]], stops: list[str], top: int
):
    """Run ``jobs`` and yield, as the engine decodes them, ``(job, token_id, logprob, alternatives,
    text)`` per token, then ``(job, None, finish_reason, None, text)`` once per job: the tokens
    and text (through ``text``, the new text each carries) are those of the same request
    unstreamed. Text that could still turn out to be the start of a stop string, or an
    unfinished character, waits for the tokens after it. A job whose text reaches a stop string
    ends there (its engine request is aborted); every job still running when the client goes
    away is aborted."""
    engine, decode = svc.engine, svc.decode
    queue: asyncio.Queue = asyncio.Queue()
    rids = [f"stream-{uuid.uuid4().hex}" for _ in jobs]

    async def run(j: int, ids: list[int], sampling: SamplingParams) -> None:
        try:
            out = await engine.generate(
                ids, sampling, rids[j], top_logprobs=top, on_token=lambda *token: queue.put_nowait((j, token))
            )
        except Exception as exc:  # ends the stream with an error event
            out = exc
        queue.put_nowait((j, out))

    tasks = [asyncio.ensure_future(run(j, prompts[p], s)) for j, (p, s) in enumerate(jobs)]
    texts = [StreamedText(decode, stops) for _ in jobs]  # each token decoded once (strop.serving.textstream)
    sent = [0] * len(jobs)  # characters of each job's text sent so far
    running = set(range(len(jobs)))
    try:
        while running:
            j, item = await queue.get()
            if j not in running:  # (tokens decoded after the job's stop string)
                continue
            if isinstance(item, BaseException):
                raise item
            if isinstance(item, Completion):  # the request ended (every token was heard before)
                # the whole answer decoded once, beside the loop: its text is the unstreamed answer's
                _, text, matched = await asyncio.to_thread(cut_at_stops, item, stops, decode)
                running.discard(j)
                sent_text = texts[j].text[: sent[j]]
                if not text.startswith(sent_text):  # (a tokenizer whose decoding is not prefix-stable)
                    log.warning(
                        "strop serve: a streamed answer's text, decoded token by token, is not a "
                        "prefix of its whole decoding: the stream's text differs from the answer's"
                    )
                yield j, None, "stop" if matched else finish(item), None, text[len(sent_text) :]
                continue
            token, logprob, alternatives = item
            texts[j].push(token)
            ready = texts[j].ready
            new = texts[j].text[sent[j] : ready]
            sent[j] = max(sent[j], ready)
            if texts[j].stop_at is not None:  # as cut_at_stops cuts the whole answer: before the stop string
                running.discard(j)
                await engine.abort(rids[j])
                yield j, token, logprob, alternatives, new
                yield j, None, "stop", None, ""
                continue
            yield j, token, logprob, alternatives, new
    finally:  # the client went away or the stream failed: nothing decodes for nobody
        for j in running:
            await engine.abort(rids[j])
        tasks.clear()  # (each ends on its own once aborted)


@router.post("/v1/completions")
async def completions(body: CompletionBody, request: Request):
    svc = service_of(request)
    engine, decode = svc.engine, svc.decode
    at_most_max_logprobs("logprobs", body.logprobs)
    p = body.prompt
    batched = bool(p) and not isinstance(p, str) and not isinstance(p[0], int)
    texts = list(p) if batched else [p]  # each a text or token ids
    prompts = [svc.encode(x) if isinstance(x, str) else x for x in texts]
    top = body.logprobs or 0
    max_tokens = 16 if body.max_tokens is None else body.max_tokens
    scores = None
    if body.echo and body.logprobs is not None:  # the prompt's logprobs (lm-eval-harness's loglikelihood)
        scores = await asyncio.gather(*(svc.prompt_scores(ids, body.temperature, top) for ids in prompts))
    prompt_scores = None
    if body.prompt_logprobs is not None:  # vLLM's: the same scores, in vLLM's shape
        at_most_max_logprobs("prompt_logprobs", body.prompt_logprobs)
        asked = body.prompt_logprobs
        prompt_scores = await asyncio.gather(*(svc.prompt_scores(ids, body.temperature, asked) for ids in prompts))

    def echoed(p: int) -> str:
        return texts[p] if isinstance(texts[p], str) else decode(prompts[p], False)

    rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    head = {"id": rid, "object": "text_completion", "created": created, "model": svc.model_name}
    if max_tokens == 0:  # echo alone (checked by CompletionBody): the prompt, nothing generated
        choices = [
            (p, Completion([], [], "length", engine.weight_version), "", []) for p, _ in openai_jobs(prompts, body, 1)
        ]
    elif not body.stream:
        choices = await openai_choices(svc, prompts, body, max_tokens, top)
    else:
        return stream_completions(svc, body, head, prompts, scores, max_tokens, echoed)
    out_choices = []
    for i, (p, out, text, tops) in enumerate(choices):
        choice = {
            "index": i,
            "text": (echoed(p) if body.echo else "") + text,
            "finish_reason": finish(out),
            "logprobs": None,
            "token_ids": out.token_ids,
            "prompt_token_ids": prompts[p],
        }
        if body.logprobs is not None:
            ids, logprobs, alternatives = out.token_ids, out.logprobs or [], tops
            if scores is not None:
                ids, logprobs, alternatives = (prompts[p] + ids, scores[p][0] + logprobs, scores[p][1] + tops)
            choice["logprobs"] = completion_logprobs(ids, logprobs, alternatives, svc.token_text)
        if prompt_scores is not None:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(prompts[p], *prompt_scores[p], svc.token_text)
        if svc.return_routes and out.routed_experts is not None:  # vLLM's --enable-return-routed-experts
            choice["routed_experts"] = vllm_routes(out.routed_experts)
        out_choices.append(choice)
    used = usage(prompts, sum(len(out.token_ids) for _, out, _, _ in choices))
    if not body.stream:
        return {**head, "choices": out_choices, "usage": used}
    # (an echo with nothing generated, streamed: one chunk per choice)
    return sse(
        [{**head, "choices": [c]} for c in out_choices]
        + ([{**head, "choices": [], "usage": used}] if include_usage(body) else [])
    )


def stream_completions(
    svc: ServeService, body: CompletionBody, head: dict, prompts, scores, max_tokens: int, echoed
) -> StreamingResponse:
    jobs = openai_jobs(prompts, body, max_tokens)
    stops, top = stops_of(body), body.logprobs or 0
    for p, s in jobs:
        svc.check_job(prompts[p], s, stops, top)

    async def chunks():
        offsets, done = [0] * len(jobs), 0  # offsets: each choice's text so far, as its tokens spell it
        for i, (p, _) in enumerate(jobs):  # an echoed prompt first, as its own chunk
            if body.echo:
                logprobs = None if scores is None else completion_logprobs(prompts[p], *scores[p], svc.token_text)
                if logprobs is not None:
                    offsets[i] = sum(len(t) for t in logprobs["tokens"])
                yield {
                    **head,
                    "choices": [
                        {
                            "index": i,
                            "text": echoed(p),
                            "finish_reason": None,
                            "logprobs": logprobs,
                            "prompt_token_ids": prompts[p],
                        }
                    ],
                }
        async for i, token, logprob, alternatives, text in streamed(svc, prompts, jobs, stops, top):
            choice = {"index": i, "text": text, "finish_reason": None, "logprobs": None}
            if token is None:
                choice["finish_reason"] = logprob
            else:
                done += 1
                choice["token_ids"] = [token]
                if body.logprobs is not None:
                    choice["logprobs"] = completion_logprobs(
                        [token], [logprob], [alternatives], svc.token_text, offsets[i]
                    )
                    offsets[i] += len(choice["logprobs"]["tokens"][0])
            yield {**head, "choices": [choice]}
        if include_usage(body):
            yield {**head, "choices": [], "usage": usage(prompts, done)}

    return sse(chunks())


@router.post("/v1/chat/completions")
async def chat(body: ChatBody, request: Request):
    svc = service_of(request)
    tokenizer = svc.tokenizer
    if tokenizer is None:
        raise HTTPException(status_code=400, detail="chat completions need a tokenizer (start with a model folder)")
    at_most_max_logprobs("top_logprobs", body.top_logprobs)
    if body.top_logprobs and not body.logprobs:  # (vLLM's refusal)
        raise HTTPException(status_code=400, detail="top_logprobs needs logprobs: true")
    messages = [text_message(i, m) for i, m in enumerate(body.messages)]
    try:
        ids = list(
            tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        )
    except Exception as exc:  # the template rejected the messages: the caller's input
        raise HTTPException(status_code=400, detail=f"messages: {exc}") from exc
    limit = body.max_completion_tokens or body.max_tokens or 128
    top = (body.top_logprobs or 0) if body.logprobs else 0
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    head = {"id": rid, "created": created, "model": svc.model_name}
    if body.stream:
        return stream_chat(svc, body, {**head, "object": "chat.completion.chunk"}, ids, limit, top)
    choices = await openai_choices(svc, [ids], body, limit, top)
    used = usage([ids], sum(len(out.token_ids) for _, out, _, _ in choices))
    return {
        **head,
        "object": "chat.completion",
        "usage": used,
        "choices": [
            {
                "index": i,
                "message": {"role": "assistant", "content": text},
                "finish_reason": finish(out),
                "logprobs": chat_logprobs(out.token_ids, out.logprobs or [], tops, svc.token_text)
                if body.logprobs
                else None,
                "token_ids": out.token_ids,
                "prompt_token_ids": ids,
            }
            for i, (_, out, text, tops) in enumerate(choices)
        ],
    }


def stream_chat(
    svc: ServeService, body: ChatBody, head: dict, ids: list[int], limit: int, top: int
) -> StreamingResponse:
    jobs = openai_jobs([ids], body, limit)
    stops = stops_of(body)
    for _, s in jobs:
        svc.check_job(ids, s, stops, top)

    async def chunks():
        done = 0
        for i in range(len(jobs)):
            yield {
                **head,
                "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}],
            }
        async for i, token, logprob, alternatives, text in streamed(svc, [ids], jobs, stops, top):
            if token is None:
                yield {
                    **head,
                    "choices": [{"index": i, "delta": {"content": text} if text else {}, "finish_reason": logprob}],
                }
                continue
            done += 1
            yield {
                **head,
                "choices": [
                    {
                        "index": i,
                        "delta": {"content": text},
                        "finish_reason": None,
                        "logprobs": chat_logprobs([token], [logprob], [alternatives], svc.token_text)
                        if body.logprobs
                        else None,
                        "token_ids": [token],
                    }
                ],
            }
        if include_usage(body):
            yield {**head, "choices": [], "usage": usage([ids], done)}

    return sse(chunks())
