"""The JSON the agent proxy answers a call with: whole (a chat completion, a text completion) or as
a stream's chunks, and which tokens and text of a streamed answer may go out as they are decoded.

Every answer carries, beside OpenAI's fields, each choice's ``token_ids`` and ``weight_version``
and the call's ``prompt_token_ids``: the exact tokens the session recorded.
"""

from __future__ import annotations

import bisect
import json
import logging
import time
import uuid

from strop.agents.proxy_requests import ChatRequest, CompletionRequest, SamplingRequest
from strop.agents.session import Call, ChatState
from strop.serving.openai import include_usage, usage
from strop.serving.textstream import StreamedText

log = logging.getLogger("strop.agents")


def call_usage(call: Call) -> dict:
    """The call's usage (:func:`strop.serving.openai.usage`): its prompt and every choice's tokens."""
    return usage([call.prompt_ids], sum(len(c.completion.token_ids) for c in call.choices))


def _tool_calls(msg: dict) -> list[dict]:
    """A recorded assistant message's tool calls as OpenAI writes them (the arguments as JSON text)."""
    return [
        {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}}
        for c in msg.get("tool_calls", [])
    ]


def chat_answer(tokenizer, model_name: str, body: ChatRequest, call: Call, cut) -> dict:
    head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": model_name}
    answers = []
    for i, (choice, (out, _)) in enumerate(zip(call.choices, cut)):
        msg = choice.message
        calls = _tool_calls(msg)
        finish = "tool_calls" if calls else out.finish_reason
        lps = None
        if body.logprobs:
            toks = [tokenizer.decode([t], skip_special_tokens=False) for t in out.token_ids]
            lps = {
                "content": [
                    {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                    for t, lp in zip(toks, out.logprobs)
                ]
            }
        answers.append((i, msg["content"] if (msg["content"] or not calls) else None, calls, finish, lps, out))
    return {
        **head,
        "object": "chat.completion",
        "usage": call_usage(call),
        "prompt_token_ids": call.prompt_ids,
        "choices": [
            {
                "index": i,
                "message": {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})},
                "finish_reason": finish,
                "logprobs": lps,
                "token_ids": out.token_ids,
                "weight_version": out.weight_version,
            }
            for i, content, calls, finish, lps, out in answers
        ],
    }


def completion_answer(model_name: str, body: CompletionRequest, call: Call, cut) -> dict:
    head = {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model_name,
    }
    choices = [
        {
            "index": i,
            "text": text,
            "finish_reason": out.finish_reason,
            "logprobs": {"token_logprobs": out.logprobs, "tokens": None, "top_logprobs": None}
            if body.logprobs is not None
            else None,
            "token_ids": out.token_ids,
            "weight_version": out.weight_version,
        }
        for i, (out, text) in enumerate(cut)
    ]
    return {**head, "choices": choices, "usage": call_usage(call), "prompt_token_ids": call.prompt_ids}


def stream_head(chat: ChatState | None, model_name: str) -> dict:
    """The fields every chunk of one streamed call repeats."""
    kind = "chat.completion.chunk" if chat is not None else "text_completion"
    return {
        "id": f"{'chatcmpl' if chat is not None else 'cmpl'}-{uuid.uuid4().hex}",
        "object": kind,
        "created": int(time.time()),
        "model": model_name,
    }


def role_chunks(head: dict, n: int) -> list[dict]:
    """A chat stream's first chunks: the role, a chunk per choice."""
    return [
        {**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
        for i in range(n)
    ]


def token_chunk(
    tokenizer, head: dict, body: SamplingRequest, chat: ChatState | None, i: int, token: int, logprob: float, text: str
) -> dict:
    if chat is None:
        return {
            **head,
            "choices": [
                {
                    "index": i,
                    "text": text,
                    "finish_reason": None,
                    "token_ids": [token],
                    "logprobs": {"token_logprobs": [logprob], "tokens": None, "top_logprobs": None}
                    if body.logprobs is not None
                    else None,
                }
            ],
        }
    entry = {"index": i, "delta": {"content": text}, "finish_reason": None, "token_ids": [token]}
    if body.logprobs:
        name = tokenizer.decode([token], skip_special_tokens=False)
        entry["logprobs"] = {
            "content": [{"token": name, "logprob": logprob, "bytes": list(name.encode()), "top_logprobs": []}]
        }
    return {**head, "choices": [entry]}


def end_chunks(tokenizer, head: dict, body: SamplingRequest, call: Call, cut, views: list[LiveAnswer]) -> list[dict]:
    """Each choice's last chunks once its answer is recorded: the tokens not sent yet (past a held
    tool-call marker), the text not shown yet, its tool calls, its finish reason; then the usage."""
    chunks = []
    for i, (choice, (out, text), view) in enumerate(zip(call.choices, cut, views)):
        msg, calls = choice.message, []
        if msg is not None:
            calls = _tool_calls(msg)
            text = msg["content"] or ""
        ids, sent = list(out.token_ids), view.sent_tokens
        shown = view.shown
        if ids[:sent] != view.ids[:sent] or not text.startswith(shown):  # (not with a prefix-stable tokenizer)
            log.warning(
                "agent proxy: a streamed answer's chunks sent so far differ from its whole answer; "
                "the stream ends with the answer's rest as far as it agrees"
            )
        for k in range(sent, len(ids)):
            chunks.append(token_chunk(tokenizer, head, body, call.chat, i, ids[k], out.logprobs[k], ""))
        rest = text[len(shown) :] if text.startswith(shown) else ""
        end = {
            "index": i,
            "finish_reason": "tool_calls" if calls else out.finish_reason,
            "weight_version": out.weight_version,
        }
        if msg is None:
            chunks.append({**head, "choices": [{**end, "text": rest, "logprobs": None}]})
            continue
        if calls:  # the content not shown yet, then the calls
            if rest:
                chunks.append({**head, "choices": [{"index": i, "delta": {"content": rest}, "finish_reason": None}]})
            chunks.append(
                {
                    **head,
                    "choices": [
                        {
                            "index": i,
                            "finish_reason": None,
                            "delta": {"tool_calls": [{"index": k, **c} for k, c in enumerate(calls)]},
                        }
                    ],
                }
            )
            rest = ""
        chunks.append({**head, "choices": [{**end, "delta": {"content": rest} if rest else {}}]})
    if include_usage(body):
        chunks.append({**head, "choices": [], "usage": call_usage(call)})
    return chunks


def replayed_chunks(
    tokenizer, head: dict, body: SamplingRequest, call: Call, cut, views: list[LiveAnswer]
) -> list[dict]:
    """A stream's chunks from an engine that answers whole (beside the loop: it decodes every token)."""
    chat = call.chat
    chunks = role_chunks(head, len(cut)) if chat is not None else []
    for i, ((out, _), view) in enumerate(zip(cut, views)):
        for token, logprob in zip(out.token_ids, out.logprobs):
            chunks += [token_chunk(tokenizer, head, body, chat, i, *sent) for sent in view.push(token, logprob)]
    return chunks + end_chunks(tokenizer, head, body, call, cut, views)


def markers(tool_names: set[str]) -> tuple[str, ...]:
    """Where a tool call the proxy parses can start (:func:`strop.agents.chat.parse_reply`)."""
    if not tool_names:
        return ()
    return ("<tool_call>", "```") if "python" in tool_names else ("<tool_call>",)


class LiveAnswer:
    """One choice of a streamed call: which of its tokens and text may be sent as they are decoded,
    so that the chunks join to the plain call's answer. Every token up to the one whose text
    completes a stop string (none after: they are not the answer's), its text held while it may be
    the start of one (:class:`StreamedText`). With tools, also held until the answer is whole and its
    calls parsed: the text from where a tool-call marker starts (or what may still become one), and
    the tokens from there (a turn cut after its calls drops the tokens past them) or from a special
    token (whose text the shown text skips); space at the end (the content beside calls is stripped);
    and all text of an answer that begins with space (stripped only if it calls a tool)."""

    def __init__(self, decode, stops: list[str], markers: tuple[str, ...], special: set[int]):
        self.text = StreamedText(decode, stops)
        self.markers, self.special = markers, special
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.ends: list[int] = []  # the text's length after each token
        self.sent_tokens = self.sent_chars = 0
        self.marker_at: int | None = None  # where the first whole marker starts
        self.special_at: int | None = None  # the first special token's index

    @property
    def shown(self) -> str:
        return self.text.text[: self.sent_chars]

    def push(self, token: int, logprob: float) -> list[tuple[int, float, str]]:
        """``token`` decoded: the (token, logprob, text) chunks that may go out now, in order."""
        if self.text.stop_at is not None:
            return []
        before = len(self.text.text)
        self.ids.append(token)
        self.logprobs.append(logprob)
        self.text.push(token)
        text = self.text.text
        self.ends.append(len(text))
        tokens, chars = len(self.ids), self.text.ready
        if self.markers:
            if self.marker_at is None:  # (a marker first found now ends in the new text)
                found = [k for m in self.markers if (k := text.find(m, max(before - len(m) + 1, 0))) >= 0]
                self.marker_at = min(found) if found else None
            if self.special_at is None and token in self.special:
                self.special_at = len(self.ids) - 1
            hold = self.marker_at if self.marker_at is not None else len(text) - _partial(text, self.markers)
            tokens = bisect.bisect_right(self.ends, hold)  # the tokens whose text ends before the hold
            if self.special_at is not None:
                tokens = min(tokens, self.special_at)
            chars = min(chars, hold)
            chars = 0 if text[:1].isspace() else len(text[:chars].rstrip())
        chars = min(chars, self.ends[tokens - 1] if tokens else 0)  # (text goes out with its tokens)
        out = []
        for k in range(self.sent_tokens, tokens):
            upto = max(min(self.ends[k], chars), self.sent_chars)
            out.append((self.ids[k], self.logprobs[k], text[self.sent_chars : upto]))
            self.sent_chars = upto
        self.sent_tokens = max(self.sent_tokens, tokens)
        return out


def _partial(text: str, markers: tuple[str, ...]) -> int:
    """The length of the longest end of ``text`` that a marker starts with (it may become that marker)."""
    return max((k for m in markers for k in range(1, len(m)) if text.endswith(m[:k])), default=0)
