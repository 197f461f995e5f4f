"""A reward from a judge or reward model behind an OpenAI-compatible server (``reward.endpoint``).

Each sample is scored as it finishes (strop.rollout.generate.settle), at most ``reward.concurrency``
calls at once. The judge reads the prompt, the label and the response from a template; the response
sits between ``<response>`` tags and cannot close them (its own tags are escaped), so it is data, not
instructions. A response that is only formatting or an opener ("Solution:", "Let's solve this step by
step", punctuation: the "master keys" that fool LLM judges) is scored by a rule, ``reward.rule_reward``,
and never reaches the judge.

A call that times out, a server that is down or answers 5xx, and a verdict the parser cannot read are
retried with exponential backoff (tenacity), ``reward.retries`` times; past that the sample fails with a
:class:`JudgeError` naming the endpoint and the cause (counted, and the sample starts over under
``rollout.sample_retries``), never a silent zero. Counts: ``judge/calls``, ``judge/rule_scored``,
``judge/retries`` and ``judge/failures/<cause>``.
"""

from __future__ import annotations

import asyncio
import math
import re
from collections import Counter

import httpx
from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, wait_exponential

from strop.types import Sample

# what a response may consist of and still say nothing: openers and formatting (One Token to Fool LLM-as-a-Judge)
_OPENERS = re.compile(
    r"(?i)\b(thought process|let'?s solve (this|the) problem step by step|let'?s think step by step|"
    r"solution|answer|step \d+|final answer|reasoning)\b|解|答案|思考过程"
)
_NOT_CONTENT = re.compile(r"[\W_]+", re.UNICODE)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_TAGS = re.compile(r"</?\s*(response|question|reference)\s*>", re.IGNORECASE)


class JudgeError(RuntimeError):
    """The judge could not score a sample: down, too slow, an error status, or an unreadable verdict."""


class _Unreadable(ValueError):
    """A verdict the parser cannot read (retried: a sampled judge may answer better)."""


def says_nothing(text: str) -> bool:
    """True when ``text`` is only formatting, punctuation and reasoning openers: no content to judge."""
    return not _NOT_CONTENT.sub("", _OPENERS.sub("", text or ""))


def escape_slot(text: str) -> str:
    """The response as data inside its tags: its own ``<response>``-style tags cannot end the slot."""
    return _TAGS.sub(lambda m: m.group(0).replace("<", "&lt;").replace(">", "&gt;"), text)


def parse_verdict(parser: str, answer: str, low: float, high: float) -> float:
    """The score in ``answer``: ``verdict`` (the last 'VERDICT: x'), ``number`` (the last number) or
    ``yes_no`` (the last yes or no); it must lie in [low, high]. Raises :class:`_Unreadable`."""
    if parser == "yes_no":
        words = re.findall(r"(?i)\b(yes|no)\b", answer)
        if not words:
            raise _Unreadable(f"no yes or no in the judge's answer {answer[:200]!r}")
        return high if words[-1].lower() == "yes" else low
    found = (
        re.findall(r"(?i)VERDICT\s*:\s*(-?\d+(?:\.\d+)?)", answer) if parser == "verdict" else _NUMBER.findall(answer)
    )
    if not found:
        raise _Unreadable(f"no {'VERDICT: <number>' if parser == 'verdict' else 'number'} in {answer[:200]!r}")
    value = float(found[-1])
    if not (low <= value <= high) or not math.isfinite(value):
        raise _Unreadable(f"the verdict {value:g} is outside [{low:g}, {high:g}] in {answer[:200]!r}")
    return value


def _retryable(exc: BaseException) -> bool:
    if isinstance(exc, httpx.HTTPStatusError):
        return exc.response.status_code >= 500 or exc.response.status_code == 429
    return isinstance(exc, (httpx.TransportError, _Unreadable))


def _cause(exc: BaseException) -> str:
    if isinstance(exc, httpx.TimeoutException):
        return "timeout"
    if isinstance(exc, httpx.TransportError):
        return "unreachable"
    if isinstance(exc, httpx.HTTPStatusError):
        return f"status_{exc.response.status_code}"
    return "unreadable" if isinstance(exc, _Unreadable) else type(exc).__name__


class JudgeReward:
    """``reward.endpoint``'s judge; :meth:`score` is the reward hook (see the module)."""

    def __init__(self, rc, label_key: str = "label"):
        self.rc = rc
        self.base = rc.endpoint.rstrip("/")
        self.counts: Counter = Counter()
        self.in_flight = 0  # calls waiting for the judge now (judge/max_in_flight: the most since take_counts)
        self._per_loop: dict = {}  # event loop -> (client, semaphore): the check at start runs in another loop
        key = rc.api_key.get_secret_value() if rc.api_key is not None else ""
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}

    def take_counts(self) -> dict[str, int]:
        out, self.counts = dict(self.counts), Counter()
        return out

    def _client(self):
        loop = asyncio.get_running_loop()
        if loop not in self._per_loop:
            self._per_loop = {k: v for k, v in self._per_loop.items() if not k.is_closed()}
            client = httpx.AsyncClient(timeout=self.rc.timeout_s, headers=self.headers)
            self._per_loop[loop] = (client, asyncio.Semaphore(self.rc.concurrency))
        return self._per_loop[loop]

    def messages(self, sample: Sample) -> list[dict]:
        prompt = (
            sample.prompt
            if isinstance(sample.prompt, str)
            else "\n".join(str(m.get("content", "")) for m in sample.prompt)
        )
        text = self.rc.template.format(
            prompt=prompt,
            label="" if sample.label is None else sample.label,
            response=escape_slot(sample.response_text),
        )
        return [{"role": "user", "content": text}]

    async def score(self, sample: Sample) -> float:
        """The reward hook: the judge's verdict on ``sample`` (or the rule's, for a response that says nothing)."""
        if says_nothing(sample.response_text):
            self.counts["judge/rule_scored"] += 1
            return self.rc.rule_reward
        client, slots = self._client()
        body = {
            "model": self.rc.model,
            "messages": self.messages(sample),
            "max_tokens": self.rc.max_tokens,
            "temperature": 0.0,
        }
        try:
            async for attempt in AsyncRetrying(
                stop=stop_after_attempt(self.rc.retries + 1),
                wait=wait_exponential(multiplier=self.rc.backoff_s, max=30 * self.rc.backoff_s),
                retry=retry_if_exception(_retryable),
                reraise=True,
            ):
                with attempt:
                    if attempt.retry_state.attempt_number > 1:
                        self.counts["judge/retries"] += 1
                    async with slots:
                        self.counts["judge/calls"] += 1
                        self.in_flight += 1
                        self.counts["judge/max_in_flight"] = max(self.counts["judge/max_in_flight"], self.in_flight)
                        try:
                            response = await client.post(f"{self.base}/chat/completions", json=body)
                        finally:
                            self.in_flight -= 1
                    response.raise_for_status()
                    answer = _answer_text(response)
                    return parse_verdict(self.rc.parser, answer, self.rc.min_score, self.rc.max_score)
        except Exception as exc:
            self.counts[f"judge/failures/{_cause(exc)}"] += 1
            raise JudgeError(
                f"judge {self.base} (model {self.rc.model!r}) could not score sample group={sample.group_id} "
                f"index={sample.index} after {self.rc.retries + 1} tries: {_cause(exc)}: {type(exc).__name__}: {exc}"
            ) from exc
        raise AssertionError("unreachable")  # (tenacity returns or raises above)


def _answer_text(response: httpx.Response) -> str:
    try:
        return str(response.json()["choices"][0]["message"]["content"] or "")
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise _Unreadable(f"not a chat completion: {response.text[:200]!r}") from exc
