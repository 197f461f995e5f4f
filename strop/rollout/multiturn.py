"""Multi-turn generation with tools (ReTool-style), token in and token out.

The model writes a turn. If the turn holds a tool call (``<tool_call>{json}</tool_call>`` or a
fenced ```python block), the model's tokens up to the end of the call are kept and the rest of
the turn is dropped (never trained). The tool runs, and its output is tokenised once and
appended as an observation with loss mask 0. Then the next turn starts. This repeats until a
turn without a call (the final answer), ``max_turns``, or the response budget.

Token in, token out: model tokens are never re-tokenised, and each turn's prompt is the prompt
plus every response token so far, an exact prefix of the next turn's prompt. The sample's
per-token lists are checked after every turn.

The hardening rules, each with a unit test (tests/test_multiturn.py):

- a sample's response is reset on entry, so a retried sample starts clean;
- each turn's max new tokens = min(per-turn cap, the budget left);
- an engine result without logprobs (or with a count that does not match its tokens), or with
  finish reason abort, makes the sample ABORTED. It is never trained, and the rollout manager
  requeues it where partial or async rollout is on. Its tokens are not appended, and the
  ``aborted_fraction`` metric counts it (the issue's ``rollout/aborted_ratio``);
- tool output is capped in characters and in tokens, with a visible marker, then cut to the
  budget left; a cut observation makes the sample TRUNCATED.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from strop.rollout.generate import affinity_key
from strop.tools import ToolSet, parse_tool_call
from strop.types import SampleInvariantError, SamplingParams, Sample, Status


@dataclass(frozen=True)
class TurnLimits:
    max_turns: int = 4  # model turns, the final answer included
    max_turn_tokens: int = 256  # per-turn cap on new tokens
    output_chars: int = 2000  # tool output kept, in characters, before tokenisation
    output_tokens: int = 256  # and in tokens
    # observation framing for chat models (ChatML; SmolLM2 and Qwen use it): a user turn holding the
    # tool's output, then the assistant's next turn. {output} is the capped tool output.
    observation_template: str = (
        "<|im_end|>\n<|im_start|>user\n<tool_response>\n{output}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


class TurnError(SampleInvariantError):
    """The token bookkeeping of a multi-turn sample broke an invariant (a bug, never the sample's:
    as a SampleInvariantError it stops the run instead of failing the sample)."""


def cap_text(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return text[:limit] + f"\n[tool output truncated: {len(text) - limit} more characters]"


async def generate(ctx, sample: Sample, sampling: SamplingParams) -> Sample:
    """The multi-turn generate function (``plugins.generate``-compatible). Needs
    ``ctx.extra['tools']`` (a :class:`ToolSet`) and optionally ``ctx.extra['turn_limits']``."""
    tools: ToolSet = ctx.extra["tools"]
    limits: TurnLimits = ctx.extra.get("turn_limits") or TurnLimits()
    tok = ctx.tokenizer
    sample.reset_response()  # a retried sample carries nothing from its last attempt
    sample.metadata.update(tool_calls=0, tool_errors=0, turns=0)
    budget = sampling.max_new_tokens
    last_turn = (0, 0)
    for turn in range(limits.max_turns):
        left = budget - sample.response_length
        if left <= 0:
            sample.status = Status.TRUNCATED
            break
        prompt = sample.prompt_ids + sample.response_ids
        turn_sampling = dataclasses.replace(sampling, max_new_tokens=min(limits.max_turn_tokens, left))
        completion = await ctx.engine.generate(prompt, turn_sampling, affinity=affinity_key(sample))
        sample.metadata["turns"] = turn + 1
        ids, lps = list(completion.token_ids), completion.logprobs
        if completion.finish_reason == "abort" or lps is None or len(lps) != len(ids):
            sample.status = Status.ABORTED
            sample.metadata["abort_reason"] = (
                "engine aborted the request"
                if completion.finish_reason == "abort"
                else "engine returned no logprobs"
                if lps is None
                else f"engine returned {len(lps)} logprobs for {len(ids)} tokens"
            )
            break
        text = tok.decode(ids, skip_special_tokens=False)
        call = parse_tool_call(text)
        if call is not None:  # keep the model's tokens up to the end of the call, drop the rest of the turn
            keep = tokens_covering(tok, ids, call.end)
            ids, lps = ids[:keep], lps[:keep]
        turn_start = sample.response_length
        sample.append(ids, lps, weight_version=completion.weight_version)
        sample.take_routes(completion.routed_experts, prompt + list(completion.token_ids))  # MoE: R3's routes
        _check_prefix(sample, prompt)
        last_turn = (turn_start, sample.response_length)
        if call is None:
            sample.status = Status.COMPLETED if completion.finish_reason == "stop" else Status.TRUNCATED
            break
        if turn == limits.max_turns - 1:  # a call with no turn left to read its answer
            sample.status = Status.TRUNCATED
            sample.metadata["stopped"] = "max_turns"
            break
        output, ok = await tools.call(call)
        sample.metadata["tool_calls"] += 1
        sample.metadata["tool_errors"] += 0 if ok else 1
        obs = tok.encode(
            limits.observation_template.format(output=cap_text(output, limits.output_chars)), add_special_tokens=False
        )
        if len(obs) > limits.output_tokens:
            marker = tok.encode(
                f"\n[tool output truncated at {limits.output_tokens} tokens]\n", add_special_tokens=False
            )
            tail = tok.encode(limits.observation_template.split("{output}")[1], add_special_tokens=False)
            obs = obs[: max(limits.output_tokens - len(marker) - len(tail), 0)] + marker + tail
        left = budget - sample.response_length
        cut = len(obs) > left
        sample.append(obs[:left], trainable=False, weight_version=completion.weight_version)
        _check_prefix(sample, prompt)
        if cut:
            sample.status = Status.TRUNCATED
            sample.metadata["stopped"] = "budget in tool output"
            break
    # rewards score the model's last turn (a number in a tool's output is not the model's answer);
    # the whole exchange is kept for the logs
    sample.response_text = tok.decode(sample.response_ids[last_turn[0] : last_turn[1]], skip_special_tokens=True)
    sample.metadata["transcript"] = tok.decode(sample.response_ids, skip_special_tokens=True)
    return sample


def tokens_covering(tok, ids: list[int], end: int) -> int:
    """The fewest leading tokens of ``ids`` whose text reaches character ``end``."""
    lo, hi = 1, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(tok.decode(ids[:mid], skip_special_tokens=False)) >= end:
            hi = mid
        else:
            lo = mid + 1
    return hi


def _check_prefix(sample: Sample, prompt: list[int]) -> None:
    sample.check()
    now = sample.prompt_ids + sample.response_ids
    if now[: len(prompt)] != prompt:
        raise TurnError(
            f"sample group={sample.group_id} index={sample.index}: the turn's prompt is no longer a "
            "prefix of the sample's tokens"
        )
