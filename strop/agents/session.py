"""Agent sessions: every call of one agent run, recorded as exact tokens, cut into segments.

A session belongs to one rollout sample. Each call the agent makes through the proxy is
recorded with its prompt token ids and, per choice, the sampled token ids, their logprobs and
the weight version that sampled them. A **segment** is one growing token sequence, built as
strop's multi-turn rollout builds a sample: the first call's prompt, then for each later call
the tokens the model sampled (loss mask 1, their logprobs) and what the agent added after them
(tool results, user turns: loss mask 0).

A call **continues** a segment when its prompt starts with that segment's tokens so far plus
one choice of its last call: the recorded tokens are the prompt's start, so nothing the model
wrote is ever tokenised again. For a chat call the proxy builds that prompt itself whenever the
messages are the previous call's messages plus the assistant message it returned plus new ones
(:meth:`Session.continuation`): the new messages alone are rendered and tokenised. When the
agent rewrote or compacted its history, no segment's tokens start the prompt: the call opens a
new segment (a **fork**, counted). At the end each segment becomes a sample of the session's
group, all sharing the session's reward (:meth:`Session.samples`).
"""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass, field, replace

from strop.agents.chat import ChatRenderer, message_key
from strop.types import Completion, SamplingParams, Sample, Status

# how a session ended, and what that makes of its samples (None: from the last completion's finish)
ENDINGS = {
    "completed": None,
    "capped": None,
    "idle": Status.ABORTED,
    "timeout": Status.ABORTED,
    "aborted": Status.ABORTED,
    "agent_error": Status.FAILED,
    "no_reward": Status.FAILED,
    "closed": Status.ABORTED,
}


@dataclass
class Choice:
    completion: Completion  # what the engine sampled (cut after a stop string)
    message: dict | None = None  # chat: the assistant message returned, in check_messages' form


@dataclass
class ChatState:
    """A chat call's input, kept to continue from: its checked messages, tools and rendered text."""

    messages: list[dict]
    tools: list[dict] | None
    text: str


@dataclass
class Call:
    prompt_ids: list[int]
    choices: list[Choice]
    chat: ChatState | None = None


@dataclass
class Segment:
    sample: Sample  # prompt = the first call's prompt; response = every token up to the tip's prompt
    tip: Call  # the last call: its prompt is this segment's tokens so far

    def tokens_with(self, j: int) -> list[int]:
        return self.tip.prompt_ids + list(self.tip.choices[j].completion.token_ids)


class SessionLimitError(Exception):
    """A call past one of the session's caps (turns, tokens, context): answered with a 400."""


@dataclass
class SessionLimits:
    max_calls: int = 8  # calls per session
    max_call_tokens: int = 256  # new tokens per call (and the agent's own max_tokens, if lower)
    max_response_tokens: int = 512  # a segment's response: sampled tokens and what the agent added
    context_window: int = 2048


@dataclass
class Session:
    sample: Sample  # the rollout sample this session generates (its prompt, label, group)
    sampling: SamplingParams  # the rollout's: temperature, top-p and top-k the trainer applies too
    limits: SessionLimits
    id: str = field(default_factory=lambda: f"sess_{secrets.token_hex(8)}")
    key: str = field(default_factory=lambda: f"strop-{secrets.token_urlsafe(24)}")
    segments: list[Segment] = field(default_factory=list)
    state: str = "open"  # open, capped (no more generation; a reward still lands), or an ENDINGS key
    reason: str = ""
    reward: float | None = None
    calls: int = 0
    in_flight: int = 0
    last_active: float = field(default_factory=time.monotonic)
    unused_choices: int = 0  # choices of continued calls that the agent did not go on with
    sampling_overridden: int = 0
    last_rejected: bool = False  # the session's last call was answered 429 (backpressure)
    engine_error: BaseException | None = None  # an engine failure seen by a call: the run stops, not the sample
    last_segment: Segment | None = None
    ended: asyncio.Event = field(default_factory=asyncio.Event)  # set when the session closes

    @property
    def forks(self) -> int:
        return max(len(self.segments) - 1, 0)

    def touch(self) -> None:
        self.last_active = time.monotonic()

    # ---- the prompt of a call -------------------------------------------------------------
    def continuation(
        self, renderer: ChatRenderer, messages: list[dict], tools: list[dict] | None, full: str
    ) -> list[int] | None:
        """The prompt ids of a chat call that continues a segment: its recorded tokens, the
        template's end of the assistant turn, then the new messages rendered and tokenised
        alone. None when no segment's last call, with one of its choices, starts ``messages``.
        ``full``: ``messages`` rendered with the generation prompt."""
        for seg in reversed(self.segments):
            prev = seg.tip.chat
            n = len(prev.messages) if prev is not None else -1
            if prev is None or len(messages) <= n or messages[:n] != prev.messages or prev.tools != tools:
                continue
            said = message_key(messages[n])
            for j, choice in enumerate(seg.tip.choices):
                if choice.message is None or message_key(choice.message) != said:
                    continue
                upto = renderer.render(messages[: n + 1], tools, generation_prompt=False)
                if not (upto.startswith(prev.text) and full.startswith(upto)):
                    return None  # the template re-renders earlier turns differently: no exact prefix to keep
                closing = renderer.closing(prev.messages, tools)
                ids = list(choice.completion.token_ids)
                end = renderer.tokenizer.decode(ids[-1:], skip_special_tokens=False) if ids else ""
                # the turn's end the model did not write (all of it after a cut or the length limit)
                rest = closing[len(end) :] if end and closing.startswith(end) else closing
                return seg.tokens_with(j) + renderer.encode(rest + full[len(upto) :])
        return None

    def attach(self, prompt_ids: list[int], call: Call) -> Segment:
        """Record ``call``: it continues the segment whose tokens (with one choice of its last
        call) start ``prompt_ids``, or opens a new one (a fork, if there were segments)."""
        found = self._continued(prompt_ids)
        if found is not None:
            seg, j, had = found
            done = seg.tip.choices[j].completion
            seg.sample.append(done.token_ids, done.logprobs, weight_version=done.weight_version)
            seg.sample.append(prompt_ids[len(had) :], trainable=False, weight_version=done.weight_version)
            seg.sample.take_routes(done.routed_experts, had)  # MoE: the engine's routes of the turn it continues
            self.unused_choices += len(seg.tip.choices) - 1
            seg.tip = call
            self.last_segment = seg
            return seg
        s = self.sample
        sample = Sample(
            prompt=s.prompt,
            prompt_ids=list(prompt_ids),
            label=s.label,
            group_id=s.group_id,
            index=s.index,
            metadata=dict(s.metadata),
        )
        seg = Segment(sample, call)
        self.segments.append(seg)
        self.last_segment = seg
        return seg

    def room(self, prompt_ids: list[int], asked: int | None) -> int:
        """New tokens this call may sample; raise :class:`SessionLimitError` (and cap the session)
        if none."""
        if self.calls >= self.limits.max_calls:
            self.cap(f"the session's {self.limits.max_calls} calls are spent (agent.max_calls)")
        seg_start = self._segment_start(prompt_ids)
        used = len(prompt_ids) - seg_start
        left = min(
            self.limits.max_response_tokens - used,
            self.limits.context_window - len(prompt_ids) - 1,
            self.limits.max_call_tokens,
            asked or self.limits.max_call_tokens,
        )
        if left <= 0:
            self.cap(
                f"no tokens left: this segment holds {used} response tokens of agent.max_response_tokens="
                f"{self.limits.max_response_tokens}, its prompt {len(prompt_ids)} tokens of the "
                f"{self.limits.context_window}-token context window"
            )
        return left

    def _continued(self, prompt_ids: list[int]) -> tuple[Segment, int, list[int]] | None:
        """The segment, choice and tokens so far that start ``prompt_ids`` (newest segment first), or None."""
        for seg in reversed(self.segments):
            for j in range(len(seg.tip.choices)):
                had = seg.tokens_with(j)
                if prompt_ids[: len(had)] == had:
                    return seg, j, had
        return None

    def _segment_start(self, prompt_ids: list[int]) -> int:
        """Where the segment ``prompt_ids`` would join starts its response (a new one: at its end)."""
        found = self._continued(prompt_ids)
        return len(found[0].sample.prompt_ids) if found is not None else len(prompt_ids)

    def cap(self, why: str) -> None:
        self.state, self.reason = "capped", why
        raise SessionLimitError(f"session {self.id}: {why}")

    # ---- the end ------------------------------------------------------------------------
    def close(self, state: str, reason: str = "") -> None:
        """End the session as ``state`` (an ENDINGS key). A capped session stays capped when its agent
        then returns or fails (the cap's 400 is why); an idle, timed-out or rewardless one does not."""
        if self.state == "open" or (self.state == "capped" and state in ("idle", "timeout", "aborted", "no_reward")):
            self.state, self.reason = state, reason or self.reason

    def samples(self) -> list[Sample]:
        """One sample per segment (the last call's first choice closes it), sharing the session's
        reward; the status from the session's ending, else from the last completion's finish. New
        samples each time: the session is unchanged, so it can be read back while it goes on."""
        forced = ENDINGS.get(self.state)
        out = []
        for k, seg in enumerate(self.segments):
            s = replace(
                seg.sample,
                response_ids=list(seg.sample.response_ids),
                metadata=dict(seg.sample.metadata),
                rollout_logprobs=list(seg.sample.rollout_logprobs),
                loss_mask=list(seg.sample.loss_mask),
                weight_versions=list(seg.sample.weight_versions),
            )
            if seg.tip.choices:
                done = seg.tip.choices[0].completion
                s.append(done.token_ids, done.logprobs, weight_version=done.weight_version)
                s.take_routes(done.routed_experts, seg.tokens_with(0))
                s.status = {"stop": Status.COMPLETED, "length": Status.TRUNCATED}.get(
                    done.finish_reason, Status.ABORTED
                )
            else:
                s.status = Status.ABORTED
            if self.state == "capped" and seg is self.last_segment:
                s.status = Status.TRUNCATED if s.status == Status.COMPLETED else s.status
            if forced is not None:
                s.status = forced
            s.reward = self.reward if s.status.trainable else None
            s.metadata.update(
                agent_session=self.id,
                session_state=self.state,
                segment=k,
                segments=len(self.segments),
                session_calls=self.calls,
            )
            if self.reason:
                s.metadata["session_reason"] = self.reason
            out.append(s)
        return out
