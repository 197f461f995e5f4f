"""Built-in reward functions. A reward function is a plain function of a Sample
(sync or async) that returns a float; see ``strop.plugins`` for the contract."""

from __future__ import annotations

import re

from strop.types import Sample

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?")


def _last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}), with nested braces balanced."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth, j = 1, i
    while j < len(text) and depth:
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        j += 1
    return text[i : j - 1] if depth == 0 else None


def extract_answer(text: str) -> str | None:
    """The answer a response commits to: the last \\boxed{} if any, else its last number."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    numbers = _NUMBER.findall(text)
    if not numbers:
        return None
    return numbers[-1].replace(",", "").rstrip(".")


def _as_math(s: str) -> str:
    s = str(s).strip()
    return s if s.startswith("$") or "\\boxed" in s else f"${s}$"


def math_equal(response: str, gold) -> bool:
    """True when the response's final answer equals ``gold`` mathematically (math-verify).

    Timeouts are off so this is safe outside the main thread (math-verify's
    signal-based timeouts raise there); the inputs are short answers, not
    whole documents, so parsing is bounded anyway.
    """
    from math_verify import parse, verify

    answer = extract_answer(response)
    if answer is None or gold is None:
        return False
    gold_parsed = parse(_as_math(gold), parsing_timeout=None)
    answer_parsed = parse(_as_math(answer), parsing_timeout=None)
    if not gold_parsed or not answer_parsed:
        return False
    return bool(verify(gold_parsed, answer_parsed, timeout_seconds=None))


def math_reward(sample: Sample) -> float:
    """1.0 when the final answer (boxed or last number) equals the label as math, else 0.0."""
    return 1.0 if math_equal(sample.response_text, sample.label) else 0.0


def exact_match_reward(sample: Sample) -> float:
    """1.0 when the extracted answer equals the label as a string (whitespace-trimmed)."""
    answer = extract_answer(sample.response_text)
    return 1.0 if answer is not None and answer.strip() == str(sample.label).strip() else 0.0


def reasoning_gym_reward(sample: Sample) -> float:
    """Score with the reasoning-gym task's own scorer (needs the task entry in metadata)."""
    import reasoning_gym

    entry = sample.metadata.get("reasoning_gym_entry")
    task = sample.metadata.get("reasoning_gym_task")
    if entry is None or task is None:
        raise ValueError(
            f"sample group={sample.group_id}: reasoning_gym_reward needs a reasoning-gym data source "
            "(metadata has no 'reasoning_gym_entry')"
        )
    scorer = reasoning_gym.get_score_answer_fn(task)
    answer = extract_answer(sample.response_text)
    return float(scorer(answer if answer is not None else sample.response_text, entry))


BUILTIN_REWARDS = {"math": math_reward, "exact_match": exact_match_reward, "reasoning_gym": reasoning_gym_reward}
