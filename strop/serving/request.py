"""A request to the embedded engine: the errors that refuse one alone, the pause modes, and the record
of a request waiting for a batch (shared by :mod:`strop.serving.embedded` and :mod:`strop.serving.scheduler`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from strop.types import Completion, SamplingParams


class RequestError(ValueError):
    """The request itself is invalid (an empty prompt, a token id outside the vocabulary, a seed
    or sampling value out of range): it fails alone, before it reaches a batch."""


class PromptTooLongError(RequestError):
    pass


class SessionError(RequestError):
    """A weight-update call out of order: no session open, one already open, or a bucket sent
    while another is being received."""


SEED_RANGE = (-(2**63), 2**64)  # what torch.Generator.manual_seed takes


# SGLang's three modes and vLLM's (abort is both): see strop.serving.engine_weights.WeightUpdates.pause
PAUSE_MODES = ("abort", "retract", "in_place", "wait", "keep")

# called with (token id, its logprob, {token id: logprob} of the most likely tokens or None) per decoded token
TokenListener = Callable[[int, float, dict[int, float] | None], None]


@dataclass
class PendingRequest:
    """A request waiting for (or retracted from) a batch: what it asked, and how it is answered."""

    prompt_ids: list[int]
    sampling: SamplingParams
    future: asyncio.Future
    request_id: str | None = None
    # a retracted row: the tokens it had (now part of prompt_ids) and its seeded generator
    done_ids: list[int] = field(default_factory=list)
    done_logprobs: list[float] = field(default_factory=list)
    generator: torch.Generator | None = None
    on_token: TokenListener | None = None
    top_logprobs: int = 0  # alternatives per token handed to on_token (0: none computed)
    emitted: int = 0  # tokens of the current row handed to on_token so far
    done_versions: list[int] = field(default_factory=list)  # per done_ids token, the weights' version that sampled it

    def completion(
        self, token_ids: list[int], logprobs: list[float], finish: str, version: int, routes=None
    ) -> Completion:
        """The answer; a request retracted across a weight version says which version sampled each token.
        ``routes``: the routed experts of the row's prompt (for a retracted request: the tokens so far too, as
        prefilled again) and fed tokens (strop.serving.moe)."""
        versions = self.done_versions + [version] * len(token_ids)
        spans = versions if self.done_versions and len(set(versions)) > 1 else None
        return Completion(self.done_ids + token_ids, self.done_logprobs + logprobs, finish, version, spans, routes)
